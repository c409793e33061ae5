//! `cryptblk-bench soak`: one daemon serving many disks for a long while, clients arriving and
//! leaving with verified data, upgrades, kills and attach/detach churn in the middle; the
//! daemon's RSS, threads and descriptors sampled every second (JSON records, an SVG chart, a
//! summary, a non-zero exit when a tolerance breaks). A benchmark command, not a test.
//!
//! - `disks`: images, the config file, the table clients and churn share.
//! - `model`: what each block must hold, checked on every read.
//! - `client`: the workers.
//! - `daemon`: `cryptblk serve`, `ctl`, upgrade, kill and restart.
//! - `sampler`, `record`, `summary`, `chart`: the figures.
mod chart;
mod client;
mod daemon;
mod disks;
mod model;
mod record;
mod sampler;
mod schedule;
mod summary;

use crate::config::parse_size;
use anyhow::{bail, Context, Result};
use client::Fleet;
use daemon::Daemon;
use record::{Event, Recorder, Sample, SoakRecord, Summary, Tolerances};
use schedule::Kind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Measure nothing: print the summary and write the chart of this earlier results file
    /// again (with the tolerances and warm-up given now).
    #[arg(long, value_name = "RESULTS.jsonl")]
    pub from: Option<PathBuf>,
    /// Disks in the config file (a third raw, the rest LUKS2 with a cheap pbkdf2 keyslot).
    #[arg(long, default_value_t = 200)]
    pub disks: usize,
    /// Of those, LUKS2 disks at `cryptblk format`'s default argon2id.
    #[arg(long, default_value_t = 0)]
    pub argon2id_disks: usize,
    /// Extra disks the churn attaches and detaches with `ctl disk-add` / `disk-remove`.
    #[arg(long, default_value_t = 20)]
    pub pool: usize,
    /// Each disk's size.
    #[arg(long, default_value = "16M")]
    pub disk_size: String,
    /// How long the clients run.
    #[arg(long, default_value_t = 30.0)]
    pub minutes: f64,
    /// The daemon's --memory-budget.
    #[arg(long, default_value = "256M")]
    pub memory_budget: String,
    /// Where the images, sockets, config and the daemon's log go (emptied first if an earlier
    /// soak made it; refused if it holds other files).
    #[arg(long, default_value = "/var/tmp/cryptblk-soak")]
    pub dir: PathBuf,
    /// The cryptblk binary (default: `cargo build --release`, then target/release).
    #[arg(long)]
    pub cryptblk: Option<PathBuf>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// The share of client sessions over NBD (the rest over vhost-user-blk).
    #[arg(long, default_value_t = 0.25)]
    pub nbd_share: f64,
    /// Seeds the clients' choices and the churn.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Minutes between `ctl upgrade`s.
    #[arg(long, default_value_t = 5.0)]
    pub upgrade_every: f64,
    /// Minutes between kill -9 + restarts.
    #[arg(long, default_value_t = 7.0)]
    pub kill_every: f64,
    /// Minutes between churn events (a detach, an attach, and a detach + attach of a disk a
    /// client is on).
    #[arg(long, default_value_t = 1.0)]
    pub churn_every: f64,
    /// Seconds at the start left out of the RSS slope.
    #[arg(long, default_value_t = 120.0)]
    pub warmup: f64,
    /// Tolerance: VmRSS and RssAnon slope over the run, MiB per hour.
    #[arg(long, default_value_t = 16.0)]
    pub max_rss_slope: f64,
    /// Tolerance: idle RssAnon at the end over the start, MiB.
    #[arg(long, default_value_t = 16.0)]
    pub max_idle_anon_growth: f64,
    /// Tolerance: idle threads at the end over the start. One: the buffer reclaimer starts at
    /// the first request and stays (crates/block/src/buffers.rs), after the start's figure.
    #[arg(long, default_value_t = 1)]
    pub max_idle_thread_growth: i64,
    /// Tolerance: idle descriptors at the end over the start.
    #[arg(long, default_value_t = 0)]
    pub max_idle_fd_growth: i64,
    /// The JSON records (appended).
    #[arg(long, default_value = "soak-results.jsonl")]
    pub results: PathBuf,
    /// The chart (default: the results file with .svg).
    #[arg(long)]
    pub chart: Option<PathBuf>,
}

