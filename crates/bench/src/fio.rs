//! fio as a client: on the image itself (the ceiling: `--direct=1 --ioengine=io_uring` with the
//! page cache bypassed) and over NBD (`--ioengine=nbd`). Jobs run as threads of one fio process
//! (`--thread`), and fio's `exec_prerun`/`exec_postrun` hooks, which run after the engine has
//! connected and after the last I/O, take the time and the CPU of fio and of the server: the
//! CPU figures cover exactly the measured window, not fio's start-up.
use crate::config::{Rw, Workload};
use crate::engine::Measured;
use crate::procfs::{cpu_pct, stat_ticks};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::Path;
use std::process::Command;

/// Where fio sends its requests.
pub enum Target<'a> {
    File {
        path: &'a Path,
        direct: bool,
    },
    /// `size` bytes of a file from `offset` on, with O_DIRECT (a LUKS image's payload).
    Region {
        path: &'a Path,
        offset: u64,
        size: u64,
    },
    Nbd {
        uri: String,
    },
    /// fio's rbd engine (librbd in fio) on an image of the cluster `conf` describes.
    Rbd {
        conf: &'a Path,
        pool: &'a str,
        image: &'a str,
    },
}

#[derive(Deserialize)]
struct Output {
    jobs: Vec<Job>,
}

#[derive(Deserialize)]
struct Job {
    error: i64,
    read: Dir,
    write: Dir,
}

#[derive(Deserialize)]
struct Dir {
    iops: f64,
    bw_bytes: f64,
    lat_ns: Lat,
    clat_ns: Lat,
}

#[derive(Deserialize)]
struct Lat {
    #[serde(rename = "N", default)]
    n: u64,
    mean: f64,
    #[serde(default)]
    percentile: Option<std::collections::BTreeMap<String, f64>>,
}

/// What fio's JSON says about one group-reported run.
#[derive(Debug, Clone, PartialEq)]
pub struct FioFigures {
    pub iops: f64,
    pub bytes_per_s: f64,
    pub lat_mean_us: Option<f64>,
    pub lat_p50_us: Option<f64>,
    pub lat_p99_us: Option<f64>,
    pub lat_p999_us: Option<f64>,
}

/// Parses `--output-format=json` output. fio writes notes such as "bench : Saving output of
/// prerun in ..." before the JSON, so the JSON starts at the first line that is `{`.
pub fn parse(text: &str) -> Result<FioFigures> {
    let start = text
        .find("\n{")
        .map(|i| i + 1)
        .or_else(|| text.starts_with('{').then_some(0))
        .context("no JSON object in fio's output")?;
    let out: Output = serde_json::from_str(&text[start..]).context("parsing fio's JSON")?;
    let job = out.jobs.first().context("fio's JSON has no job")?;
    if job.error != 0 {
        bail!(
            "fio reported error {} ({})",
            job.error,
            std::io::Error::from_raw_os_error(job.error as i32)
        );
    }
    // The direction that did the requests (a mixed job's latencies: the reads').
    let busy = if job.read.lat_ns.n > 0 {
        &job.read
    } else {
        &job.write
    };
    // Total latency (submission to completion) when fio was asked for its percentiles
    // (--lat_percentiles=1), else completion latency's.
    let pct_source = if busy.lat_ns.percentile.is_some() {
        &busy.lat_ns
    } else {
        &busy.clat_ns
    };
    let pct = |p: &str| {
        pct_source
            .percentile
            .as_ref()
            .and_then(|m| m.get(p))
            .map(|ns| ns / 1000.0)
    };
    Ok(FioFigures {
        iops: job.read.iops + job.write.iops,
        bytes_per_s: job.read.bw_bytes + job.write.bw_bytes,
        lat_mean_us: (busy.lat_ns.n > 0).then(|| busy.lat_ns.mean / 1000.0),
        lat_p50_us: pct("50.000000"),
        lat_p99_us: pct("99.000000"),
        lat_p999_us: pct("99.900000"),
    })
}

/// One side of the window: the time (ns since the epoch), fio's CPU ticks, the server's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mark {
    pub ns: u128,
    pub fio_ticks: u64,
    pub server_ticks: Option<u64>,
}

/// Parses what the hook command below writes: a `date +%s%N` line, fio's `/proc/PID/stat`
/// line, and the server's when there is one.
pub fn parse_mark(text: &str) -> Result<Mark> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let ns = lines
        .next()
        .and_then(|l| l.trim().parse().ok())
        .context("no time stamp in fio's hook output")?;
    let fio_ticks = stat_ticks(
        lines
            .next()
            .context("no fio stat line in the hook output")?,
    )?;
    let server_ticks = lines.next().map(stat_ticks).transpose()?;
    Ok(Mark {
        ns,
        fio_ticks,
        server_ticks,
    })
}

fn hook(server: Option<u32>) -> String {
    // $PPID of the hook's shell is the fio process itself (jobs are threads of it).
    let server = server
        .map(|p| format!(" /proc/{p}/stat"))
        .unwrap_or_default();
    format!("{{ date +%s%N; cat /proc/$PPID/stat{server}; }}")
}

