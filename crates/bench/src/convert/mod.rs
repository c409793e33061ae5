//! `cryptblk-bench convert`: `cryptblk convert` against `qemu-img convert`; was
//! `scripts/bench-convert.sh`.
//!
//! - disk: raw -> LUKS with AES-256-XTS (512-bit key, plain64 IVs), cryptblk writing LUKS2 and
//!   qemu-img LUKS1 (QEMU cannot write LUKS2), both with a KDF that costs nothing; and the
//!   raw -> raw copy of both tools, the ceiling of a copy on this disk. Each run starts with
//!   the page cache dropped (as root; else the source's cached pages) and ends when the
//!   target's filesystem is written back (syncfs), because qemu-img leaves its target dirty.
//! - cipher: single-thread AES-256-XTS of 4 KiB sectors, `cryptblk bench` against `openssl
//!   speed` and the engine against the vendored OpenSSL's direct loop (`cipher.rs`).
//! - tmpfs: raw -> LUKS with source and target in a tmpfs, against `cp`: storage costs nothing
//!   there and what is left is each tool's own work (no write-back to wait for). With
//!   `--cryptblk-before` an older binary gets a row too.
//!
//! The jobs of a part run in rotating order in each of the rounds; one JSON line per run, with
//! its peak RSS from wait4 (`job.rs`); the tables show medians and per-round ratios.
mod cipher;
mod job;
mod summary;

use crate::procfs;
use crate::workdir::WorkDir;
use anyhow::{bail, Result};
use job::Job;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::SystemTime;

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

/// One run (disk, tmpfs) or one figure (cipher), one JSON line of the results file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConvertRecord {
    pub commit: String,
    pub machine: crate::record::Machine,
    /// disk, tmpfs or cipher.
    pub part: String,
    /// 1.. (0 for the cipher part, measured once).
    pub round: u32,
    /// The job (`cryptblk-luks`, `qemu-luks`, `cryptblk-raw`, `qemu-raw`, `cp`,
    /// `cryptblk-before-luks`) or the cipher figure (`cryptblk-bench`, `openssl-speed`,
    /// `openssl-direct`, `cryptblk-engine`).
    pub what: String,
    /// Seconds since the epoch when the run started.
    pub started: u64,
    pub load1: f64,
    /// Bytes copied.
    pub bytes: Option<u64>,
    /// Wall time of the run (disk: including the write-back of the target).
    pub seconds: Option<f64>,
    pub mib_s: Option<f64>,
    /// The job's peak resident set (wait4's ru_maxrss).
    pub peak_rss_kib: Option<u64>,
    /// Cipher part: single-thread AES-256-XTS of 4 KiB sectors, 10^9 bytes per second.
    pub gbps: Option<f64>,
    /// Cipher part: the engine `cryptblk bench` measured.
    pub engine: Option<String>,
}

const DISK_JOBS: [Job; 4] = [
    Job::CryptblkLuks,
    Job::QemuLuks,
    Job::CryptblkRaw,
    Job::QemuRaw,
];

pub fn run(o: &Options) -> Result<()> {
    if o.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
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
    let base = ConvertRecord {
        commit: procfs::commit(),
        machine: procfs::machine(),
        part: String::new(),
        round: 0,
        what: String::new(),
        started: 0,
        load1: 0.0,
        bytes: None,
        seconds: None,
        mib_s: None,
        peak_rss_kib: None,
        gbps: None,
        engine: None,
    };
    let mut records = Vec::new();
    if o.parts.contains(&Part::Disk) {
        let work = WorkDir::new(
            &o.dir,
            "cryptblk-bench-convert",
            2 * o.size + (256 << 20),
            "a source and a target image",
        )?;
        records.extend(copies(o, &base, Part::Disk, &work, o.size, &DISK_JOBS)?);
    }
    if o.parts.contains(&Part::Cipher) {
        records.extend(cipher_part(o, &base)?);
    }
    if o.parts.contains(&Part::Tmpfs) {
        let fs = procfs::fs_type(&o.tmpfs_dir)?;
        if fs != "tmpfs" {
            bail!(
                "--tmpfs-dir {} is on {fs}, not tmpfs",
                o.tmpfs_dir.display()
            );
        }
        let work = WorkDir::new(
            &o.tmpfs_dir,
            "cryptblk-bench-convert",
            2 * o.tmpfs_size + (64 << 20),
            "a source and a target file",
        )?;
        let mut jobs = vec![Job::Cp, Job::QemuLuks, Job::CryptblkLuks];
        if o.cryptblk_before.is_some() {
            jobs.push(Job::BeforeLuks);
        }
        records.extend(copies(o, &base, Part::Tmpfs, &work, o.tmpfs_size, &jobs)?);
    }
    print!("{}", summary::render(&records, o.rounds));
    Ok(())
}

