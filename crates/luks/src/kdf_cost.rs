//! Choosing a new keyslot's KDF from the caller's `PbkdfOptions`: the cost it pins, or one
//! benchmarked like cryptsetup's `--iter-time`, within cryptsetup's floors and bounds. Apart
//! from `kdf` (what a keyslot stores and deriving with it), which needs no caller options.
use crate::kdf::{
    argon2_into, Argon2Variant, Kdf, MAX_ARGON2_MEMORY_KIB, MAX_ARGON2_PARALLEL,
    MIN_ARGON2_MEMORY_KIB, MIN_ARGON2_TIME, MIN_PBKDF2_ITERATIONS,
};
use crate::{HashAlg, LuksError, PbkdfKind, PbkdfOptions, Result};
use std::time::{Duration, Instant};
use zeroize::Zeroizing;

/// Turn cost options into a concrete `Kdf`: the forced cost if given, else a benchmark aiming
/// at `opts.iter_time_ms` for one derivation of `key_len` bytes.
pub fn resolve(opts: &PbkdfOptions, key_len: usize) -> Result<Kdf> {
    match opts.kind {
        PbkdfKind::Pbkdf2 => {
            let iterations = match opts.force_iterations {
                Some(n) => n,
                None => bench_pbkdf2(opts.hash, key_len, opts.iter_time_ms),
            };
            if iterations < MIN_PBKDF2_ITERATIONS {
                return Err(LuksError::InvalidArgument(format!(
                    "PBKDF2 iterations {iterations} below the minimum of {MIN_PBKDF2_ITERATIONS}"
                )));
            }
            Ok(Kdf::Pbkdf2 {
                hash: opts.hash,
                iterations,
            })
        }
        PbkdfKind::Argon2(variant) => {
            check_argon2_limits(opts)?;
            match opts.force_iterations {
                Some(time) if time < MIN_ARGON2_TIME => Err(LuksError::InvalidArgument(format!(
                    "argon2 time cost {time} below the minimum of {MIN_ARGON2_TIME}"
                ))),
                Some(time) => Ok(Kdf::Argon2 {
                    variant,
                    time,
                    memory_kib: opts.memory_kib,
                    parallel: opts.parallel,
                }),
                None => bench_argon2(variant, opts, key_len),
            }
        }
    }
}

fn check_argon2_limits(opts: &PbkdfOptions) -> Result<()> {
    if !(1..=MAX_ARGON2_PARALLEL).contains(&opts.parallel) {
        return Err(LuksError::InvalidArgument(format!(
            "argon2 parallel cost {} outside 1..={MAX_ARGON2_PARALLEL}",
            opts.parallel
        )));
    }
    let min_mem = MIN_ARGON2_MEMORY_KIB.max(8 * opts.parallel);
    if !(min_mem..=MAX_ARGON2_MEMORY_KIB).contains(&opts.memory_kib) {
        return Err(LuksError::InvalidArgument(format!(
            "argon2 memory {} KiB outside {min_mem}..={MAX_ARGON2_MEMORY_KIB} KiB",
            opts.memory_kib
        )));
    }
    Ok(())
}

/// Time a PBKDF2 run long enough to measure (at least ~50 ms), then scale the count linearly.
fn bench_pbkdf2(hash: HashAlg, key_len: usize, target_ms: u32) -> u32 {
    let salt = [0u8; 32];
    let mut out = Zeroizing::new(vec![0u8; key_len.max(1)]);
    let mut iterations: u32 = 1000;
    loop {
        let start = Instant::now();
        hash.pbkdf2(b"cryptblk benchmark", &salt, iterations, &mut out);
        let elapsed = start.elapsed();
        if elapsed >= Duration::from_millis(50) || iterations >= u32::MAX / 2 {
            return scale(iterations, elapsed, target_ms).max(MIN_PBKDF2_ITERATIONS);
        }
        iterations = iterations.saturating_mul(2);
    }
}