/// Runs one fio job group; `server` is the serving process whose CPU is measured.
pub fn run(
    work: &Path,
    target: &Target,
    w: &Workload,
    runtime: f64,
    server: Option<u32>,
) -> Result<Measured> {
    let rw = match w.rw {
        Rw::Randread | Rw::Randwrite | Rw::Read | Rw::Write => w.rw.name(),
        other => bail!("fio does not run '{}' workloads", other.name()),
    };
    let json = work.join("fio.json");
    let mut cmd = Command::new("fio");
    cmd.current_dir(work).args([
        "--name=bench".to_string(),
        format!("--rw={rw}"),
        format!("--bs={}", w.bs),
        format!("--iodepth={}", w.depth),
        format!("--numjobs={}", w.queues),
        "--thread".into(),
        "--time_based".into(),
        format!("--runtime={}", runtime.ceil().max(1.0) as u64),
        "--lat_percentiles=1".into(),
        "--group_reporting".into(),
        "--output-format=json".into(),
        format!("--output={}", json.display()),
        format!("--exec_prerun={}", hook(server)),
        format!("--exec_postrun={}", hook(server)),
    ]);
    match target {
        Target::File { path, direct } => {
            cmd.arg(format!("--filename={}", path.display()))
                .arg("--ioengine=io_uring")
                .arg(format!("--direct={}", u8::from(*direct)));
        }
        Target::Region { path, offset, size } => {
            cmd.arg(format!("--filename={}", path.display()))
                .args(["--ioengine=io_uring", "--direct=1"])
                .arg(format!("--offset={offset}"))
                .arg(format!("--size={size}"));
        }
        Target::Nbd { uri } => {
            cmd.arg("--ioengine=nbd").arg(format!("--uri={uri}"));
        }
        Target::Rbd { conf, pool, image } => {
            cmd.env("CEPH_CONF", conf)
                .args(["--ioengine=rbd", "--clientname=admin"])
                .arg(format!("--pool={pool}"))
                .arg(format!("--rbdname={image}"));
        }
    }
    crate::command::show(&cmd);
    let out = cmd
        .output()
        .context("running fio (Debian: apt-get install fio)")?;
    let text = std::fs::read_to_string(&json).unwrap_or_default();
    if !out.status.success() {
        bail!(
            "fio failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            text
        );
    }
    let figures = parse(&text)?;
    let pre = parse_mark(&std::fs::read_to_string(work.join("bench.prerun.txt"))?)?;
    let post = parse_mark(&std::fs::read_to_string(work.join("bench.postrun.txt"))?)?;
    let window_s = post.ns.saturating_sub(pre.ns) as f64 / 1e9;
    let server_cpu_pct = match (pre.server_ticks, post.server_ticks) {
        (Some(a), Some(b)) => cpu_pct(b.saturating_sub(a), window_s),
        _ => None,
    };
    let f = figures;
    Ok(Measured {
        window_s,
        metrics: crate::clients::io_metrics(
            Some(f.iops),
            Some(f.bytes_per_s / (1 << 20) as f64),
            [f.lat_mean_us, f.lat_p50_us, f.lat_p99_us, f.lat_p999_us],
            server_cpu_pct,
        )
        .with(
            "client_cpu_pct",
            cpu_pct(post.fio_ticks.saturating_sub(pre.fio_ticks), window_s),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Captured from fio 3.33: `--rw=randrw --bs=4k --iodepth=8 --numjobs=2 --thread
    /// --lat_percentiles=1 --group_reporting`, with prerun/postrun hooks.
    const SAMPLE: &str = include_str!("../tests/data/fio-randrw-4k.json");

    #[test]
    fn a_captured_fio_run_parses_into_iops_bandwidth_and_latency_percentiles() {
        let f = parse(SAMPLE).unwrap();
        assert!(
            (f.iops - (494178.821179 + 495237.762238)).abs() < 1e-3,
            "{f:?}"
        );
        assert!(f.bytes_per_s > f.iops * 4000.0 && f.bytes_per_s < f.iops * 4200.0);
        assert!((f.lat_p999_us.unwrap() - 117.248).abs() < 1e-9, "{f:?}");
        let (p50, p99) = (f.lat_p50_us.unwrap(), f.lat_p99_us.unwrap());
        assert!(p50 > 0.0 && p50 <= p99 && p99 <= 117.248, "{f:?}");
        assert!(f.lat_mean_us.unwrap() > 0.0);
    }

    #[test]
    fn an_error_in_the_job_is_reported() {
        let broken = SAMPLE.replacen("\"error\" : 0", "\"error\" : 5", 1);
        assert!(format!("{:#}", parse(&broken).unwrap_err()).contains("error 5"));
        assert!(parse("fio: no such engine").is_err());
    }

    #[test]
    fn hook_output_gives_the_window_and_both_processes_cpu() {
        let post = include_str!("../tests/data/fio-postrun.txt");
        let m = parse_mark(post).unwrap();
        assert_eq!(m.server_ticks, None);
        assert!(m.ns > 1_700_000_000_000_000_000);
        let with_server = format!("{post}\n42 (cryptblk) S 1 1 1 0 -1 0 0 0 0 0 300 200 0 0\n");
        assert_eq!(parse_mark(&with_server).unwrap().server_ticks, Some(500));
        assert_eq!(
            hook(Some(7)),
            "{ date +%s%N; cat /proc/$PPID/stat /proc/7/stat; }"
        );
    }
}
