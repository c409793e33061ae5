//! Throughput benchmark of every engine, single-threaded and through the pool. Used by
//! `cryptblk bench` and `examples/bench.rs`; the numbers also back `default_engine_for`'s
//! premise that the choice must be measured per machine.

use crate::{default_engine_for, engines, CipherSpec, CryptoPool, Direction, SecretKey};
use serde::Serialize;
use std::fmt;
use std::time::{Duration, Instant};

/// What to measure and for how long.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Time spent on each measurement cell (one engine, spec, sector size and direction).
    pub seconds_per_cell: f64,
    /// Bytes per `crypt` call on one thread; the pool gets this much per worker per call.
    pub buffer_bytes: usize,
    /// Pool size; `None` means one worker per core.
    pub threads: Option<usize>,
    /// Restrict to these engine names; `None` means all.
    pub engines: Option<Vec<String>>,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            seconds_per_cell: 0.2,
            buffer_bytes: 1 << 20,
            threads: None,
            engines: None,
        }
    }
}

/// One engine × spec × sector size. Throughput in GB/s (10^9 bytes per second).
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub engine: String,
    pub cipher: String,
    pub key_bits: usize,
    pub sector_size: usize,
    pub single_encrypt_gbps: f64,
    pub single_decrypt_gbps: f64,
    /// Single-thread throughput per second of the thread's own CPU time: unlike wall-clock
    /// figures it does not drop when other processes compete for the core.
    pub single_encrypt_cpu_gbps: f64,
    pub single_decrypt_cpu_gbps: f64,
    pub pool_encrypt_gbps: f64,
    pub pool_decrypt_gbps: f64,
    /// Whether `default_engine_for` picks this engine for this spec on this machine.
    pub is_default: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub cpu_model: String,
    /// The AES-relevant CPU flags present (aes, vaes, vpclmulqdq, avx2, avx512f, ...).
    pub cpu_flags: Vec<String>,
    pub pool_threads: usize,
    pub seconds_per_cell: f64,
    pub buffer_bytes: usize,
    pub results: Vec<BenchResult>,
    /// Cells that could not run, with the reason.
    pub skipped: Vec<String>,
}

/// The specs measured: AES-256-XTS (512-bit key) as LUKS2 defaults to, and AES-128-XTS.
const SPECS: &[(&str, usize)] = &[("aes-xts-plain64", 64), ("aes-xts-plain64", 32)];
const SECTOR_SIZES: &[usize] = &[512, 4096];

pub fn run_bench(opts: &BenchOptions) -> BenchReport {
    let pool = match opts.threads {
        Some(n) => CryptoPool::new(n),
        None => CryptoPool::with_default_threads(),
    };
    let per_cell = Duration::from_secs_f64(opts.seconds_per_cell.max(0.001));
    let mut results = Vec::new();
    let mut skipped = Vec::new();
    for &(name, key_bytes) in SPECS {
        let spec = match CipherSpec::parse_luks2(name, key_bytes) {
            Ok(s) => s,
            Err(e) => {
                skipped.push(format!("{name}: {e}"));
                continue;
            }
        };
        let default = default_engine_for(&spec).map(|e| e.name()).ok();
        let key = match SecretKey::random(key_bytes) {
            Ok(k) => k,
            Err(e) => {
                skipped.push(format!("{name}: {e}"));
                continue;
            }
        };
        for engine in engines() {
            let wanted = opts
                .engines
                .as_ref()
                .is_none_or(|list| list.iter().any(|n| n == engine.name()));
            if !wanted || !engine.supports(&spec) {
                continue;
            }
            for &ss in SECTOR_SIZES {
                let buffer = opts.buffer_bytes.max(ss) / ss * ss;
                let cipher = match engine.new_cipher(&spec, &key, ss) {
                    Ok(c) => c,
                    Err(e) => {
                        skipped.push(format!("{} {spec} {ss}: {e}", engine.name()));
                        continue;
                    }
                };
                let single = |dir| measure(per_cell, buffer, |buf, s| cipher.crypt(dir, s, buf));
                let pooled_len = buffer * pool.threads();
                let pooled = |dir| {
                    measure(per_cell, pooled_len, |buf, s| {
                        pool.crypt(&cipher, dir, s, buf)
                    })
                    .map(|m| m.wall_gbps)
                };
                let cell = (|| -> Result<BenchResult, crate::CryptoError> {
                    let enc = single(Direction::Encrypt)?;
                    let dec = single(Direction::Decrypt)?;
                    Ok(BenchResult {
                        engine: engine.name().to_string(),
                        cipher: spec.to_luks2_string(),
                        key_bits: key_bytes * 8,
                        sector_size: ss,
                        single_encrypt_gbps: enc.wall_gbps,
                        single_decrypt_gbps: dec.wall_gbps,
                        single_encrypt_cpu_gbps: enc.cpu_gbps,
                        single_decrypt_cpu_gbps: dec.cpu_gbps,
                        pool_encrypt_gbps: pooled(Direction::Encrypt)?,
                        pool_decrypt_gbps: pooled(Direction::Decrypt)?,
                        is_default: default == Some(engine.name()),
                    })
                })();
                match cell {
                    Ok(r) => results.push(r),
                    Err(e) => skipped.push(format!("{} {spec} {ss}: {e}", engine.name())),
                }
            }
        }
    }
    let (cpu_model, cpu_flags) = cpu_info();
    BenchReport {
        cpu_model,
        cpu_flags,
        pool_threads: pool.threads(),
        seconds_per_cell: opts.seconds_per_cell,
        buffer_bytes: opts.buffer_bytes,
        results,
        skipped,
    }
}