/// How long every client gets to work again after an event before it counts as unrecovered.
const PAUSE_BOUND: Duration = Duration::from_secs(60);
/// How long the daemon sits with no client before an idle figure is taken.
const SETTLE: Duration = Duration::from_secs(10);

/// Runs the soak; the error names each tolerance broken.
pub fn run(args: &Args, cryptblk: &Path) -> Result<()> {
    if args.disks == 0 || args.clients == 0 || args.clients > args.disks {
        bail!("--disks and --clients must be positive, with at most one client per disk");
    }
    let dir = &args.dir;
    disks::prepare_dir(dir)?;
    let key = dir.join("passphrase");
    std::fs::write(&key, format!("soak-{}-{}\n", args.seed, std::process::id()))?;
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    let made = Instant::now();
    let disks = disks::create(&disks::Layout {
        dir,
        cryptblk,
        key: &key,
        disks: args.disks,
        pool: args.pool,
        argon2id: args.argon2id_disks,
        size: parse_size(&args.disk_size)?,
    })?;
    eprintln!(
        "soak: {} disks and {} in the pool made in {:.1} s",
        args.disks,
        args.pool,
        made.elapsed().as_secs_f64()
    );
    let config = dir.join("disks.toml");
    std::fs::write(
        &config,
        disks::config_toml(&disks, &key, &args.memory_budget),
    )?;
    let control = dir.join("control.sock");
    let log = dir.join("daemon.log");
    let started = Instant::now();
    let mut daemon = Daemon::start(&daemon::Settings {
        cryptblk,
        config: &config,
        control: &control,
        nbd: &dir.join("nbd.sock"),
        memory_budget: &args.memory_budget,
        log: &log,
    })?;
    daemon.wait_ready(args.disks)?;
    eprintln!(
        "soak: the daemon serves {} disks after {:.1} s",
        args.disks,
        started.elapsed().as_secs_f64()
    );

    let fleet = Arc::new(Fleet {
        disks,
        nbd_socket: dir.join("nbd.sock"),
        daemon_changes: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        ops: AtomicU64::new(0),
        verify_errors: AtomicU64::new(0),
        client_errors: AtomicU64::new(0),
        connected: AtomicU32::new(0),
        progress: (0..args.clients).map(|_| AtomicU64::new(0)).collect(),
        t0: Instant::now(),
        nbd_share: args.nbd_share,
        recorder: Recorder::create(&args.results)?,
    });
    fleet.recorder.push(SoakRecord::Start {
        commit: crate::procfs::commit(),
        machine: crate::procfs::machine(),
        disks: args.disks,
        pool: args.pool,
        clients: args.clients,
        minutes: args.minutes,
        memory_budget: args.memory_budget.clone(),
        seed: args.seed,
        command: daemon.command_line(),
    })?;
    std::thread::sleep(SETTLE);
    idle_figure(&fleet, &daemon, "start")?;

    let pid = Arc::new(AtomicU32::new(daemon.pid()));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (fleet, pid, sampling) = (fleet.clone(), pid.clone(), sampling.clone());
        std::thread::spawn(move || sample_every_second(&fleet, &pid, &sampling))
    };
    let workers: Vec<_> = (0..args.clients)
        .map(|i| {
            let fleet = fleet.clone();
            let seed = args.seed;
            std::thread::spawn(move || client::worker(&fleet, i, seed))
        })
        .collect();

    let plan = schedule::plan(
        args.minutes * 60.0,
        args.upgrade_every * 60.0,
        args.kill_every * 60.0,
        args.churn_every * 60.0,
    );
    let run_start = fleet.now_s();
    let mut churn_rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(args.seed);
    let mut outcome = Ok(());
    for (at, kind) in plan {
        while fleet.now_s() < run_start + at {
            if fleet.stop.load(Ordering::SeqCst) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if fleet.stop.load(Ordering::SeqCst) {
            break;
        }
        let result = event(&fleet, &mut daemon, &key, kind, &mut churn_rng);
        pid.store(daemon.pid(), Ordering::SeqCst);
        if let Err(e) = result {
            outcome = Err(e.context(format!("the {} event", kind.name())));
            break;
        }
    }
    while outcome.is_ok()
        && fleet.now_s() < run_start + args.minutes * 60.0
        && !fleet.stop.load(Ordering::SeqCst)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    fleet.stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.join().map_err(|_| anyhow::anyhow!("a client panicked"))?;
    }
    if outcome.is_ok() {
        // Back to the start's disk set before the idle figure.
        for d in fleet.disks.iter().filter(|d| d.pool) {
            if d.attached.load(Ordering::SeqCst) {
                detach(&daemon, d)?;
            }
        }
        std::thread::sleep(SETTLE);
        idle_figure(&fleet, &daemon, "end")?;
    }
    sampling.store(false, Ordering::SeqCst);
    sampler
        .join()
        .map_err(|_| anyhow::anyhow!("the sampler panicked"))?;
    let stopped = daemon.stop();

    let records = fleet.recorder.records();
    let summary = report(&records, args)?;
    fleet
        .recorder
        .push(SoakRecord::Summary(Box::new(summary.clone())))?;
    eprintln!("soak: daemon log in {}", daemon.log().display());
    outcome?;
    let status = stopped?;
    if status != 0 {
        bail!("the daemon exited with wait status {status:#x} on SIGTERM");
    }
    verdict(&summary)
}