/// The rounds of one part's copies of a `size`-byte random source in `work`.
fn copies(
    o: &Options,
    base: &ConvertRecord,
    part: Part,
    work: &WorkDir,
    size: u64,
    jobs: &[Job],
) -> Result<Vec<ConvertRecord>> {
    let src = work.join("src.raw");
    let key = work.join("key");
    crate::workdir::write_key(&key)?;
    eprintln!(
        "+ writing {size} bytes of incompressible data to {}",
        src.display()
    );
    crate::images::random_file(&src, size)?;
    let tools = job::Tools {
        cryptblk: &o.cryptblk,
        before: o.cryptblk_before.as_deref(),
        threads: o.threads,
        key: &key,
    };
    let out = job::target(work.path());
    let mut records = Vec::new();
    for round in 1..=o.rounds {
        eprintln!("{part:?} round {round} of {}", o.rounds);
        for k in 0..jobs.len() {
            let job = jobs[(k + round as usize - 1) % jobs.len()];
            let _ = std::fs::remove_file(&out);
            // On tmpfs there is nothing to drop and nothing to write back.
            let sync = (part == Part::Disk).then_some(work.path());
            if part == Part::Disk {
                procfs::drop_caches(&[&src])?;
            }
            let load1 = procfs::load1();
            let started = epoch_seconds();
            let mut cmd = job::command(job, &tools, &src, &out)?;
            let t = job::run(&mut cmd, sync, &work.join("stderr"))?;
            let _ = std::fs::remove_file(&out);
            let mib_s = size as f64 / (1 << 20) as f64 / t.seconds;
            eprintln!(
                "  {}: {:.2} s, {mib_s:.0} MiB/s, peak RSS {} KiB",
                job.name(),
                t.seconds,
                t.peak_rss_kib
            );
            let r = ConvertRecord {
                part: part_name(part).into(),
                round,
                what: job.name().into(),
                started,
                load1,
                bytes: Some(size),
                seconds: Some(t.seconds),
                mib_s: Some(mib_s),
                peak_rss_kib: Some(t.peak_rss_kib),
                ..base.clone()
            };
            crate::record::append(&o.results, &r)?;
            records.push(r);
        }
    }
    Ok(records)
}

fn cipher_part(o: &Options, base: &ConvertRecord) -> Result<Vec<ConvertRecord>> {
    let (load1, started) = (procfs::load1(), epoch_seconds());
    let f = cipher::measure(&o.cryptblk, o.threads)?;
    let mut records = Vec::new();
    for (what, gbps) in [
        ("cryptblk-bench", f.cryptblk_gbps),
        ("openssl-speed", f.openssl_speed_gbps),
        ("openssl-direct", f.direct_gbps),
        ("cryptblk-engine", f.engine_gbps),
    ] {
        let r = ConvertRecord {
            part: part_name(Part::Cipher).into(),
            what: what.into(),
            started,
            load1,
            gbps: Some(gbps),
            engine: (what == "cryptblk-bench").then(|| f.engine.clone()),
            ..base.clone()
        };
        crate::record::append(&o.results, &r)?;
        records.push(r);
    }
    Ok(records)
}

fn part_name(p: Part) -> &'static str {
    match p {
        Part::Disk => "disk",
        Part::Cipher => "cipher",
        Part::Tmpfs => "tmpfs",
    }
}

fn epoch_seconds() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
