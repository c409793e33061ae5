//! The hand-off driver (`cryptblk-bench handoff`, preset `handoff`): the downtime of a shared-storage hand-off of a LUKS2 RBD disk
//! between two daemons (`migrate-start --shared`), idle and under a 4k random-write load;
//! was the hand-off section of `scripts/bench-rbd.sh`.
//!
//! Two daemons, A serving the disk "vol" and B without a disk, on a throwaway single-node
//! cluster. A pattern is written through A first. Each hand-off: the daemon without the disk
//! listens (`migrate-incoming --nbd-export`), the holder runs `migrate-start --shared` and
//! `migrate-switchover`, and once the receiver lists the disk as attached the old holder
//! removes it; the receiver holds it for the next hand-off. Idle and loaded hand-offs
//! alternate as idle, loaded; loaded, idle; ... so that both kinds run in both directions.
//! Loaded: fio's nbd engine writes 4k at random (depth 32, above the pattern) into the
//! holder's export from 2 s before the switchover until the receiver serves the disk (fio
//! then sees the fenced holder's errors; they are ignored). The figure is the holder's
//! `downtime-ms` (migrate-status: from its fence until the receiver holds the image's lock
//! and answered). At the end the pattern must read back through the last holder. The
//! targets (every hand-off within 100 ms idle, 500 ms loaded) are in the table.
use crate::config::Config;
use crate::config::Transport;
use crate::engine::{self, Driver, Measured};
use crate::images::POOL;
use crate::plan::{Fits, Step};
use crate::sample::{Metrics, Sample};
use crate::{clients, peers, wait};
use anyhow::{bail, Context, Result};
use cryptblk_testutil::ceph::Cluster;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the pattern goes in the payload, and where the load's writes start (above it).
const PATTERN_AT: u64 = 1 << 20;
const PATTERN_LEN: u64 = 1 << 20;
const LOAD_FROM: u64 = 4 << 20;

#[derive(clap::Args)]
pub struct Args {
    /// Idle and loaded hand-offs each.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
    /// The disk's payload (at least 8M).
    #[arg(long, default_value = "64M", value_parser = crate::config::parse_size)]
    pub size: u64,
    #[arg(long, default_value = "handoff-results.jsonl")]
    pub results: PathBuf,
    /// The cryptblk binary (default: `cargo build --release`, then target/release).
    #[arg(long)]
    pub cryptblk: Option<PathBuf>,
}

/// A daemon of the hand-off: its process (killed when dropped), control and NBD sockets.
struct Daemon {
    name: &'static str,
    server: peers::Running,
    ctl: PathBuf,
    cryptblk: PathBuf,
}

impl Daemon {
    fn start(name: &'static str, cryptblk: &Path, work: &Path, disk: &[&str]) -> Result<Daemon> {
        let ctl = work.join(format!("{name}.ctl"));
        let nbd = work.join(format!("{name}.nbd"));
        let mut cmd = Command::new(cryptblk);
        cmd.arg("serve")
            .args(disk)
            .arg("--nbd")
            .arg(format!("unix:{}", nbd.display()))
            .arg("--control")
            .arg(&ctl);
        let log = work.join(format!("{name}.log"));
        // Listening on the NBD socket (B has no disk to export yet), then answering ctl.
        let server = peers::start(cmd, &nbd, &log, Transport::Vhost, 0)?;
        let daemon = Daemon {
            name,
            server,
            ctl,
            cryptblk: cryptblk.to_path_buf(),
        };
        wait::until(
            Duration::from_secs(90),
            Duration::from_millis(100),
            || {
                format!(
                    "daemon {name}: no control socket: {}",
                    daemon.server.log_tail()
                )
            },
            || Ok(clients::ctl(cryptblk, &daemon.ctl, &["disk-list"]).ok()),
        )?;
        Ok(daemon)
    }

    fn uri(&self) -> String {
        self.server.uri()
    }

    fn ctl(&self, args: &[&str]) -> Result<Value> {
        eprintln!("+ cryptblk ctl ({}) {}", self.name, args.join(" "));
        clients::ctl(&self.cryptblk, &self.ctl, args).with_context(|| {
            format!(
                "daemon {}'s log ends: {}",
                self.name,
                self.server.log_tail()
            )
        })
    }

    fn has_disk(&self) -> bool {
        clients::ctl(&self.cryptblk, &self.ctl, &["disk-list"]).is_ok_and(|v| {
            v["disks"].as_array().is_some_and(|disks| {
                disks
                    .iter()
                    .any(|d| d["name"] == "vol" && d["state"] == "attached")
            })
        })
    }
}

