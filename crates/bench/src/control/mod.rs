//! `cryptblk-bench control`: the control plane of `cryptblk serve --control` and what it
//! costs the data path; was `scripts/bench-control.sh`.
//!
//! One daemon serves a raw image over NBD and listens on a control socket. Per round, in
//! rotating order, fio's nbd engine reads 4k at random (depth 32) for `--runtime` seconds:
//! - quiet: alone;
//! - churn: while `--loops` threads each run, back to back, `cryptblk ctl` disk-add (its own
//!   small raw image, `--nbd-export`), disk-list, stats and disk-remove, each a new process
//!   as an operator's or a management tool's call is; a command that exits 0 is one control
//!   op, ops/s is over the loops' wall time, failures are counted apart;
//! - spawn: while as many threads only start the binary (`cryptblk --version`): the share of
//!   the churn's cost that is process starts competing for the CPUs.
//!
//! The daemon's CPU is taken over fio's measured window. Then the round trips: `ctl stats` as
//! a new process and `cryptblk --version` (median of 50 each), and the JSON-RPC "stats" call
//! on one open connection (median of 50). One JSON line per run and per round trip.
mod loops;
mod summary;

use crate::config::{Transport, Workload};
use crate::workdir::WorkDir;
use crate::{fio, peers, procfs};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// `cryptblk-bench control`'s command line.
#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Seconds of each fio run.
    #[arg(long, default_value_t = 10.0)]
    runtime: f64,
    /// Parallel churn (and spawn-only) loops.
    #[arg(long, default_value_t = 4)]
    loops: usize,
    /// The served image (256M, 1G, ...).
    #[arg(long, default_value = "1G")]
    size: String,
    /// Each churn loop's image.
    #[arg(long, default_value = "16M")]
    small: String,
    /// Where the images go (default: /dev/shm if it has room, else the temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    #[arg(long, default_value = "control-results.jsonl")]
    results: PathBuf,
    /// The cryptblk binary (default: `cargo build --release`, then target/release).
    #[arg(long)]
    pub cryptblk: Option<PathBuf>,
}

impl Args {
    pub fn options(self, cryptblk: PathBuf) -> Result<Options> {
        Ok(Options {
            rounds: self.rounds,
            runtime: self.runtime,
            loops: self.loops,
            size: crate::config::parse_size(&self.size)?,
            small: crate::config::parse_size(&self.small)?,
            dir: self.dir,
            cryptblk,
            results: self.results,
        })
    }
}

pub struct Options {
    pub rounds: u32,
    /// Seconds of each fio run.
    pub runtime: f64,
    /// Parallel churn (and spawn) loops.
    pub loops: usize,
    /// The served image.
    pub size: u64,
    /// Each churn loop's image.
    pub small: u64,
    /// Where the images go (default: /dev/shm if it has room, else the temporary directory).
    pub dir: Option<PathBuf>,
    pub cryptblk: PathBuf,
    pub results: PathBuf,
}

/// One fio run (part `run`) or one round-trip figure (part `round-trip`), one JSON line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlRecord {
    pub commit: String,
    pub machine: crate::record::Machine,
    /// run or round-trip.
    pub part: String,
    /// 1.. (0 for the round trips, measured once).
    pub round: u32,
    /// run: quiet, churn or spawn; round-trip: ctl-stats, version or rpc-stats.
    pub what: String,
    pub started: u64,
    pub load1: f64,
    /// fio's measured window, s.
    pub window_s: Option<f64>,
    pub iops: Option<f64>,
    pub lat_p99_us: Option<f64>,
    /// The daemon's utime + stime over fio's window (100 = one core).
    pub server_cpu_pct: Option<f64>,
    /// Loops beside fio (churn, spawn).
    pub loops: Option<u32>,
    /// Commands that exited 0 (churn: control ops; spawn: process starts), and failed ones.
    pub ops: Option<u64>,
    pub errors: Option<u64>,
    /// ops over the loops' wall time.
    pub ops_per_s: Option<f64>,
    /// round-trip: the median of the calls, µs.
    pub median_us: Option<f64>,
    pub samples: Option<u32>,
}

