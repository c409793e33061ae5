//! Engine choice. Which engine is fastest depends on the CPU (VAES, AES-NI, none) and the
//! spec, so it is measured, not assumed: the first request for each spec shape times every
//! supporting engine on a few hundred KiB and the winner is remembered for the process.
//!
//! `CRYPTBLK_ENGINE=openssl|rustcrypto` skips the measurement and forces an engine (for
//! benchmarking and for working around a misbehaving library); it is an error if the forced
//! engine cannot do the spec.

use crate::engine::{openssl::OpensslEngine, rustcrypto::RustCryptoEngine};
use crate::{CipherSpec, CryptoError, Direction, Engine, SecretKey};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Environment variable that forces an engine by name.
pub const ENGINE_ENV: &str = "CRYPTBLK_ENGINE";

const PROBE_BYTES: usize = 256 * 1024;
const PROBE_SECTOR: usize = 4096;
const PROBE_ROUNDS: usize = 3;

/// Every engine compiled in, fastest-expected first.
pub fn engines() -> Vec<Arc<dyn Engine>> {
    vec![Arc::new(OpensslEngine), Arc::new(RustCryptoEngine)]
}

/// The portable engine (RustCrypto), used for cross-checks and as the fallback.
pub fn portable_engine() -> Arc<dyn Engine> {
    Arc::new(RustCryptoEngine)
}

/// The engine to use for `spec` on this CPU, chosen by a short measurement the first time it
/// is asked for each spec shape and cached for the process.
pub fn default_engine_for(spec: &CipherSpec) -> Result<Arc<dyn Engine>, CryptoError> {
    crate::iv::check_supported(spec)?;
    let all = engines();
    if let Ok(forced) = std::env::var(ENGINE_ENV) {
        let forced = forced.trim().to_ascii_lowercase();
        let engine = all
            .into_iter()
            .find(|e| e.name() == forced)
            .ok_or_else(|| CryptoError::Unsupported {
                what: "engine (from CRYPTBLK_ENGINE; known: openssl, rustcrypto)",
                name: forced.clone(),
            })?;
        if !engine.supports(spec) {
            return Err(CryptoError::Unsupported {
                what: "spec for the engine forced by CRYPTBLK_ENGINE",
                name: format!("{spec} on {forced}"),
            });
        }
        return Ok(engine);
    }

    static CHOICE: OnceLock<Mutex<HashMap<String, &'static str>>> = OnceLock::new();
    // The shape, not the spec's identity: same mode, key size and IV kind perform the same.
    let shape = spec.to_luks2_string() + &format!("/{}", spec.key_bytes());
    let cache = CHOICE.get_or_init(|| Mutex::new(HashMap::new()));
    // Held across the measurement so concurrent first requests measure once; a poisoned map
    // only means a measurement panicked, and the map itself is still consistent.
    let mut map = cache.lock().unwrap_or_else(|p| p.into_inner());
    let name = match map.get(&shape) {
        Some(name) => *name,
        None => {
            let name = measure_best(spec, &all)?;
            map.insert(shape, name);
            name
        }
    };
    all.into_iter()
        .find(|e| e.name() == name)
        .ok_or_else(|| CryptoError::Unsupported {
            what: "engine",
            name: name.to_string(),
        })
}

fn measure_best(spec: &CipherSpec, all: &[Arc<dyn Engine>]) -> Result<&'static str, CryptoError> {
    // A throwaway random key: measuring must never touch a real volume key.
    let key = SecretKey::random(spec.key_bytes())?;
    let mut buf = vec![0u8; PROBE_BYTES];
    let mut best: Option<(&'static str, Duration)> = None;
    for engine in all.iter().filter(|e| e.supports(spec)) {
        let Ok(cipher) = engine.new_cipher(spec, &key, PROBE_SECTOR) else {
            continue;
        };
        let mut fastest = Duration::MAX;
        let mut ok = true;
        for _ in 0..PROBE_ROUNDS {
            let t = Instant::now();
            if cipher.crypt(Direction::Encrypt, 0, &mut buf).is_err() {
                ok = false;
                break;
            }
            fastest = fastest.min(t.elapsed());
        }
        if ok && best.is_none_or(|(_, b)| fastest < b) {
            best = Some((engine.name(), fastest));
        }
    }
    best.map(|(n, _)| n)
        .ok_or_else(|| CryptoError::Unsupported {
            what: "cipher spec (no engine supports it)",
            name: spec.to_string(),
        })
}