/// qemu-io on an export; fails unless every command succeeded and every pattern matched.
fn qemu_io(uri: &str, what: &str, commands: &[String]) -> Result<()> {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    cmd.arg(uri);
    crate::command::show(&cmd);
    let out = cmd.output().context("running qemu-io")?;
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    if !out.status.success() || text.contains("fail") || text.contains("Pattern verification") {
        bail!("{what}: qemu-io: {}", text.trim());
    }
    Ok(())
}

/// The loaded hand-off's writer: fio on the holder's export, stopped by SIGTERM.
struct Load {
    child: Child,
    output: PathBuf,
}

impl Load {
    fn start(uri: &str, size: u64, output: PathBuf) -> Result<Load> {
        let mut cmd = Command::new("fio");
        cmd.args([
            "--ioengine=nbd",
            "--name=handoff",
            "--rw=randwrite",
            "--bs=4k",
        ])
        .args([
            "--iodepth=32",
            "--numjobs=1",
            "--time_based",
            "--runtime=120",
        ])
        .args(["--continue_on_error=all", "--output-format=json"])
        .arg(format!("--uri={uri}"))
        .arg(format!("--offset={LOAD_FROM}"))
        .arg(format!("--size={}", size - LOAD_FROM))
        .arg(format!("--output={}", output.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        crate::command::show(&cmd);
        let mut child = cmd.spawn().context("starting fio")?;
        std::thread::sleep(Duration::from_secs(2));
        if let Some(status) = child.try_wait()? {
            bail!("fio ended before the switchover ({status})");
        }
        Ok(Load { child, output })
    }

    /// Stops fio and returns its write IOPS (fio writes its JSON on SIGTERM).
    fn stop(mut self) -> Option<f64> {
        // Our own child, not reaped yet (if it already exited, the wait below finds that).
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::TERM,
        );
        let start = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) && start.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // fio notes the signal before its JSON, and the job ends with the fenced holder's
        // errors: only the write IOPS are read.
        let text = std::fs::read_to_string(&self.output).ok()?;
        let json: Value = serde_json::from_str(&text[text.find('{')?..]).ok()?;
        json["jobs"][0]["write"]["iops"].as_f64()
    }
}

/// Runs `rounds` idle and `rounds` loaded hand-offs; appends a sample per hand-off to the
/// results file.
pub fn run(o: &Args, cryptblk: &Path, config: &Config) -> Result<Vec<Sample>> {
    let preset = config.preset("handoff")?;
    for tool in ["ceph-mon", "rbd", "qemu-io", "fio"] {
        if Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map_or(true, |out| !out.status.success())
        {
            bail!("{tool} is not installed: scripts/install-deps.sh installs it");
        }
    }
    if o.size < 2 * LOAD_FROM {
        bail!(
            "--size must be at least {} MiB for the hand-off",
            (2 * LOAD_FROM) >> 20
        );
    }
    let work = std::env::temp_dir().join(format!("cryptblk-handoff-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = run_in(o, cryptblk, preset, &work);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn run_in(
    o: &Args,
    cryptblk: &Path,
    preset: &crate::config::Preset,
    work: &Path,
) -> Result<Vec<Sample>> {
    eprintln!("+ starting a single-node Ceph cluster (memstore OSD)");
    let cluster = Cluster::start();
    let key = work.join("key");
    std::fs::write(&key, "bench")?;
    let key_arg = key.to_string_lossy().into_owned();
    let image = format!("rbd:{POOL}/vol:conf={}", cluster.conf.display());
    crate::command::run(
        Command::new(cryptblk)
            .args(["format", "--batch-mode", "--key-file", &key_arg])
            .args(["--pbkdf", "pbkdf2", "--iter-time", "10"])
            .arg(&image)
            .arg(o.size.to_string()),
    )?;
    let a = Daemon::start(
        "A",
        cryptblk,
        work,
        &["--image", &image, "--name", "vol", "--key-file", &key_arg],
    )?;
    let b = Daemon::start("B", cryptblk, work, &[])?;
    qemu_io(
        &a.uri(),
        "writing the pattern through A",
        &[pattern("write"), "flush".into()],
    )?;
    let mut d = Handoffs {
        setup: Setup {
            o,
            work,
            image: &image,
            key: &key_arg,
        },
        daemons: [a, b],
        holder: 0,
        n: 0,
    };
    let samples = engine::run("handoff", preset, o.rounds, &mut d, &o.results)?;
    drop(d);
    drop(cluster);
    Ok(samples)
}

fn pattern(op: &str) -> String {
    format!("{op} -P 0x5a {PATTERN_AT} {PATTERN_LEN}")
}

/// The two daemons and which one holds the disk.
struct Handoffs<'a> {
    setup: Setup<'a>,
    daemons: [Daemon; 2],
    holder: usize,
    /// Hand-offs so far.
    n: u32,
}

impl Fits for Handoffs<'_> {
    fn transports(&self, _: &str) -> Vec<String> {
        vec!["nbd".into()]
    }
    fn fits(&self, _: &str, _: &str, _: &str) -> bool {
        true
    }
    fn has_ceiling(&self, _: &str) -> bool {
        false
    }
}