/// `--from RESULTS`: the summary and the chart of an earlier run's records again (with this
/// run's tolerances and warm-up), nothing measured.
pub fn report_again(args: &Args, results: &Path) -> Result<()> {
    let text = std::fs::read_to_string(results)
        .with_context(|| format!("reading {}", results.display()))?;
    let mut records = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let record: SoakRecord = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a soak record", results.display(), i + 1))?;
        if !matches!(record, SoakRecord::Summary(_)) {
            records.push(record);
        }
    }
    let args = Args {
        results: results.to_path_buf(),
        ..args.clone()
    };
    verdict(&report(&records, &args)?)
}

fn verdict(summary: &Summary) -> Result<()> {
    if !summary.failed.is_empty() {
        bail!("the soak failed: {}", summary.failed.join("; "));
    }
    Ok(())
}

/// Prints the summary of `records` and writes their chart.
fn report(records: &[SoakRecord], args: &Args) -> Result<Summary> {
    let tolerances = Tolerances {
        rss_slope_mib_h: args.max_rss_slope,
        idle_anon_growth_mib: args.max_idle_anon_growth,
        idle_thread_growth: args.max_idle_thread_growth,
        idle_fd_growth: args.max_idle_fd_growth,
    };
    let summary = summary::summarize(records, args.warmup, tolerances);
    print!("{}", summary::markdown(&summary));
    let samples: Vec<Sample> = records
        .iter()
        .filter_map(|r| match r {
            SoakRecord::Sample(s) => Some(*s),
            _ => None,
        })
        .collect();
    let events: Vec<Event> = records
        .iter()
        .filter_map(|r| match r {
            SoakRecord::Event(e) => Some(e.clone()),
            _ => None,
        })
        .collect();
    let chart_path = args
        .chart
        .clone()
        .unwrap_or_else(|| args.results.with_extension("svg"));
    let title = records
        .iter()
        .find_map(|r| match r {
            SoakRecord::Start {
                disks,
                pool,
                clients,
                minutes,
                memory_budget,
                ..
            } => Some(format!(
                "cryptblk soak: {disks} disks (+{pool} churned), {clients} clients, {minutes:.0} min, --memory-budget {memory_budget}"
            )),
            _ => None,
        })
        .unwrap_or_else(|| "cryptblk soak".into());
    std::fs::write(&chart_path, chart::render(&title, &samples, &events)?)
        .with_context(|| format!("writing {}", chart_path.display()))?;
    eprintln!(
        "soak: records in {}, chart in {}",
        args.results.display(),
        chart_path.display()
    );
    Ok(summary)
}

