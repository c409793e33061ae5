//! Engine choice. Which engine is fastest depends on the CPU (VAES, AES-NI, none) and the
//! spec, so it is measured, not assumed: the first request for each spec shape times every
//! supporting engine on a few hundred KiB and the winner is remembered for the process.
//!
//! Candidates: `vaes` (our AES-XTS on 256-bit VAES registers; x86-64 CPUs with VAES and
//! VPCLMULQDQ), `openssl` (its AVX-512 XTS where the CPU shows AVX-512, AES-NI otherwise)
//! and `rustcrypto` (portable). Engines that cannot run a spec on this CPU do not take part.
//!
//! `CRYPTBLK_ENGINE=vaes|openssl|rustcrypto` skips the measurement and forces an engine (for
//! benchmarking, for tests and CI that must exercise every path, and for working around a
//! misbehaving engine); it is an error if the forced engine cannot do the spec on this CPU,
//! never a silent switch. A comma-separated list (`vaes,openssl`) forces the first listed
//! engine that can do each spec, so a whole test suite can run on an engine that lacks some
//! ciphers (vaes has no CBC) while the others go to the next name. `force_engine` does the
//! same from a program (the CLI's `--crypto-engine`) and takes precedence over the variable.

use crate::engine::{openssl::OpensslEngine, rustcrypto::RustCryptoEngine};
use crate::{CipherSpec, CryptoError, Direction, Engine, SecretKey};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

/// Environment variable that forces an engine by name.
pub const ENGINE_ENV: &str = "CRYPTBLK_ENGINE";

const PROBE_BYTES: usize = 256 * 1024;
const PROBE_SECTOR: usize = 4096;
const PROBE_ROUNDS: usize = 3;

/// Every engine name `CRYPTBLK_ENGINE` accepts, on any architecture.
pub const ENGINE_NAMES: &[&str] = &["vaes", "openssl", "rustcrypto"];

/// Every engine compiled in, fastest-expected first. An engine may still not support a
/// spec on this CPU (`vaes` without VAES): ask `Engine::supports`.
pub fn engines() -> Vec<Arc<dyn Engine>> {
    vec![
        #[cfg(target_arch = "x86_64")]
        Arc::new(crate::engine::vaes::VaesEngine),
        Arc::new(OpensslEngine),
        Arc::new(RustCryptoEngine),
    ]
}

/// The engines `force_engine` set, in order of preference; overrides `CRYPTBLK_ENGINE`.
static FORCED: RwLock<Option<Vec<&'static str>>> = RwLock::new(None);

/// Forces every later `default_engine_for` in this process to `names`: one of
/// `ENGINE_NAMES` (any case), or several separated by commas, each spec taking the first
/// that can run it. `None` returns to `CRYPTBLK_ENGINE` or the measured choice. Refuses a name
/// that is not an engine compiled into this build (vaes off x86-64), changing nothing.
pub fn force_engine(names: Option<&str>) -> Result<(), CryptoError> {
    let forced = match names {
        None => None,
        Some(names) => Some(engine_list(names)?),
    };
    *FORCED.write().unwrap_or_else(|p| p.into_inner()) = forced;
    Ok(())
}

/// The engine names of a comma-separated list, each compiled into this build.
fn engine_list(names: &str) -> Result<Vec<&'static str>, CryptoError> {
    let all = engines();
    let list = names
        .split(',')
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty())
        .map(|n| match all.iter().find(|e| e.name() == n) {
            Some(e) => Ok(e.name()),
            None => Err(unknown_engine(n)),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if list.is_empty() {
        return Err(unknown_engine(names.to_string()));
    }
    Ok(list)
}

fn unknown_engine(name: String) -> CryptoError {
    CryptoError::Unsupported {
        what: if ENGINE_NAMES.contains(&name.as_str()) {
            "crypto engine on this architecture (vaes is x86-64 only)"
        } else {
            "crypto engine (known: vaes, openssl, rustcrypto)"
        },
        name,
    }
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
    let forced = FORCED.read().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some(forced) = forced {
        return forced_engine(spec, &forced, "--crypto-engine", all);
    }
    if let Ok(names) = std::env::var(ENGINE_ENV) {
        let forced = engine_list(&names).map_err(|e| match e {
            CryptoError::Unsupported { what, name } => CryptoError::Unsupported {
                what,
                name: format!("{name} (from {ENGINE_ENV})"),
            },
            other => other,
        })?;
        return forced_engine(spec, &forced, ENGINE_ENV, all);
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

/// The first engine of `forced` (set by `by`: the variable or the option) that can do `spec`
/// here; otherwise the reason.
fn forced_engine(
    spec: &CipherSpec,
    forced: &[&'static str],
    by: &str,
    all: Vec<Arc<dyn Engine>>,
) -> Result<Arc<dyn Engine>, CryptoError> {
    let mut listed = all
        .into_iter()
        .filter(|e| forced.contains(&e.name()))
        .collect::<Vec<_>>();
    // In the order the list gives, not the order engines are compiled in.
    listed.sort_by_key(|e| forced.iter().position(|n| *n == e.name()));
    if let Some(engine) = listed.iter().find(|e| e.supports(spec)) {
        return Ok(engine.clone());
    }
    let why = listed
        .iter()
        .map(|e| format!("{} {}", e.name(), why_not(e.as_ref())))
        .collect::<Vec<_>>()
        .join("; ");
    Err(CryptoError::Unsupported {
        what: "cipher for the crypto engine forced",
        name: format!(
            "{spec} on {}, forced by {by}: {why}; leave the choice to cryptblk or force \
             another engine",
            forced.join(",")
        ),
    })
}

/// Why `engine` cannot run a spec it does not support: a CPU it cannot run on, or the cipher.
fn why_not(engine: &dyn Engine) -> String {
    #[cfg(target_arch = "x86_64")]
    if engine.name() == crate::engine::vaes::NAME {
        let missing = crate::engine::vaes::missing_cpu_features();
        if !missing.is_empty() {
            return format!("needs a CPU with {}", missing.join(", "));
        }
    }
    let _ = engine;
    "does not implement this cipher".to_string()
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
