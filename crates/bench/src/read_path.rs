//! `cryptblk-bench read-path`: where the encrypted path loses against the plain one on a real
//! disk.
//!
//! One LUKS2 image and its raw twin (the same plaintext) on a disk filesystem, served by the
//! same cryptblk binary over vhost-user-blk (vu_bench, `--cache none`, `--queue-size 1024` so
//! that a depth of 128 is really in flight), the page cache dropped before every run. Per round
//! and workload, in this order:
//!
//! - `fraw`: fio (`--direct=1`, io_uring) on the raw twin, the device's ceiling;
//! - `fluks`: the same on the LUKS2 image's payload (the ciphertext `a` serves): how much of an
//!   a/d gap is the file's place on the disk, not the server's;
//! - `fdec`: the encryptor's ceiling on that payload (`ceiling --touch decrypt`: the same reads
//!   on one thread, each buffer decrypted in place as it completes; reads and one queue only):
//!   no encrypting server can beat it;
//! - `d`: cryptblk serving the raw twin; `a`: cryptblk serving the LUKS2 image;
//! - `o`: an older cryptblk (`--old`) serving the LUKS2 image.
//!
//! One sample per run (preset `read-path`, fraw as the ceiling); the table's figures are
//! a/d, a/fluks, a/fdec, fdec/fluks (the machine's toll for decrypting at all) and o/d.
use crate::ceiling::{self, Touch};
use crate::clients;
use crate::config::{self, Cache, Config, Image, Rw, Transport};
use crate::engine::{self, Driver, Measured};
use crate::plan::{Fits, Step};
use crate::sample::{Metrics, Sample, WorkloadRecord};
use crate::{fio, images, peers, procfs};
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod spec;

pub use spec::Spec;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Seconds per run.
    #[arg(long, default_value_t = 5.0)]
    pub runtime: f64,
    /// Payload size of both images (512M, 8G, ...).
    #[arg(long, default_value = "8G")]
    pub size: String,
    /// rw:bs:depth, comma-separated (rw: read, randread, write, randwrite; bs in bytes).
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = Spec::parse,
        default_value = "read:65536:16,randread:4096:128,read:65536:4,randwrite:4096:32,write:65536:16"
    )]
    pub workloads: Vec<Spec>,
    /// Virtqueues served, vu_bench queues and fio jobs, each at the workload's depth.
    #[arg(long, default_value_t = 1)]
    pub queues: u32,
    /// A directory on a disk filesystem (not tmpfs); the images go to
    /// DIR/cryptblk-bench-read-path.
    #[arg(long, default_value = "/var/tmp")]
    pub dir: PathBuf,
    /// Keep the images for the next run (and reuse ones kept by an earlier run).
    #[arg(long)]
    pub keep_images: bool,
    /// The cryptblk binary (default: `cargo build --release`, then target/release).
    #[arg(long)]
    pub cryptblk: Option<PathBuf>,
    #[arg(long)]
    pub vu_bench: Option<PathBuf>,
    /// An older cryptblk to serve the LUKS2 image as peer `o`, in the same rounds.
    #[arg(long, value_name = "CRYPTBLK")]
    pub old: Option<PathBuf>,
    #[arg(long, default_value = "read-path-results.jsonl")]
    pub results: PathBuf,
}

fn peer_name(id: &str) -> &'static str {
    match id {
        "fraw" => "fio on the raw twin (ceiling)",
        "fluks" => "fio on the LUKS2 payload",
        "fdec" => "encryptor's ceiling (reads decrypted in place, one thread)",
        "d" => "cryptblk serve, raw",
        "a" => "cryptblk serve, LUKS2",
        _ => "older cryptblk serve, LUKS2",
    }
}

struct Bench<'a> {
    args: &'a Args,
    config: &'a Config,
    cryptblk: PathBuf,
    vu_bench: PathBuf,
    images: images::Images,
    data_offset: u64,
    work: PathBuf,
    storage: String,
}