fn sample_every_second(fleet: &Fleet, pid: &AtomicU32, sampling: &AtomicBool) {
    let mut next = Instant::now();
    while sampling.load(Ordering::SeqCst) {
        if let Some(s) = figure(fleet, pid.load(Ordering::SeqCst)) {
            let _ = fleet.recorder.push(SoakRecord::Sample(s));
        }
        next += Duration::from_secs(1);
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
}

/// The daemon's figures and the clients' counts now.
fn figure(fleet: &Fleet, pid: u32) -> Option<Sample> {
    let mut s = sampler::process(pid)?;
    s.t_s = fleet.now_s();
    s.ops = fleet.ops.load(Ordering::SeqCst);
    s.verify_errors = fleet.verify_errors.load(Ordering::SeqCst);
    s.client_errors = fleet.client_errors.load(Ordering::SeqCst);
    s.connected = fleet.connected.load(Ordering::SeqCst);
    s.load1 = crate::procfs::load1();
    Some(s)
}

fn idle_figure(fleet: &Fleet, daemon: &Daemon, when: &str) -> Result<()> {
    let sample = figure(fleet, daemon.pid()).context("the daemon is gone")?;
    eprintln!(
        "soak: idle at the {when}: VmRSS {} KiB, RssAnon {} KiB, {} threads, {} descriptors",
        sample.rss_kib, sample.anon_kib, sample.threads, sample.fds
    );
    let (descriptors, threads) = sampler::inventory(daemon.pid());
    eprintln!("soak: descriptors {descriptors:?}; threads {threads:?}");
    fleet.recorder.push(SoakRecord::Idle {
        when: when.into(),
        sample,
        descriptors,
        threads,
    })
}

/// One event, and its record with the pause the clients saw.
fn event(
    fleet: &Fleet,
    daemon: &mut Daemon,
    key: &Path,
    kind: Kind,
    rng: &mut rand::rngs::StdRng,
) -> Result<()> {
    let at_ns = fleet.now_ns();
    let at = Instant::now();
    let detail = match kind {
        Kind::Upgrade | Kind::Kill => {
            let old = daemon.pid();
            fleet.daemon_changes.fetch_add(1, Ordering::SeqCst);
            let result = if kind == Kind::Upgrade {
                daemon.upgrade()
            } else {
                daemon.kill_and_restart()
            };
            let ready = result.and_then(|new| {
                daemon.wait_ready(fleet.disks.iter().filter(|d| !d.pool).count())?;
                if kind == Kind::Kill {
                    // A restart serves the config file's disks: what was attached since is
                    // attached again, as the management layer would.
                    for d in fleet.disks.iter().filter(|d| d.pool) {
                        if d.attached.load(Ordering::SeqCst) {
                            daemon.ctl(&disks::add_args(d, key))?;
                        }
                    }
                }
                Ok(new)
            });
            fleet.daemon_changes.fetch_add(1, Ordering::SeqCst);
            format!("pid {old} -> {}", ready?)
        }
        Kind::Churn => churn(fleet, daemon, key, rng)?,
    };
    let took_ms = at.elapsed().as_secs_f64() * 1e3;
    let pause_ms = pause(fleet, at_ns, at).map(|d| d.as_secs_f64() * 1e3);
    eprintln!(
        "soak: {:.0} s: {} ({detail}) took {took_ms:.0} ms, pause {}",
        at_ns as f64 / 1e9,
        kind.name(),
        pause_ms.map_or("unbounded".into(), |p| format!("{p:.0} ms"))
    );
    fleet.recorder.push(SoakRecord::Event(Event {
        t_s: at_ns as f64 / 1e9,
        kind: kind.name().into(),
        detail,
        took_ms,
        pause_ms,
    }))
}

/// From the event until every client has completed a request started after it; `None` past
/// the bound (or if the run stopped first).
fn pause(fleet: &Fleet, at_ns: u64, at: Instant) -> Option<Duration> {
    loop {
        if fleet
            .progress
            .iter()
            .all(|p| p.load(Ordering::SeqCst) > at_ns)
        {
            return Some(at.elapsed());
        }
        if at.elapsed() > PAUSE_BOUND || fleet.stop.load(Ordering::SeqCst) {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A detach of an attached pool disk, an attach of a detached one, and a detach + attach of
/// one a client is on (it reconnects to it); the detached ones picked among disks a client
/// holds first (`disk-remove --force`: a VM's disk pulled from under it).
fn churn(
    fleet: &Fleet,
    daemon: &Daemon,
    key: &Path,
    rng: &mut rand::rngs::StdRng,
) -> Result<String> {
    use rand::seq::SliceRandom;
    let pool: Vec<&disks::Disk> = fleet.disks.iter().filter(|d| d.pool).collect();
    let attached = |held: bool| -> Vec<&disks::Disk> {
        pool.iter()
            .copied()
            .filter(|d| d.attached.load(Ordering::SeqCst) && d.is_held() == held)
            .collect()
    };
    let pick = |rng: &mut rand::rngs::StdRng| {
        let held = attached(true);
        match held.choose(rng) {
            Some(d) => Some(*d),
            None => attached(false).choose(rng).copied(),
        }
    };
    let mut done = Vec::new();
    if let Some(d) = pick(rng) {
        detach(daemon, d)?;
        done.push(format!("-{}", d.name));
    }
    let detached: Vec<&disks::Disk> = pool
        .iter()
        .copied()
        .filter(|d| !d.attached.load(Ordering::SeqCst))
        .collect();
    // Not the one just detached: it stays away, and its client moves on.
    if let Some(d) = detached
        .iter()
        .filter(|d| done.first() != Some(&format!("-{}", d.name)))
        .collect::<Vec<_>>()
        .choose(rng)
    {
        attach(daemon, key, d)?;
        done.push(format!("+{}", d.name));
    }
    if let Some(d) = pick(rng) {
        bounce(daemon, key, d)?;
        done.push(format!("-+{}", d.name));
    }
    Ok(done.join(" "))
}

fn detach(daemon: &Daemon, d: &disks::Disk) -> Result<()> {
    d.changes.fetch_add(1, Ordering::SeqCst);
    d.attached.store(false, Ordering::SeqCst);
    let result = daemon.ctl(&["disk-remove", "--force", &d.name]);
    d.changes.fetch_add(1, Ordering::SeqCst);
    result.map(|_| ())
}

fn attach(daemon: &Daemon, key: &Path, d: &disks::Disk) -> Result<()> {
    d.changes.fetch_add(1, Ordering::SeqCst);
    let result = daemon.ctl(&disks::add_args(d, key));
    if result.is_ok() {
        d.attached.store(true, Ordering::SeqCst);
    }
    d.changes.fetch_add(1, Ordering::SeqCst);
    result.map(|_| ())
}

/// Detached and attached again, one change for its clients: they wait for it to come back.
fn bounce(daemon: &Daemon, key: &Path, d: &disks::Disk) -> Result<()> {
    d.changes.fetch_add(1, Ordering::SeqCst);
    let result = daemon
        .ctl(&["disk-remove", "--force", &d.name])
        .and_then(|_| daemon.ctl(&disks::add_args(d, key)));
    d.attached.store(result.is_ok(), Ordering::SeqCst);
    d.changes.fetch_add(1, Ordering::SeqCst);
    result.map(|_| ())
}
