//! The reencryption driver: a LUKS2 image's volume key replaced (preset `reencrypt`) and a
//! served raw disk encrypted in place (preset `encrypt-online`, `reencrypt --encrypt`).
//!
//! Offline, on the same image (page cache dropped before each): `cryptsetup reencrypt
//! --force-offline-reencrypt`, `cryptblk reencrypt` (both with the same resilience,
//! `checksum`, and a cheap PBKDF for the new keyslot, so the data is what is timed), and `dd`
//! reading and writing the same bytes in place with O_DIRECT, the device's limit for a pass
//! that reads and rewrites the whole payload (the ceiling). Online: the image served over
//! vhost-user-blk (`cache=none`, a fresh server per round), 4k random reads at depth 32 from
//! vu_bench without a reencryption and during one at the default rate (`ctl
//! reencrypt-start`, then `reencrypt-pause`); at the end the paused one is finished.
//!
//! In place: a copy of the raw image is served; the encryption is started and paused at once
//! (the image is LUKS2 from then on, its first part moved to the end); then the same reads
//! run with the encryption paused ("without") and resumed ("during"): the ratio is what the
//! guest loses to the work, the p99 what requests that hit a hotzone wait.
use crate::config::{Config, Image, Workload};
use crate::engine::{self, Driver, Measured};
use crate::plan::{Fits, Step};
use crate::sample::{Metrics, Sample};
use crate::{clients, images, peers, procfs};
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    #[arg(long, default_value = "8G", value_parser = crate::config::parse_size)]
    pub size: u64,
    /// Where the image goes (a real filesystem; kept with --keep-images).
    #[arg(long, default_value = "/var/tmp/cryptblk-bench-reencrypt")]
    pub dir: PathBuf,
    /// Seconds of each online measurement.
    #[arg(long, default_value_t = 5.0)]
    pub runtime: f64,
    #[arg(long, default_value = "reencrypt-results.jsonl")]
    pub results: PathBuf,
    #[arg(long)]
    pub cryptblk: Option<PathBuf>,
    #[arg(long)]
    pub vu_bench: Option<PathBuf>,
    #[arg(long)]
    pub keep_images: bool,
    /// Encrypt a served raw disk in place instead (online only: its 4k random reads
    /// while the encryption runs against while it is paused).
    #[arg(long)]
    pub encrypt: bool,
}

/// A served image with its control socket.
struct Served {
    server: peers::Running,
    socket: PathBuf,
    ctl: PathBuf,
    round: u32,
}

struct Reencrypt<'a> {
    o: &'a Args,
    cryptblk: &'a Path,
    vu_bench: &'a Path,
    workload: &'a Workload,
    image: PathBuf,
    key: String,
    online: Option<Served>,
}

pub fn run(
    o: &Args,
    (cryptblk, vu_bench): (&Path, &Path),
    config: &Config,
    workload: &Workload,
) -> Result<Vec<Sample>> {
    let name = if o.encrypt {
        "encrypt-online"
    } else {
        "reencrypt"
    };
    let preset = config.preset(name)?;
    for tool in ["cryptsetup", "dd"] {
        if Command::new(tool).arg("--version").output().is_err() {
            bail!("{tool} is not installed: scripts/install-deps.sh installs it");
        }
    }
    let which = if o.encrypt { Image::Raw } else { Image::Luks2 };
    let imgs = images::prepare(
        &o.dir,
        o.size,
        &BTreeSet::from([which]),
        cryptblk,
        o.keep_images,
    )?;
    let mut d = Reencrypt {
        o,
        cryptblk,
        vu_bench,
        workload,
        image: imgs.path(which),
        key: imgs.key.to_string_lossy().into_owned(),
        online: None,
    };
    if o.encrypt {
        let work = o.dir.join("encrypt-online");
        std::fs::create_dir_all(&work)?;
        d.image = work.join("disk.img");
        eprintln!("+ copying the raw image to {}", d.image.display());
        std::fs::copy(imgs.path(Image::Raw), &d.image).context("copying the raw image")?;
        let served = d.serve(1, false)?;
        d.ctl(
            &served.ctl,
            &[
                "reencrypt-start",
                "vol",
                "--key-file",
                &d.key,
                "--encrypt",
                "--pbkdf",
                "pbkdf2",
                "--iter-time",
                "10",
            ],
        )?;
        d.pause(&served.ctl)?;
        d.online = Some(served);
    }
    let samples = engine::run(name, preset, o.rounds, &mut d, &o.results);
    if !o.keep_images {
        // What this run wrote into --dir, and nothing else of it.
        for made in [imgs.path(which), imgs.key.clone(), d.image.clone()] {
            let _ = std::fs::remove_file(made);
        }
        for work in ["reencrypt-online", "encrypt-online"] {
            let _ = std::fs::remove_dir_all(o.dir.join(work));
        }
    }
    samples
}