pub fn run(
    args: &Args,
    config: &Config,
    cryptblk: PathBuf,
    vu_bench: PathBuf,
) -> Result<Vec<Sample>> {
    let size = config::parse_size(&args.size)?;
    if !size.is_multiple_of(65536) {
        bail!("--size must be a multiple of 64 KiB (got {size} bytes)");
    }
    if args.queues == 0 || args.runtime <= 0.0 {
        bail!("--queues and --runtime must be positive");
    }
    let mut preset = config.preset("read-path")?.clone();
    preset.workloads = args.workloads.iter().map(|w| w.name(args.queues)).collect();
    if args.old.is_none() {
        preset.peers.retain(|p| p != "o");
    }
    if !rustix::process::geteuid().is_root() {
        bail!("run as root: the page cache is dropped before every run");
    }
    for tool in [&cryptblk, &vu_bench].into_iter().chain(&args.old) {
        if !tool.is_file() {
            bail!(
                "{} not found (--cryptblk, --vu-bench, --old)",
                tool.display()
            );
        }
    }
    if let Some(old) = &args.old {
        check_old(old)?;
    }
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let fs = procfs::fs_type(&args.dir)?;
    if fs == "tmpfs" {
        bail!(
            "{} is tmpfs: this measures a real disk (give --dir on a disk filesystem)",
            args.dir.display()
        );
    }
    let images = images::prepare(
        &args.dir.join("cryptblk-bench-read-path"),
        size,
        &BTreeSet::from([Image::Raw, Image::Luks2]),
        &cryptblk,
        args.keep_images,
    )?;
    // Sockets need short paths: a private directory under /tmp.
    let work =
        std::env::temp_dir().join(format!("cryptblk-bench-read-path.{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let outcome = data_offset(&cryptblk, &images.path(Image::Luks2)).and_then(|data_offset| {
        let mut cx = Bench {
            args,
            config,
            cryptblk,
            vu_bench,
            images: images.clone(),
            data_offset,
            work: work.clone(),
            storage: format!(
                "{fs} {}, {} MiB, cache none",
                args.dir.display(),
                size >> 20
            ),
        };
        engine::run("read-path", &preset, args.rounds, &mut cx, &args.results)
    });
    let _ = std::fs::remove_dir_all(&work);
    if !args.keep_images {
        let _ = std::fs::remove_dir_all(&images.dir);
    }
    outcome
}

impl Bench<'_> {
    fn spec(&self, name: &str) -> Result<&Spec> {
        let q = self.args.queues;
        self.args
            .workloads
            .iter()
            .find(|w| w.name(q) == name)
            .context("a workload not given")
    }
}

impl Fits for Bench<'_> {
    fn transports(&self, _: &str) -> Vec<String> {
        vec!["vhost".into()]
    }

    /// The encryptor's ceiling runs reads on one queue only.
    fn fits(&self, peer: &str, _: &str, workload: &str) -> bool {
        peer != "fdec" || self.args.queues == 1 && self.spec(workload).is_ok_and(|s| s.reads())
    }

    fn has_ceiling(&self, _: &str) -> bool {
        true
    }

    fn transport_of(&self, peer: &str, transport: &str) -> String {
        if peer.starts_with('f') {
            "file"
        } else {
            transport
        }
        .into()
    }
}

impl Driver for Bench<'_> {
    fn storage(&self) -> String {
        self.storage.clone()
    }

    fn peer_name(&self, peer: &str) -> String {
        peer_name(peer).into()
    }

    fn workload(&self, name: &str) -> WorkloadRecord {
        let (q, spec) = (self.args.queues, self.spec(name));
        spec.map_or_else(
            |_| WorkloadRecord::default(),
            |s| WorkloadRecord {
                name: name.into(),
                rw: s.rw.name().into(),
                bs: s.bs,
                depth: s.depth,
                queues: q,
            },
        )
    }

    fn measure(&mut self, step: &Step) -> Result<Measured> {
        measure(self, step)
    }
}

