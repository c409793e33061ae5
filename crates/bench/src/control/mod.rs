//! The control driver (`cryptblk-bench control`, preset `control`): the control plane of `cryptblk serve --control` and what it
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
//! on one open connection (median of 50), in each round too. One sample per run and per
//! round trip; disks the churn left behind are named at the end.
mod loops;

use crate::config::{Config, Transport, Workload};
use crate::engine::{self, Driver, Measured};
use crate::plan::{Fits, Step};
use crate::sample::{Metrics, Sample};
use crate::workdir::WorkDir;
use crate::{fio, peers};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

const ROUND_TRIPS: usize = 50;

pub fn run(o: &Options, config: &Config, workload: &Workload) -> Result<Vec<Sample>> {
    let preset = config.preset("control")?;
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
    crate::wait::until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            format!(
                "no control socket at {}; the daemon's log:\n{}",
                ctl.display(),
                server.log_tail()
            )
        },
        || Ok(ctl.exists().then_some(())),
    )?;
    let mut d = Control {
        setup: Setup {
            o,
            work: &work,
            bin: &bin,
            ctl: &ctl,
            uri: server.uri(),
            server: server.pid(),
            workload,
        },
    };
    let samples = engine::run("control", preset, o.rounds, &mut d, &o.results)?;
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
    server.stop()?;
    if !left.is_empty() {
        bail!(
            "the churn left disks behind: {} (the samples are in {})",
            left.join(" "),
            o.results.display()
        );
    }
    Ok(samples)
}

struct Control<'a> {
    setup: Setup<'a>,
}

impl Fits for Control<'_> {
    fn transports(&self, _: &str) -> Vec<String> {
        vec!["nbd".into()]
    }
    fn fits(&self, peer: &str, _: &str, workload: &str) -> bool {
        let trip = matches!(peer, "ctl-stats" | "version" | "rpc-stats");
        trip == (workload == "round-trip")
    }
    fn has_ceiling(&self, _: &str) -> bool {
        false
    }
}

impl Driver for Control<'_> {
    fn storage(&self) -> String {
        format!(
            "{}, {} MiB served, {} loops",
            self.setup.work.path().display(),
            self.setup.o.size >> 20,
            self.setup.o.loops
        )
    }

    fn peer_name(&self, peer: &str) -> String {
        match peer {
            "quiet" => "fio 4k randread, no control traffic",
            "churn" => "fio beside loops of ctl disk-add / disk-list / stats / disk-remove",
            "spawn" => "fio beside loops of `cryptblk --version` (process starts alone)",
            "ctl-stats" => "`cryptblk ctl stats`, a new process each",
            "version" => "`cryptblk --version`",
            _ => "JSON-RPC \"stats\" on one open connection",
        }
        .into()
    }

    fn measure(&mut self, step: &Step) -> Result<Measured> {
        let s = &self.setup;
        let ctl = s.ctl.display().to_string();
        let median_us = match step.peer.as_str() {
            "ctl-stats" => {
                loops::process_ms(s.bin, &["ctl", "-s", &ctl, "stats"], ROUND_TRIPS)? * 1e3
            }
            "version" => loops::process_ms(s.bin, &["--version"], ROUND_TRIPS)? * 1e3,
            "rpc-stats" => loops::rpc_stats_us(s.ctl, ROUND_TRIPS)?,
            mode => return measure(s, mode),
        };
        Ok(Measured {
            window_s: 0.0,
            metrics: Metrics::default().with("median_us", Some(median_us)),
        })
    }
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
fn measure(s: &Setup, mode: &str) -> Result<Measured> {
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
    let mut metrics = m.metrics;
    if looped {
        metrics
            .set("ops", Some(ops as f64))
            .set("errors", Some(errors as f64))
            .set("ops_per_s", Some(ops as f64 / loops_s));
    }
    Ok(Measured {
        window_s: m.window_s,
        metrics,
    })
}