impl Reencrypt<'_> {
    /// The image served as disk "vol" over vhost-user-blk (`cache=none`) with a control
    /// socket; its sockets and log go next to it.
    fn serve(&self, round: u32, with_key: bool) -> Result<Served> {
        let work = self.o.dir.join("reencrypt-online");
        std::fs::create_dir_all(&work)?;
        let (socket, ctl) = (work.join("vu.sock"), work.join("ctl.sock"));
        let mut serve = Command::new(self.cryptblk);
        serve
            .args([
                "serve",
                "--name",
                "vol",
                "--cache",
                "none",
                "--unsealed-memory",
            ])
            .args(["--queue-size", "1024", "--image"])
            .arg(&self.image)
            .arg("--vhost-user-blk")
            .arg(&socket)
            .arg("--control")
            .arg(&ctl);
        if with_key {
            serve.args(["--key-file", &self.key]);
        }
        let log = work.join("serve.log");
        let server = peers::start(
            serve,
            &socket,
            &log,
            crate::config::Transport::Vhost,
            self.o.size,
        )?;
        Ok(Served {
            server,
            socket,
            ctl,
            round,
        })
    }

    fn ctl(&self, ctl: &Path, args: &[&str]) -> Result<serde_json::Value> {
        eprintln!("+ cryptblk ctl {}", args.join(" "));
        clients::ctl(self.cryptblk, ctl, args)
    }

    /// Pauses the reencryption and waits (up to 30 s) until it no longer runs: a pause takes
    /// effect once the current hotzone commits.
    fn pause(&self, ctl: &Path) -> Result<()> {
        self.ctl(ctl, &["reencrypt-pause", "vol"])?;
        crate::wait::until(
            Duration::from_secs(30),
            Duration::from_millis(100),
            || "the reencryption still ran after reencrypt-pause".into(),
            || {
                let status = self.ctl(ctl, &["reencrypt-status", "vol"])?;
                Ok(
                    (!matches!(status["phase"].as_str(), Some("running" | "pausing")))
                        .then_some(()),
                )
            },
        )
    }

    fn online(&mut self, step: &Step) -> Result<Measured> {
        if !self.o.encrypt && self.online.as_ref().is_none_or(|s| s.round != step.round) {
            if let Some(old) = self.online.take() {
                old.server.stop()?;
            }
            self.online = Some(self.serve(step.round, true)?);
        }
        let served = self.online.as_ref().context("no served image")?;
        let during = step.peer == "during";
        procfs::drop_caches(&[&self.image])?;
        if during {
            let mut args = vec!["reencrypt-start", "vol", "--key-file", &self.key];
            if !self.o.encrypt {
                args.extend(["--pbkdf", "pbkdf2", "--iter-time", "10"]);
            }
            self.ctl(&served.ctl, &args)?;
        }
        let m = clients::vu_bench(
            self.vu_bench,
            &served.socket,
            self.workload,
            self.o.runtime,
            self.o.size,
            served.server.pid(),
            false,
        )?;
        if during {
            self.pause(&served.ctl)?;
        }
        Ok(m)
    }
}