/// Like cryptsetup: measure at the requested memory with the minimum time cost; if even that is
/// too slow, halve the memory (down to the floor) instead of going below the minimum passes.
fn bench_argon2(variant: Argon2Variant, opts: &PbkdfOptions, key_len: usize) -> Result<Kdf> {
    let salt = [0u8; 32];
    let mut out = Zeroizing::new(vec![0u8; key_len.max(4)]);
    let target = Duration::from_millis(u64::from(opts.iter_time_ms.max(1)));
    let min_mem = MIN_ARGON2_MEMORY_KIB.max(8 * opts.parallel);
    let mut memory_kib = opts.memory_kib;
    loop {
        let start = Instant::now();
        argon2_into(
            variant,
            MIN_ARGON2_TIME,
            memory_kib,
            opts.parallel,
            b"cryptblk benchmark",
            &salt,
            &mut out,
        )?;
        let elapsed = start.elapsed();
        if elapsed > target && memory_kib > min_mem {
            memory_kib = (memory_kib / 2).max(min_mem);
            continue;
        }
        let time = scale(MIN_ARGON2_TIME, elapsed, opts.iter_time_ms).max(MIN_ARGON2_TIME);
        return Ok(Kdf::Argon2 {
            variant,
            time,
            memory_kib,
            parallel: opts.parallel,
        });
    }
}

/// Iterations for the PBKDF2 digest that verifies a volume key. cryptsetup spends a fixed
/// 125 ms on it for LUKS1 and LUKS2 alike, with 1000 as the floor; a forced keyslot cost means
/// "no benchmark" (tests, scripted setups), so the floor.
pub fn digest_iterations(hash: HashAlg, pbkdf: &PbkdfOptions, digest_len: usize) -> Result<u32> {
    const DIGEST_ITER_TIME_MS: u32 = 125;
    if pbkdf.force_iterations.is_some() {
        return Ok(MIN_PBKDF2_ITERATIONS);
    }
    let bench = PbkdfOptions {
        kind: PbkdfKind::Pbkdf2,
        hash,
        iter_time_ms: DIGEST_ITER_TIME_MS,
        force_iterations: None,
        ..pbkdf.clone()
    };
    Ok(match resolve(&bench, digest_len)? {
        Kdf::Pbkdf2 { iterations, .. } => iterations.max(MIN_PBKDF2_ITERATIONS),
        Kdf::Argon2 { .. } => MIN_PBKDF2_ITERATIONS,
    })
}

/// `count` took `elapsed`; how many fit in `target_ms`?
fn scale(count: u32, elapsed: Duration, target_ms: u32) -> u32 {
    let elapsed_us = elapsed.as_micros().max(1);
    let scaled = u128::from(count) * u128::from(target_ms) * 1000 / elapsed_us;
    u32::try_from(scaled).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_forced_and_minimums() {
        assert_eq!(
            resolve(&PbkdfOptions::pbkdf2_iterations(HashAlg::Sha512, 1500), 64).unwrap(),
            Kdf::Pbkdf2 {
                hash: HashAlg::Sha512,
                iterations: 1500
            }
        );
        let mut o = PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000);
        assert_eq!(
            resolve(&o, 32).unwrap(),
            Kdf::Pbkdf2 {
                hash: HashAlg::Sha256,
                iterations: 1000
            }
        );
        o.force_iterations = Some(999);
        assert!(resolve(&o, 32).is_err());
        o.kind = PbkdfKind::Argon2(Argon2Variant::Argon2id);
        o.memory_kib = 32;
        o.parallel = 1;
        o.force_iterations = Some(3);
        assert!(resolve(&o, 32).is_err());
    }

    #[test]
    fn pbkdf2_benchmark_scales_with_target() {
        let o = PbkdfOptions {
            kind: PbkdfKind::Pbkdf2,
            iter_time_ms: 100,
            ..PbkdfOptions::default()
        };
        let Kdf::Pbkdf2 { iterations, .. } = resolve(&o, 32).unwrap() else {
            panic!("wrong kind")
        };
        // Any real machine does far more than 1000 sha256 iterations in 100 ms, and the
        // benchmark must not return something absurd either.
        assert!(
            iterations > 1000 && iterations < 100_000_000,
            "{iterations}"
        );
    }

    #[test]
    fn argon2_benchmark_lowers_memory_when_slow() {
        let o = PbkdfOptions {
            kind: PbkdfKind::Argon2(Argon2Variant::Argon2id),
            iter_time_ms: 1,
            memory_kib: 64 * 1024,
            parallel: 1,
            ..PbkdfOptions::default()
        };
        let Kdf::Argon2 {
            time, memory_kib, ..
        } = resolve(&o, 32).unwrap()
        else {
            panic!("wrong kind")
        };
        assert!(time >= MIN_ARGON2_TIME);
        assert!(memory_kib < 64 * 1024, "{memory_kib}");
    }
}
