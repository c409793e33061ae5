//! The convert benchmark's cipher part: single-thread AES-256-XTS of 4 KiB sectors, measured
//! by `cryptblk bench --json` (the engine the daemon picks), by the system's `openssl speed`,
//! and by `examples/openssl_baseline` (the vendored OpenSSL the engine wraps, in its leanest
//! direct loop, next to the engine in the same process).
use anyhow::{Context, Result};
use serde::Deserialize;
use std::path::Path;
use std::process::Command;

/// `cryptblk bench --json`'s engine and single-thread GB/s (10^9 bytes per second).
pub fn cryptblk_bench(cryptblk: &Path, threads: Option<usize>) -> Result<(String, f64)> {
    let mut bench = Command::new(cryptblk);
    if let Some(n) = threads {
        bench.args(["--threads", &n.to_string()]);
    }
    bench.args(["bench", "--json"]);
    cryptblk_xts_4k(&crate::command::output(&mut bench)?)
}

/// The system OpenSSL's `openssl speed`, GB/s.
pub fn openssl_speed() -> Result<f64> {
    let mut speed = Command::new("openssl");
    speed.args([
        "speed",
        "-mr",
        "-evp",
        "aes-256-xts",
        "-bytes",
        "4096",
        "-seconds",
        "2",
    ]);
    Ok(openssl_speed_bps(&crate::command::output(&mut speed)?)? / 1e9)
}

/// `examples/openssl_baseline`'s (direct loop, engine) GB/s.
pub fn baseline() -> Result<(f64, f64)> {
    let release = crate::release_build(&[
        "--locked",
        "-p",
        "cryptblk-crypto",
        "--example",
        "openssl_baseline",
    ])?;
    baseline_4k(&crate::command::output(&mut Command::new(
        release.join("examples/openssl_baseline"),
    ))?)
}

#[derive(Deserialize)]
struct BenchReport {
    results: Vec<BenchResult>,
}

#[derive(Deserialize)]
struct BenchResult {
    engine: String,
    cipher: String,
    key_bits: u32,
    sector_size: u32,
    single_encrypt_gbps: f64,
    is_default: bool,
}

/// The engine and single-thread encryption GB/s of aes-xts-plain64, 512-bit key, 4 KiB
/// sectors from `cryptblk bench --json`: the default engine's cell, else the first.
fn cryptblk_xts_4k(json: &str) -> Result<(String, f64)> {
    let report: BenchReport =
        serde_json::from_str(json).context("parsing `cryptblk bench --json`")?;
    let cells: Vec<&BenchResult> = report
        .results
        .iter()
        .filter(|r| r.cipher == "aes-xts-plain64" && r.key_bits == 512 && r.sector_size == 4096)
        .collect();
    let cell = cells
        .iter()
        .find(|r| r.is_default)
        .or(cells.first())
        .context("`cryptblk bench --json` has no aes-xts-plain64 512-bit 4096-byte result")?;
    Ok((cell.engine.clone(), cell.single_encrypt_gbps))
}

/// Bytes per second from `openssl speed -mr ... -bytes N`: the last field of its last `+F:`
/// line (`+F:25:AES-256-XTS:6627913142.86`).
fn openssl_speed_bps(text: &str) -> Result<f64> {
    text.lines()
        .rfind(|l| l.starts_with("+F:"))
        .and_then(|l| l.rsplit(':').next()?.trim().parse().ok())
        .context("no `+F:` line with a rate in the output of openssl speed -mr")
}

/// (direct loop, engine) GB/s of the 4096-byte row of `openssl_baseline`'s table.
fn baseline_4k(text: &str) -> Result<(f64, f64)> {
    text.lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next()? == "4096").then_some(())?;
            Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
        })
        .context("no 4096-byte row in the output of examples/openssl_baseline")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_tools_outputs_give_the_4k_aes_256_xts_figures() {
        let cell = |engine: &str, bits, sector, gbps, default| {
            format!(
                r#"{{"engine":"{engine}","cipher":"aes-xts-plain64","key_bits":{bits},"sector_size":{sector},
                "single_encrypt_gbps":{gbps},"single_decrypt_gbps":1.0,"single_encrypt_cpu_gbps":1.0,
                "single_decrypt_cpu_gbps":1.0,"pool_encrypt_gbps":1.0,"pool_decrypt_gbps":1.0,"is_default":{default}}}"#
            )
        };
        let json = format!(
            r#"{{"cpu_model":"x","cpu_flags":[],"pool_threads":2,"seconds_per_cell":0.2,"buffer_bytes":1,"skipped":[],
            "results":[{},{},{},{}]}}"#,
            cell("openssl", 512, 512, 4.4, true),
            cell("rustcrypto", 512, 4096, 3.4, false),
            cell("openssl", 512, 4096, 11.5, true),
            cell("openssl", 256, 4096, 14.2, true),
        );
        assert_eq!(cryptblk_xts_4k(&json).unwrap(), ("openssl".into(), 11.5));
        let none = json.replace("\"sector_size\":4096", "\"sector_size\":8192");
        assert!(cryptblk_xts_4k(&none).is_err());

        let speed = "+DT:AES-256-XTS:2:4096\n+R:3236285:AES-256-XTS:2.000000\n+H:4096\n+F:25:AES-256-XTS:6627913142.86\n";
        assert_eq!(openssl_speed_bps(speed).unwrap(), 6627913142.86);
        assert!(openssl_speed_bps("+H:4096\n").is_err());

        let baseline = "sector  direct GB/s  engine GB/s   ratio\n   512         4.90         4.38     89%\n  4096        11.97        11.51     96%\n";
        assert_eq!(baseline_4k(baseline).unwrap(), (11.97, 11.51));
        assert!(baseline_4k("sector direct\n512 1 2\n").is_err());
    }
}
