//! The convert driver (`cryptblk-bench convert`, preset `convert`): `cryptblk convert` against
//! `qemu-img convert`; was `scripts/bench-convert.sh`.
//!
//! - disk: raw -> LUKS with AES-256-XTS (512-bit key, plain64 IVs), cryptblk writing LUKS2 and
//!   qemu-img LUKS1 (QEMU cannot write LUKS2), both with a KDF that costs nothing; and the
//!   raw -> raw copy of both tools, the ceiling of a copy on this disk. Each run starts with
//!   the page cache dropped (as root; else the source's cached pages) and ends when the
//!   target's filesystem is written back (syncfs), because qemu-img leaves its target dirty.
//! - cipher: single-thread AES-256-XTS of 4 KiB sectors, `cryptblk bench` against `openssl
//!   speed` and the engine against the vendored OpenSSL's direct loop (`cipher.rs`).
//! - tmpfs: raw -> LUKS with source and target in a tmpfs, against `cp`: storage costs nothing
//!   there and what is left is each tool's own work (no write-back to wait for); cp is the
//!   ceiling. With `--cryptblk-before` an older binary gets a row too.
//!
//! The jobs of a part run in rotating order in each of the rounds; one sample per run, with
//! its peak RSS from wait4 (`job.rs`).
mod cipher;
mod job;

use crate::config::Config;
use crate::engine::{self, Driver, Measured};
use crate::plan::{Fits, Step};
use crate::procfs;
use crate::sample::{Metrics, Sample};
use crate::workdir::WorkDir;
use anyhow::{bail, Context, Result};
use job::Job;
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Part {
    Disk,
    Cipher,
    Tmpfs,
}

/// `cryptblk-bench convert`'s command line.
#[derive(clap::Args)]
pub struct Args {
    /// Which parts: disk (convert on --dir), cipher (single-thread AES-XTS against
    /// openssl), tmpfs (convert in --tmpfs-dir against cp).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "disk,cipher,tmpfs"
    )]
    parts: Vec<Part>,
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// The disk part's image (256M, 4G, ...).
    #[arg(long, default_value = "4G")]
    size: String,
    /// The disk part's directory (a real filesystem).
    #[arg(long, default_value = "/tmp/cryptblk-bench")]
    dir: PathBuf,
    #[arg(long, default_value = "/dev/shm")]
    tmpfs_dir: PathBuf,
    /// The tmpfs part's file.
    #[arg(long, default_value = "2G")]
    tmpfs_size: String,
    /// `cryptblk --threads N` (default: one crypto thread per CPU).
    #[arg(long)]
    threads: Option<usize>,
    #[arg(long, default_value = "convert-results.jsonl")]
    results: PathBuf,
    /// The cryptblk binary (default: `cargo build --release`, then target/release).
    #[arg(long)]
    pub cryptblk: Option<PathBuf>,
    /// An older cryptblk binary whose convert gets a row in the tmpfs part (before/after).
    #[arg(long, value_name = "CRYPTBLK")]
    cryptblk_before: Option<PathBuf>,
}

impl Args {
    pub fn options(self, cryptblk: PathBuf) -> Result<Options> {
        Ok(Options {
            parts: self.parts,
            rounds: self.rounds,
            size: crate::config::parse_size(&self.size)?,
            dir: self.dir,
            tmpfs_dir: self.tmpfs_dir,
            tmpfs_size: crate::config::parse_size(&self.tmpfs_size)?,
            threads: self.threads,
            cryptblk,
            cryptblk_before: self.cryptblk_before,
            results: self.results,
        })
    }
}

pub struct Options {
    pub parts: Vec<Part>,
    pub rounds: u32,
    /// The disk part's image size.
    pub size: u64,
    /// The disk part's directory (a real filesystem).
    pub dir: PathBuf,
    pub tmpfs_dir: PathBuf,
    pub tmpfs_size: u64,
    /// `cryptblk --threads` (default: one per CPU).
    pub threads: Option<usize>,
    pub cryptblk: PathBuf,
    pub cryptblk_before: Option<PathBuf>,
    pub results: PathBuf,
}

/// The part being measured: its directory, source file and key.
struct Current {
    part: String,
    work: WorkDir,
    src: PathBuf,
    key: PathBuf,
    size: u64,
}

struct Convert<'a> {
    o: &'a Options,
    current: Option<Current>,
    /// The cipher part's engine (named by `cryptblk bench`) and the baseline's two figures of
    /// the round (one run of the example gives both).
    engine: String,
    baseline: Option<(u32, f64, f64)>,
}

pub fn run(o: &Options, config: &Config) -> Result<Vec<Sample>> {
    if o.parts.is_empty() {
        bail!("--parts names no part: give disk, cipher and/or tmpfs");
    }
    for (size, option) in [(o.size, "--size"), (o.tmpfs_size, "--tmpfs-size")] {
        if !size.is_multiple_of(4096) {
            bail!("{option} must be a multiple of 4096 bytes");
        }
    }
    if let Some(before) = &o.cryptblk_before {
        if !before.is_file() {
            bail!("--cryptblk-before {}: no such binary", before.display());
        }
    }
    let mut preset = config.preset("convert")?.clone();
    preset.workloads = o.parts.iter().map(|p| part_name(*p).to_string()).collect();
    let mut d = Convert {
        o,
        current: None,
        engine: String::new(),
        baseline: None,
    };
    engine::run("convert", &preset, o.rounds, &mut d, &o.results)
}

