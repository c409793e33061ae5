//! The clients besides fio: `vu_bench` (libblkio over vhost-user-blk; it measures its own
//! window and the server's CPU over it), an idle vu_bench (server CPU and memory with a
//! connected client that submits nothing), and `nbdcopy` of the whole disk.
use crate::command::{output, quiet_output, show};
use crate::config::Workload;
use crate::engine::Measured;
use crate::procfs::{cpu_pct, memory_kib, process_ticks};
use crate::sample::Metrics;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;
use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `cryptblk ctl --socket CTL ARGS...`: the daemon's JSON answer (an answer that is not JSON
/// as a string); a failed call is an error with ctl's message.
pub fn ctl<S: AsRef<OsStr>>(cryptblk: &Path, socket: &Path, args: &[S]) -> Result<Value> {
    let answer = quiet_output(
        Command::new(cryptblk)
            .arg("ctl")
            .arg("--socket")
            .arg(socket)
            .args(args),
    )?;
    Ok(serde_json::from_str(answer.trim()).unwrap_or(Value::String(answer)))
}

/// vu_bench's JSON line (fields it has printed since the bash harness, plus the percentiles
/// and the CPU over its window).
#[derive(Deserialize)]
struct VuOutput {
    iops: f64,
    mib_s: f64,
    lat_avg_us: f64,
    lat_p50_us: Option<f64>,
    lat_p99_us: Option<f64>,
    lat_p999_us: Option<f64>,
    runtime_s: f64,
    server_cpu_pct: Option<f64>,
    client_cpu_pct: Option<f64>,
}

pub fn vu_bench(
    vu: &Path,
    socket: &Path,
    w: &Workload,
    runtime: f64,
    size: u64,
    server: u32,
    hugepages: bool,
) -> Result<Measured> {
    let mut cmd = Command::new(vu);
    if hugepages {
        cmd.arg("--hugepages");
    }
    cmd.arg("--socket")
        .arg(socket)
        .args(["--rw", w.rw.name()])
        .args(["--bs", &w.bs.to_string()])
        .args(["--iodepth", &w.depth.to_string()])
        .args(["--queues", &w.queues.to_string()])
        .args(["--runtime", &runtime.to_string()])
        .args(["--size", &size.to_string()])
        .args(["--server-pid", &server.to_string()]);
    parse_vu(&output(&mut cmd)?)
}

fn parse_vu(stdout: &str) -> Result<Measured> {
    let line = stdout
        .lines()
        .rfind(|l| l.starts_with('{'))
        .context("vu_bench printed no JSON line")?;
    let v: VuOutput = serde_json::from_str(line).context("parsing vu_bench's JSON line")?;
    Ok(Measured {
        window_s: v.runtime_s,
        metrics: io_metrics(
            Some(v.iops),
            Some(v.mib_s),
            [
                Some(v.lat_avg_us),
                v.lat_p50_us,
                v.lat_p99_us,
                v.lat_p999_us,
            ],
            v.server_cpu_pct,
        )
        .with("client_cpu_pct", v.client_cpu_pct),
    })
}

/// The server's CPU over `seconds` with a connected vu_bench that submits nothing, then its
/// VmRSS / VmHWM.
pub fn idle(
    vu: &Path,
    socket: &Path,
    seconds: f64,
    server: u32,
    hugepages: bool,
) -> Result<Measured> {
    let mut cmd = Command::new(vu);
    if hugepages {
        cmd.arg("--hugepages");
    }
    cmd.arg("--socket")
        .arg(socket)
        .args(["--idle", &(seconds + 2.0).to_string(), "--queues", "1"])
        .stdout(Stdio::null());
    show(&cmd);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("running {}", vu.display()))?;
    // Let it connect and map its memory first.
    std::thread::sleep(Duration::from_secs(1));
    let (c0, t0) = (process_ticks(server)?, Instant::now());
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let (c1, secs) = (process_ticks(server)?, t0.elapsed().as_secs_f64());
    let (server_rss_kib, server_hwm_kib) = memory_kib(server);
    let status = child.wait()?;
    if !status.success() {
        bail!("the idle vu_bench client failed ({status})");
    }
    Ok(Measured {
        window_s: secs,
        metrics: Metrics::default()
            .with("server_cpu_pct", cpu_pct(c1.saturating_sub(c0), secs))
            .with("server_rss_kib", server_rss_kib.map(|k| k as f64))
            .with("server_hwm_kib", server_hwm_kib.map(|k| k as f64)),
    })
}

/// `nbdcopy URI null:`: the whole disk out of the server, timed.
pub fn nbdcopy(uri: &str, size: u64, server: u32) -> Result<Measured> {
    let mut cmd = Command::new("nbdcopy");
    cmd.args([uri, "null:"]);
    show(&cmd);
    let (c0, t0) = (process_ticks(server)?, Instant::now());
    quiet_output(&mut cmd).context("nbdcopy (Debian: apt-get install libnbd-bin)")?;
    let (c1, secs) = (process_ticks(server)?, t0.elapsed().as_secs_f64());
    Ok(Measured {
        window_s: secs,
        metrics: Metrics::default()
            .with("mib_s", Some(size as f64 / secs / (1 << 20) as f64))
            .with("server_cpu_pct", cpu_pct(c1.saturating_sub(c0), secs)),
    })
}

/// The figures of a run of I/O: IOPS, MiB/s, latency (mean, p50, p99, p99.9, µs), the
/// server's CPU and its CPU per request.
pub fn io_metrics(
    iops: Option<f64>,
    mib_s: Option<f64>,
    [mean, p50, p99, p999]: [Option<f64>; 4],
    server_cpu_pct: Option<f64>,
) -> Metrics {
    Metrics::default()
        .with("iops", iops)
        .with("mib_s", mib_s)
        .with("lat_mean_us", mean)
        .with("lat_p50_us", p50)
        .with("lat_p99_us", p99)
        .with("lat_p999_us", p999)
        .with("server_cpu_pct", server_cpu_pct)
        .with(
            "server_cpu_us_per_io",
            crate::sample::cpu_us_per_io(server_cpu_pct, iops),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vu_bench_lines_with_and_without_percentiles_parse() {
        let old = r#"{"iops":25000.0,"mib_s":97.66,"lat_avg_us":1270.5,"lat_max_us":9000.0,"queue_ios":[50000],"queue_balance":1.000,"rw":"randread","bs":4096,"iodepth":32,"queues":1,"runtime_s":2.001,"ios":50000,"area_bytes":268435456}"#;
        let m = parse_vu(old).unwrap();
        assert_eq!(
            (
                m.metrics.get("iops"),
                m.metrics.get("lat_p99_us"),
                m.window_s
            ),
            (Some(25000.0), None, 2.001)
        );
        let new = old.replace(
            "\"area_bytes\"",
            "\"lat_p50_us\":1100.0,\"lat_p99_us\":3000.0,\"lat_p999_us\":7000.0,\"server_cpu_pct\":61.5,\"client_cpu_pct\":30.0,\"area_bytes\"",
        );
        let m = parse_vu(&format!("some log line\n{new}\n")).unwrap();
        assert_eq!(m.metrics.get("lat_p999_us"), Some(7000.0));
        assert_eq!(m.metrics.get("server_cpu_pct"), Some(61.5));
        // 61.5 % of a core at 25,000 IOPS: 24.6 µs per request.
        assert!((m.metrics.get("server_cpu_us_per_io").unwrap() - 24.6).abs() < 1e-9);
    }
}