/// The runs of a round; rotated by one each round.
const MODES: [&str; 3] = ["quiet", "churn", "spawn"];
const ROUND_TRIPS: usize = 50;

pub fn run(o: &Options, workload: &Workload) -> Result<()> {
    if !o.size.is_multiple_of(4096) || !o.small.is_multiple_of(4096) {
        bail!("--size and --small must be multiples of 4096 bytes");
    }
    if o.loops == 0 || o.rounds == 0 {
        bail!("--loops and --rounds must be at least 1");
    }
    let enghelp = Command::new("fio").arg("--enghelp=nbd").output();
    if !enghelp.is_ok_and(|out| out.status.success()) {
        bail!("fio with its nbd ioengine is required (Debian's fio 3.33 has it; scripts/install-deps.sh installs it)");
    }
    let need = o.size + o.small * o.loops as u64 + (64 << 20);
    let parent = match &o.dir {
        Some(dir) => dir.clone(),
        None if crate::workdir::free_bytes(Path::new("/dev/shm")).is_ok_and(|f| f > need) => {
            PathBuf::from("/dev/shm")
        }
        None => std::env::temp_dir(),
    };
    let work = WorkDir::new(
        &parent,
        "cryptblk-bench-control",
        need,
        "the served image and the churn images",
    )?;
    // A private copy: another build may replace target/release/cryptblk during the run.
    let bin = work.join("cryptblk");
    std::fs::copy(&o.cryptblk, &bin)
        .with_context(|| format!("copying {}", o.cryptblk.display()))?;
    let steady = work.join("steady.raw");
    eprintln!(
        "+ writing {} bytes of incompressible data to {}",
        o.size,
        steady.display()
    );
    crate::images::random_file(&steady, o.size)?;
    for k in 1..=o.loops {
        std::fs::File::create(work.join(&format!("img{k}.raw")))?.set_len(o.small)?;
    }
    let (ctl, sock) = (work.join("ctl.sock"), work.join("nbd.sock"));
    let mut serve = Command::new(&bin);
    serve
        .arg("serve")
        .arg("--control")
        .arg(&ctl)
        .arg("--nbd")
        .arg(format!("unix:{}", sock.display()))
        .arg("--image")
        .arg(&steady)
        .args(["--name", "vol"]);
    let server = peers::start(
        serve,
        &sock,
        &work.join("serve.log"),
        Transport::Nbd,
        o.size,
    )?;
    let start = Instant::now();
    while !ctl.exists() {
        if start.elapsed() > Duration::from_secs(10) {
            bail!(
                "no control socket at {} after 10 s; the daemon's log:\n{}",
                ctl.display(),
                server.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let base = ControlRecord {
        commit: procfs::commit(),
        machine: procfs::machine(),
        part: String::new(),
        round: 0,
        what: String::new(),
        started: 0,
        load1: 0.0,
        window_s: None,
        iops: None,
        lat_p99_us: None,
        server_cpu_pct: None,
        loops: None,
        ops: None,
        errors: None,
        ops_per_s: None,
        median_us: None,
        samples: None,
    };
    let mut records = Vec::new();
    for round in 1..=o.rounds {
        eprintln!(
            "round {round} of {} (load average {})",
            o.rounds,
            procfs::load1()
        );
        for k in 0..MODES.len() {
            let mode = MODES[(k + round as usize - 1) % MODES.len()];
            let setup = Setup {
                o,
                work: &work,
                bin: &bin,
                ctl: &ctl,
                uri: server.uri(),
                server: server.pid(),
                workload,
            };
            let r = ControlRecord {
                part: "run".into(),
                round,
                what: mode.into(),
                ..measure(&setup, mode, &base)?
            };
            crate::record::append(&o.results, &r)?;
            records.push(r);
        }
    }
    let mut rpc = loops::Rpc::connect(&ctl)?;
    let left: Vec<String> = rpc.call("disk-list", serde_json::json!({}))?["disks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["name"].as_str())
        .filter(|name| *name != "vol")
        .map(String::from)
        .collect();
    drop(rpc);
    let ctl_arg = ctl.display().to_string();
    for (what, median_us) in [
        (
            "ctl-stats",
            loops::process_ms(&bin, &["ctl", "-s", &ctl_arg, "stats"], ROUND_TRIPS)? * 1e3,
        ),
        (
            "version",
            loops::process_ms(&bin, &["--version"], ROUND_TRIPS)? * 1e3,
        ),
        ("rpc-stats", loops::rpc_stats_us(&ctl, ROUND_TRIPS)?),
    ] {
        let r = ControlRecord {
            part: "round-trip".into(),
            what: what.into(),
            started: epoch_seconds(),
            load1: procfs::load1(),
            median_us: Some(median_us),
            samples: Some(ROUND_TRIPS as u32),
            ..base.clone()
        };
        crate::record::append(&o.results, &r)?;
        records.push(r);
    }
    server.stop()?;
    print!("{}", summary::render(&records, o.loops, o.runtime, &left));
    Ok(())
}

/// What every run of the round shares.
struct Setup<'a> {
    o: &'a Options,
    work: &'a WorkDir,
    bin: &'a Path,
    ctl: &'a Path,
    uri: String,
    server: u32,
    workload: &'a Workload,
}

/// One fio run with the loops of `mode` beside it.
fn measure(s: &Setup, mode: &str, base: &ControlRecord) -> Result<ControlRecord> {
    let load1 = procfs::load1();
    let started = epoch_seconds();
    let stop = Arc::new(AtomicBool::new(false));
    let kind = match mode {
        "churn" => Some(loops::Kind::Churn),
        "spawn" => Some(loops::Kind::Spawn),
        _ => None,
    };
    let loops_started = Instant::now();
    let handles: Vec<_> = kind
        .into_iter()
        .flat_map(|kind| (1..=s.o.loops).map(move |k| (kind, k)))
        .map(|(kind, k)| {
            let image = s.work.join(&format!("img{k}.raw"));
            let commands = loops::pass(kind, k, s.ctl, &image);
            loops::start(s.bin.to_path_buf(), commands, stop.clone())
        })
        .collect();
    let target = fio::Target::Nbd { uri: s.uri.clone() };
    let measured = fio::run(
        s.work.path(),
        &target,
        s.workload,
        s.o.runtime,
        Some(s.server),
    );
    // The loops stop whatever fio did: none may outlive the run.
    stop.store(true, Ordering::Relaxed);
    let mut counts = Vec::new();
    for h in handles {
        counts.push(
            h.join()
                .map_err(|_| anyhow::anyhow!("a {mode} loop panicked"))?,
        );
    }
    let loops_s = loops_started.elapsed().as_secs_f64();
    let m = measured?;
    let (ops, errors) = counts
        .iter()
        .fold((0, 0), |(o, e), c| (o + c.ops, e + c.errors));
    for (k, c) in counts.iter().enumerate() {
        for f in &c.failures {
            eprintln!("  loop {}: {f}", k + 1);
        }
    }
    let looped = kind.is_some();
    eprintln!(
        "  {mode}: {:.0} IOPS, daemon CPU {:.1} %{}",
        m.iops.unwrap_or(0.0),
        m.server_cpu_pct.unwrap_or(f64::NAN),
        if looped {
            format!(
                ", {ops} ops ({errors} failed), {:.1} ops/s",
                ops as f64 / loops_s
            )
        } else {
            String::new()
        }
    );
    Ok(ControlRecord {
        started,
        load1,
        window_s: Some(m.window_s),
        iops: m.iops,
        lat_p99_us: m.lat_p99_us,
        server_cpu_pct: m.server_cpu_pct,
        loops: looped.then_some(s.o.loops as u32),
        ops: looped.then_some(ops),
        errors: looped.then_some(errors),
        ops_per_s: looped.then_some(ops as f64 / loops_s),
        ..base.clone()
    })
}

fn epoch_seconds() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