impl Driver for Handoffs<'_> {
    fn storage(&self) -> String {
        format!(
            "Ceph RBD (one monitor, one memstore OSD, this machine), {} MiB",
            self.setup.o.size >> 20
        )
    }

    fn peer_name(&self, peer: &str) -> String {
        match peer {
            "idle" => "hand-off of an idle disk".into(),
            _ => "hand-off under fio's 4k random writes (depth 32)".into(),
        }
    }

    fn measure(&mut self, step: &Step) -> Result<Measured> {
        self.n += 1;
        let (from, to) = (&self.daemons[self.holder], &self.daemons[1 - self.holder]);
        eprintln!(
            "hand-off {}: {} -> {}, {}",
            self.n, from.name, to.name, step.peer
        );
        let loaded = step.peer == "loaded";
        let (downtime_ms, fio_write_iops) = hand_off(&self.setup, from, to, loaded, self.n)?;
        self.holder = 1 - self.holder;
        std::thread::sleep(Duration::from_secs(1));
        Ok(Measured {
            window_s: downtime_ms / 1e3,
            metrics: Metrics::default()
                .with("downtime_ms", Some(downtime_ms))
                .with("fio_write_iops", fio_write_iops),
        })
    }

    fn finish(&mut self) -> Result<()> {
        qemu_io(
            &self.daemons[self.holder].uri(),
            "reading the pattern back through the last holder",
            &[pattern("read")],
        )
    }
}

/// What every hand-off shares: the options, the work directory, the image and its key file.
struct Setup<'a> {
    o: &'a Args,
    work: &'a Path,
    image: &'a str,
    key: &'a str,
}

/// One hand-off from `from` to `to`: the holder's downtime in ms, and fio's write IOPS when
/// `loaded`.
fn hand_off(
    s: &Setup,
    from: &Daemon,
    to: &Daemon,
    loaded: bool,
    n: u32,
) -> Result<(f64, Option<f64>)> {
    let (o, work, image, key) = (s.o, s.work, s.image, s.key);
    let listen = format!("unix:{}", work.join(format!("mig.{n}.sock")).display());
    to.ctl(&[
        "migrate-incoming",
        "vol",
        "--image",
        image,
        "--listen",
        &listen,
        "--key-file",
        key,
        "--nbd-export",
    ])?;
    let started = from.ctl(&["migrate-start", "vol", "--to", &listen, "--shared"])?;
    if started["shared"] != true {
        bail!("migrate-start --shared did not start a shared migration: {started}");
    }
    let load = if loaded {
        Some(Load::start(
            &from.uri(),
            o.size,
            work.join(format!("fio.{n}.json")),
        )?)
    } else {
        None
    };
    from.ctl(&["migrate-switchover", "vol"])?;
    let last = std::cell::RefCell::new(Value::Null);
    let status = wait::until(
        Duration::from_secs(120),
        Duration::from_millis(100),
        || format!("hand-off {n} not completed: {}", last.borrow()),
        || {
            let status = from.ctl(&["migrate-status", "vol"])?;
            match status["phase"].as_str() {
                Some("completed") => Ok(Some(status)),
                Some("failed" | "cancelled") => bail!("hand-off {n}: {status}"),
                _ => {
                    *last.borrow_mut() = status;
                    Ok(None)
                }
            }
        },
    )?;
    let downtime_ms = status["outgoing"]["downtime-ms"]
        .as_f64()
        .with_context(|| format!("migrate-status has no outgoing downtime-ms: {status}"))?;
    wait::until(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || {
            format!(
                "hand-off {n}: daemon {} never listed vol as attached",
                to.name
            )
        },
        || Ok(to.has_disk().then_some(())),
    )?;
    let fio_write_iops = load.and_then(Load::stop);
    from.ctl(&["disk-remove", "vol"])?;
    Ok((downtime_ms, fio_write_iops))
}