impl Convert<'_> {
    /// The part's directory with a `size`-byte random source in it, made at its first step.
    fn prepare(&mut self, part: &str) -> Result<&Current> {
        if self.current.as_ref().is_some_and(|c| c.part == part) {
            return Ok(self.current.as_ref().expect("just checked"));
        }
        self.current = None;
        let o = self.o;
        let (work, size) = if part == "disk" {
            let need = 2 * o.size + (256 << 20);
            (
                WorkDir::new(
                    &o.dir,
                    "cryptblk-bench-convert",
                    need,
                    "a source and a target image",
                )?,
                o.size,
            )
        } else {
            let fs = procfs::fs_type(&o.tmpfs_dir)?;
            if fs != "tmpfs" {
                bail!(
                    "--tmpfs-dir {} is on {fs}, not tmpfs",
                    o.tmpfs_dir.display()
                );
            }
            let need = 2 * o.tmpfs_size + (64 << 20);
            let work = WorkDir::new(
                &o.tmpfs_dir,
                "cryptblk-bench-convert",
                need,
                "a source and a target file",
            )?;
            (work, o.tmpfs_size)
        };
        let (src, key) = (work.join("src.raw"), work.join("key"));
        crate::workdir::write_key(&key)?;
        eprintln!(
            "+ writing {size} bytes of incompressible data to {}",
            src.display()
        );
        crate::images::random_file(&src, size)?;
        Ok(self.current.insert(Current {
            part: part.into(),
            work,
            src,
            key,
            size,
        }))
    }

    fn cipher(&mut self, step: &Step) -> Result<Measured> {
        let gbps = match step.peer.as_str() {
            "cryptblk-bench" => {
                let (engine, gbps) = cipher::cryptblk_bench(&self.o.cryptblk, self.o.threads)?;
                self.engine = engine;
                gbps
            }
            "openssl-speed" => cipher::openssl_speed()?,
            arm => {
                if self.baseline.is_none_or(|(round, ..)| round != step.round) {
                    let (direct, engine) = cipher::baseline()?;
                    self.baseline = Some((step.round, direct, engine));
                }
                let (_, direct, engine) = self.baseline.expect("just set");
                if arm == "openssl-direct" {
                    direct
                } else {
                    engine
                }
            }
        };
        Ok(Measured {
            window_s: 0.0,
            metrics: Metrics::default().with("gbps", Some(gbps)),
        })
    }
}

impl Fits for Convert<'_> {
    fn transports(&self, _: &str) -> Vec<String> {
        vec!["local".into()]
    }

    fn fits(&self, peer: &str, _: &str, part: &str) -> bool {
        match (part, Job::named(peer)) {
            ("cipher", job) => job.is_none(),
            ("disk", Some(job)) => matches!(
                job,
                Job::CryptblkLuks | Job::QemuLuks | Job::CryptblkRaw | Job::QemuRaw
            ),
            (_, Some(Job::BeforeLuks)) => self.o.cryptblk_before.is_some(),
            (_, Some(job)) => matches!(job, Job::CryptblkLuks | Job::QemuLuks),
            (_, None) => false,
        }
    }

    fn has_ceiling(&self, part: &str) -> bool {
        part == "tmpfs"
    }
}

impl Driver for Convert<'_> {
    fn storage(&self) -> String {
        format!(
            "disk part in {} ({} MiB), tmpfs part in {} ({} MiB)",
            self.o.dir.display(),
            self.o.size >> 20,
            self.o.tmpfs_dir.display(),
            self.o.tmpfs_size >> 20
        )
    }

    fn peer_name(&self, peer: &str) -> String {
        match (Job::named(peer), peer) {
            (Some(job), _) => job.label().into(),
            (None, "cryptblk-bench") => format!("cryptblk bench (engine {})", self.engine),
            (None, "openssl-speed") => {
                "system OpenSSL: openssl speed -evp aes-256-xts -bytes 4096".into()
            }
            (None, "openssl-direct") => {
                "vendored OpenSSL, direct loop (examples/openssl_baseline)".into()
            }
            _ => "cryptblk engine in the same run (examples/openssl_baseline)".into(),
        }
    }

    fn measure(&mut self, step: &Step) -> Result<Measured> {
        if step.workload == "cipher" {
            return self.cipher(step);
        }
        let o = self.o;
        let job = Job::named(&step.peer).context("not a convert job")?;
        let c = self.prepare(&step.workload)?;
        let disk = c.part == "disk";
        let tools = job::Tools {
            cryptblk: &o.cryptblk,
            before: o.cryptblk_before.as_deref(),
            threads: o.threads,
            key: &c.key,
        };
        let out = job::target(c.work.path());
        let _ = std::fs::remove_file(&out);
        // On tmpfs there is nothing to drop and nothing to write back.
        let sync = disk.then_some(c.work.path());
        if disk {
            procfs::drop_caches(&[&c.src])?;
        }
        let mut cmd = job::command(job, &tools, &c.src, &out)?;
        let t = job::run(&mut cmd, sync, &c.work.join("stderr"))?;
        let _ = std::fs::remove_file(&out);
        Ok(Measured {
            window_s: t.seconds,
            metrics: Metrics::default()
                .with("seconds", Some(t.seconds))
                .with("mib_s", Some(c.size as f64 / (1 << 20) as f64 / t.seconds))
                .with("peak_rss_kib", Some(t.peak_rss_kib as f64)),
        })
    }
}

fn part_name(p: Part) -> &'static str {
    match p {
        Part::Disk => "disk",
        Part::Cipher => "cipher",
        Part::Tmpfs => "tmpfs",
    }
}