fn measure(cx: &Bench, step: &Step) -> Result<Measured> {
    let a = cx.args;
    let spec = cx.spec(&step.workload)?;
    let w = spec.workload(a.queues);
    let raw = cx.images.path(Image::Raw);
    let luks = cx.images.path(Image::Luks2);
    procfs::drop_caches(&[raw.as_path(), luks.as_path()])?;
    let size = cx.images.size;
    Ok(match step.peer.as_str() {
        "fraw" => fio::run(
            &cx.work,
            &fio::Target::File {
                path: &raw,
                direct: true,
            },
            &w,
            a.runtime,
            None,
        )?,
        "fluks" => fio::run(
            &cx.work,
            &fio::Target::Region {
                path: &luks,
                offset: cx.data_offset,
                size,
            },
            &w,
            a.runtime,
            None,
        )?,
        "fdec" => {
            let out = ceiling::run(&ceiling::Ceiling {
                file: &luks,
                offset: cx.data_offset,
                size,
                random: spec.rw == Rw::Randread,
                bs: spec.bs as usize,
                iodepth: spec.depth as usize,
                runtime: Duration::from_secs_f64(a.runtime),
                touch: Touch::Decrypt,
            })?;
            let iops = out["iops"].as_f64().context("the ceiling gave no IOPS")?;
            Measured {
                window_s: a.runtime,
                metrics: Metrics::default()
                    .with("iops", Some(iops))
                    .with("mib_s", Some(iops * spec.bs as f64 / (1 << 20) as f64))
                    .with("lat_mean_us", out["lat_avg_us"].as_f64()),
            }
        }
        served => {
            let (binary, config_peer) = match served {
                "d" => (&cx.cryptblk, "d"),
                "a" => (&cx.cryptblk, "a"),
                _ => (a.old.as_ref().context("peer o without --old")?, "a"),
            };
            let socket = cx.work.join("vu.sock");
            let cmd = peers::command(
                cx.config.peer(config_peer)?,
                binary,
                &cx.images,
                Transport::Vhost,
                a.queues,
                Cache::None,
                &socket,
            )?;
            let log = cx.work.join(format!("{served}.log"));
            let server = peers::start(cmd, &socket, &log, Transport::Vhost, size)?;
            let m = clients::vu_bench(
                &cx.vu_bench,
                &socket,
                &w,
                a.runtime,
                size,
                server.pid(),
                false,
            )?;
            server.stop()?;
            m
        }
    })
}

/// Where the LUKS2 payload starts (`cryptblk dump --json`).
fn data_offset(cryptblk: &Path, image: &Path) -> Result<u64> {
    let dump =
        crate::command::quiet_output(Command::new(cryptblk).args(["dump", "--json"]).arg(image))?;
    let v: serde_json::Value =
        serde_json::from_str(&dump).context("parsing `cryptblk dump --json`")?;
    v["data_offset"]
        .as_u64()
        .context("`cryptblk dump --json` gave no data_offset")
}

/// An older binary must offer what the command line asks of it: `--unsealed-memory` (vu_bench's
/// memory is not sealed) and `--queue-size` (a default ring of 256 holds 85 requests, not 128).
fn check_old(old: &Path) -> Result<()> {
    let out = Command::new(old)
        .args(["serve", "--help"])
        .output()
        .with_context(|| format!("running {} serve --help", old.display()))?;
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--unsealed-memory", "--queue-size"] {
        if !help.contains(flag) {
            bail!(
                "--old {}: its `serve` has no {flag}, so vu_bench cannot be served as the others are (build an older binary that has it)",
                old.display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_encryptors_ceiling_runs_only_for_reads() {
        assert!(Spec::parse("randread:4096:32").unwrap().reads());
        assert!(!Spec::parse("randwrite:4096:32").unwrap().reads());
        let c = Config::load(None).unwrap();
        assert_eq!(
            c.preset("read-path").unwrap().peers,
            ["fluks", "fdec", "d", "a", "o"]
        );
    }
}