struct Measured {
    wall_gbps: f64,
    /// Per second of the calling thread's CPU time.
    cpu_gbps: f64,
}

/// Repeats `f` over one buffer until `budget` has passed. The sector number advances so every
/// call sees fresh IVs, as real I/O does.
fn measure(
    budget: Duration,
    len: usize,
    mut f: impl FnMut(&mut [u8], u64) -> Result<(), crate::CryptoError>,
) -> Result<Measured, crate::CryptoError> {
    let mut buf = vec![0x5au8; len];
    // Warm-up: keys contexts, faults the buffer in, wakes workers.
    f(&mut buf, 0)?;
    let mut bytes = 0u64;
    let mut sector = 0u64;
    let start = Instant::now();
    let cpu_start = thread_cpu_time();
    // At least one pass inside the timed window: on a busy machine the thread may lose the
    // CPU for the whole budget before its first pass (CI measured 0 GB/s that way).
    loop {
        f(&mut buf, sector)?;
        bytes += len as u64;
        sector = sector.wrapping_add(len as u64 / 512);
        if start.elapsed() >= budget {
            break;
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = thread_cpu_time().saturating_sub(cpu_start).as_secs_f64();
    Ok(Measured {
        wall_gbps: bytes as f64 / wall / 1e9,
        cpu_gbps: if cpu > 0.0 {
            bytes as f64 / cpu / 1e9
        } else {
            0.0
        },
    })
}

fn thread_cpu_time() -> Duration {
    use rustix::time::{clock_gettime_dynamic, ClockId, DynamicClockId};
    // On failure the CPU-time figures read 0.
    match clock_gettime_dynamic(DynamicClockId::Known(ClockId::ThreadCPUTime)) {
        Ok(ts) => Duration::new(
            ts.tv_sec.max(0) as u64,
            ts.tv_nsec.clamp(0, 999_999_999) as u32,
        ),
        Err(_) => Duration::ZERO,
    }
}

fn cpu_info() -> (String, Vec<String>) {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    let interesting = [
        "aes",
        "vaes",
        "pclmulqdq",
        "vpclmulqdq",
        "avx2",
        "avx512f",
        "avx512vl",
    ];
    let flags_line = field("flags");
    let flags = flags_line
        .split_whitespace()
        .filter(|f| interesting.contains(f))
        .map(str::to_string)
        .collect();
    (field("model name"), flags)
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "CPU: {} [{}]", self.cpu_model, self.cpu_flags.join(" "))?;
        writeln!(
            f,
            "pool: {} threads; {:.2} s per cell; {} KiB per call per thread; GB/s = 10^9 B/s; \
             1T = one thread, wall clock; /c = per CPU-second of that thread",
            self.pool_threads,
            self.seconds_per_cell,
            self.buffer_bytes / 1024
        )?;
        writeln!(
            f,
            "{:<11} {:<16} {:>4} {:>6} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9}",
            "engine",
            "cipher",
            "bits",
            "sector",
            "1T enc",
            "1T dec",
            "1T enc/c",
            "1T dec/c",
            "pool enc",
            "pool dec"
        )?;
        for r in &self.results {
            writeln!(
                f,
                "{:<11} {:<16} {:>4} {:>6} {:>8.2} {:>8.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}{}",
                r.engine,
                r.cipher,
                r.key_bits,
                r.sector_size,
                r.single_encrypt_gbps,
                r.single_decrypt_gbps,
                r.single_encrypt_cpu_gbps,
                r.single_decrypt_cpu_gbps,
                r.pool_encrypt_gbps,
                r.pool_decrypt_gbps,
                if r.is_default { "  (default)" } else { "" }
            )?;
        }
        for s in &self.skipped {
            writeln!(f, "skipped: {s}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_bench_reports_every_engine_and_sector_size() {
        let report = run_bench(&BenchOptions {
            seconds_per_cell: 0.005,
            buffer_bytes: 64 * 1024,
            threads: Some(2),
            engines: None,
        });
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
        // Every engine that runs each XTS key size here × two sector sizes.
        let cells: usize = SPECS
            .iter()
            .map(|&(name, bytes)| {
                let spec = CipherSpec::parse_luks2(name, bytes).unwrap();
                engines().iter().filter(|e| e.supports(&spec)).count() * SECTOR_SIZES.len()
            })
            .sum();
        assert!(
            cells >= 8,
            "openssl and rustcrypto run both key sizes everywhere"
        );
        assert_eq!(report.results.len(), cells, "{report}");
        for r in &report.results {
            assert!(
                r.single_encrypt_gbps > 0.0 && r.pool_decrypt_gbps > 0.0,
                "{r:?}"
            );
        }
        let xts512_defaults = report
            .results
            .iter()
            .filter(|r| r.key_bits == 512 && r.is_default)
            .count();
        assert_eq!(
            xts512_defaults, 2,
            "exactly one default engine per sector size"
        );
        let table = report.to_string();
        assert!(
            table.contains("aes-xts-plain64") && table.contains("(default)"),
            "{table}"
        );
    }
}
