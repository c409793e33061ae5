//! `cargo run --release -p cryptblk-crypto --example small_calls [-- seconds-per-cell]`
//!
//! The cost of one call of request size: 4 KiB through `SectorCipher::crypt` (for the `vaes`
//! and `openssl` engines, their `crypt_raw`) and through `CryptoPool::crypt` (inline below the
//! threshold, as the request path calls it), per engine and direction, as GB/s of the calling
//! thread's CPU time (robust on a shared machine) and nanoseconds per call. The large-buffer
//! numbers of `examples/bench.rs` hide the per-call overhead this one shows.

use cryptblk_crypto::{engines, CipherSpec, CryptoPool, Direction, SecretKey};
use std::time::Duration;

const CALL: usize = 4096;

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.5);
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).expect("spec");
    let key = SecretKey::random(64).expect("key");
    let pool = CryptoPool::new(2);
    println!("engine     call  dir      cpu-GB/s  ns/call");
    for engine in engines() {
        if !engine.supports(&spec) {
            continue;
        }
        let cipher = match engine.new_cipher(&spec, &key, 4096) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{}: {e}", engine.name());
                continue;
            }
        };
        for dir in [Direction::Encrypt, Direction::Decrypt] {
            let direct = measure(secs, |buf, s| cipher.crypt(dir, s, buf).expect("crypt"));
            let pooled = measure(secs, |buf, s| {
                pool.crypt(&cipher, dir, s, buf).expect("pool crypt")
            });
            for (how, ns) in [("cipher", direct), ("pool", pooled)] {
                println!(
                    "{:<10} {:<5} {:<8} {:>8.2}  {:>7.0}",
                    engine.name(),
                    how,
                    format!("{dir:?}"),
                    CALL as f64 / ns,
                    ns
                );
            }
        }
    }
}

/// CPU nanoseconds of this thread per call of `f` on a 4 KiB buffer, over about `secs`.
fn measure(secs: f64, mut f: impl FnMut(&mut [u8], u64)) -> f64 {
    let mut buf = vec![0x5au8; CALL];
    f(&mut buf, 0);
    let budget = Duration::from_secs_f64(secs);
    let start = thread_cpu();
    let mut calls = 0u64;
    while thread_cpu() - start < budget {
        for _ in 0..256 {
            f(&mut buf, calls);
            calls += 1;
        }
    }
    (thread_cpu() - start).as_nanos() as f64 / calls as f64
}

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid place for the result.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