impl Fits for Reencrypt<'_> {
    fn transports(&self, workload: &str) -> Vec<String> {
        vec![if workload == "offline" {
            "file"
        } else {
            "vhost"
        }
        .into()]
    }

    fn fits(&self, peer: &str, _: &str, workload: &str) -> bool {
        (workload == "offline") == !matches!(peer, "without" | "during")
    }

    fn has_ceiling(&self, workload: &str) -> bool {
        workload == "offline"
    }
}

impl Driver for Reencrypt<'_> {
    fn storage(&self) -> String {
        format!(
            "{}, {} MiB, cache none",
            self.o.dir.display(),
            self.o.size >> 20
        )
    }

    fn peer_name(&self, peer: &str) -> String {
        match peer {
            "cryptsetup" => "cryptsetup reencrypt --force-offline-reencrypt",
            "cryptblk" => "cryptblk reencrypt",
            "copy" => "dd in place, O_DIRECT (ceiling)",
            "without" => "4k random reads, no reencryption running",
            _ => "4k random reads during a reencryption",
        }
        .into()
    }

    fn measure(&mut self, step: &Step) -> Result<Measured> {
        if step.workload != "offline" {
            return self.online(step);
        }
        procfs::drop_caches(&[&self.image])?;
        let seconds = timed(&mut offline_command(
            &step.peer,
            self.cryptblk,
            &self.image,
            &self.key,
        ))?;
        // Every job passes over the whole file (dd over the header too: 16 MiB of GiBs).
        let mib = std::fs::metadata(&self.image)?.len() as f64 / (1 << 20) as f64;
        Ok(Measured {
            window_s: seconds,
            metrics: Metrics::default()
                .with("seconds", Some(seconds))
                .with("mib_s", Some(mib / seconds)),
        })
    }

    fn finish(&mut self) -> Result<()> {
        let mut paused = false;
        if let Some(s) = self.online.take() {
            paused = self.ctl(&s.ctl, &["reencrypt-status", "vol"])?["phase"] == "paused";
            s.server.stop()?;
        }
        if paused && !self.o.encrypt {
            // Leave a whole image behind, not one paused mid-way.
            eprintln!("+ finishing the paused reencryption");
            timed(
                Command::new(self.cryptblk)
                    .args(["reencrypt", "--resume-only", "--key-file", &self.key])
                    .arg(&self.image),
            )?;
        }
        Ok(())
    }
}

fn offline_command(what: &str, cryptblk: &Path, image: &Path, key: &str) -> Command {
    let mut cmd;
    match what {
        "cryptsetup" => {
            cmd = Command::new("cryptsetup");
            cmd.args(["reencrypt", "--force-offline-reencrypt", "--batch-mode"])
                .args(["--key-file", key, "--resilience", "checksum"])
                .args(crate::images::CHEAP_KDF)
                .arg(image);
        }
        "cryptblk" => {
            cmd = Command::new(cryptblk);
            cmd.args(["reencrypt", "--key-file", key, "--resilience", "checksum"])
                .args(crate::images::CHEAP_KDF)
                .arg(image);
        }
        _ => {
            // The payload and the header alike: every byte read and written back in place.
            cmd = Command::new("dd");
            cmd.arg(format!("if={}", image.display()))
                .arg(format!("of={}", image.display()))
                .args([
                    "bs=16M",
                    "iflag=direct",
                    "oflag=direct",
                    "conv=notrunc,fdatasync",
                ])
                .arg("status=none");
        }
    }
    cmd
}

fn timed(cmd: &mut Command) -> Result<f64> {
    crate::command::show(cmd);
    let start = Instant::now();
    crate::command::quiet_output(cmd)?;
    Ok(start.elapsed().as_secs_f64())
}
