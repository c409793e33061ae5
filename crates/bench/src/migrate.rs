//! `cryptblk-bench migrate`: on-demand read latency on a migration destination during
//! postcopy, and the total time and downtime of a precopy migration of a bigger disk.
//!
//! Each measurement is one child process of crates/migration/examples/postcopy_latency
//! (source and destination in it, loopback TCP, raw images): the example runs its own
//! configurations the same way, so that the migration threads left running when a postcopy
//! measurement stops die with the child.
//!
//! Latency: a `--size` raw disk migrates over a 1 Gbit/s link (the sender's pacer, or with
//! `--link proxy` a shaping proxy with fair queueing between the two connections), switches to
//! postcopy at once, and a reader on the destination reads random 4 KiB blocks one at a time
//! (every `--interval` ms, for `--duration` s) while the bulk stream runs; only reads that had
//! to wait for their block count. Per bulk chunk size and mode: (a) postcopy without preempt,
//! (b) preempt without breaking chunks, (c) full preempt (urgent answers between the 16 KiB
//! slices of a chunk). Targets: (c)'s average at least 10x lower than (a)'s, (c)'s p99 under
//! 2 ms.
//!
//! Precopy: a `--big-size` disk with one random 4 KiB write per ms on the source until the
//! first sweep is done and < 8 MiB is dirty, then the switchover: total time, downtime (fence
//! to destination complete), bytes sent, passes.
use crate::{config, procfs, record};
use anyhow::{bail, Context, Result};
use example::{build_example, child, free_bytes};
use serde::Serialize;
use std::path::{Path, PathBuf};

mod example;
mod result;
mod summary;

pub use result::{Latency, Precopy};

/// The postcopy link: 1 Gbit/s.
const LINK_BYTES_PER_S: u64 = 125_000_000;
/// The precopy run's bulk chunks (fixed in the example).
const PRECOPY_CHUNK: u64 = 2 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Postcopy without preempt: urgent answers behind the bulk chunk being sent.
    A,
    /// Preempt, chunks not broken: own channel, but after the whole chunk.
    B,
    /// Full preempt: own channel, between two 16 KiB slices of the chunk.
    C,
}

impl Mode {
    pub fn letter(self) -> &'static str {
        match self {
            Mode::A => "a",
            Mode::B => "b",
            Mode::C => "c",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Mode::A => "postcopy, no preempt",
            Mode::B => "preempt, no chunk break",
            Mode::C => "preempt + chunk break",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Link {
    /// The sender's own pacer (`SourceOptions.max_bandwidth`, one link for both channels).
    Pacer,
    /// A shaping proxy between the two sides (fair queueing; socket buffers fill).
    Proxy,
}

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value_t = 1)]
    pub rounds: u32,
    /// The postcopy disk (a multiple of 4 KiB).
    #[arg(long, default_value = "2G")]
    pub size: String,
    /// Seconds of reads per postcopy configuration.
    #[arg(long, default_value_t = 8.0)]
    pub duration: f64,
    /// Milliseconds between two reads.
    #[arg(long, default_value_t = 5.0)]
    pub interval: f64,
    /// Bulk chunk sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64K,2M,64M")]
    pub chunks: Vec<String>,
    /// Modes, comma-separated: a (no preempt), b (preempt, no chunk break), c (full preempt).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "a,b,c")]
    pub modes: Vec<Mode>,
    #[arg(long, value_enum, default_value = "pacer")]
    pub link: Link,
    /// The precopy disk.
    #[arg(long, default_value = "4G")]
    pub big_size: String,
    /// The precopy link in bytes/s, or `none` for uncapped loopback.
    #[arg(long, default_value = "125000000")]
    pub big_bandwidth: String,
    /// No precopy run.
    #[arg(long)]
    pub skip_big: bool,
    /// Where the images go (default: the temp directory). Not tmpfs: lseek(SEEK_HOLE) there
    /// scans every page up to the next hole, once per bulk chunk, and throttles the sender.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    #[arg(long, default_value = "migrate-results.jsonl")]
    pub results: PathBuf,
    /// A prebuilt postcopy_latency example (default: `cargo build --release`).
    #[arg(long)]
    pub postcopy_latency: Option<PathBuf>,
}

/// One JSON line of the results file.
#[derive(Serialize)]
struct Line<'a, R: Serialize> {
    commit: &'a str,
    machine: &'a record::Machine,
    /// `latency` or `precopy_total`.
    kind: &'static str,
    round: u32,
    disk_size: u64,
    chunk_size: u64,
    /// Postcopy: latency's mode and what it turns on.
    #[serde(skip_serializing_if = "Option::is_none")]
    mode: Option<Mode>,
    #[serde(skip_serializing_if = "Option::is_none")]
    preempt: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    break_chunks: Option<bool>,
    /// Postcopy: pacer or proxy; precopy: always the pacer.
    link: Link,
    /// Bytes/s of the link (None: uncapped).
    max_bandwidth: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    duration_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    interval_ms: Option<f64>,
    #[serde(flatten)]
    result: &'a R,
}

/// What the summary needs of each run.
pub struct Runs {
    pub latency: Vec<(u32, u64, Mode, Latency)>,
    pub precopy: Vec<(u32, Precopy)>,
}

pub fn run(a: &Args) -> Result<()> {
    let size = config::parse_size(&a.size)?;
    let big_size = config::parse_size(&a.big_size)?;
    let mut chunks = Vec::new();
    for c in &a.chunks {
        let bytes = config::parse_size(c)?;
        if !bytes.is_multiple_of(4096) {
            bail!("--chunks {c}: a chunk is a multiple of 4 KiB");
        }
        chunks.push(bytes);
    }
    let big_bandwidth = match a.big_bandwidth.as_str() {
        "none" => None,
        b => Some(b.parse::<u64>().ok().filter(|b| *b > 0).with_context(|| {
            format!("--big-bandwidth {b}: give bytes per second, or none for uncapped")
        })?),
    };
    if !size.is_multiple_of(4096) || !big_size.is_multiple_of(4096) {
        bail!("--size and --big-size must be multiples of 4 KiB");
    }
    if a.rounds == 0 || a.duration <= 0.0 || a.interval <= 0.0 {
        bail!("--rounds, --duration and --interval must be positive");
    }
    let base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let need = size + size.max(if a.skip_big { 0 } else { 2 * big_size }) + (256 << 20);
    let free = free_bytes(&base)?;
    if free < need {
        bail!(
            "{} has {} MiB free; the run needs {} MiB (--size, twice --big-size): give --dir elsewhere or smaller sizes",
            base.display(),
            free >> 20,
            need >> 20
        );
    }
    if procfs::fs_type(&base)? == "tmpfs" {
        eprintln!(
            "warning: {} is tmpfs; its slow SEEK_HOLE throttles the sender (give --dir on a disk)",
            base.display()
        );
    }
    let example = match &a.postcopy_latency {
        Some(p) => p.clone(),
        None => build_example()?,
    };
    if !example.is_file() {
        bail!("{} not found (--postcopy-latency)", example.display());
    }
    let work = base.join(format!("cryptblk-bench-migrate.{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let outcome = measure_all(a, &example, &work, size, big_size, &chunks, big_bandwidth);
    let _ = std::fs::remove_dir_all(&work);
    let runs = outcome?;
    print!(
        "{}",
        summary::markdown(
            &runs,
            &summary::Setting {
                size,
                big_size,
                big_bandwidth,
                link: a.link,
                duration: a.duration,
                interval: a.interval,
                chunks: &chunks,
                modes: &a.modes,
            }
        )
    );
    Ok(())
}

fn measure_all(
    a: &Args,
    example: &Path,
    work: &Path,
    size: u64,
    big_size: u64,
    chunks: &[u64],
    big_bandwidth: Option<u64>,
) -> Result<Runs> {
    let source = work.join("src.raw");
    let path = |p: &Path| p.display().to_string();
    child(
        example,
        "source",
        &[
            "--source".into(),
            path(&source),
            "--size".into(),
            size.to_string(),
        ],
    )?;
    let (commit, machine) = (procfs::commit(), procfs::machine());
    let mut runs = Runs {
        latency: Vec::new(),
        precopy: Vec::new(),
    };
    let link = match a.link {
        Link::Pacer => "pacer",
        Link::Proxy => "proxy",
    };
    for round in 1..=a.rounds {
        for &chunk in chunks {
            for &mode in &a.modes {
                eprintln!(
                    "round {round}: chunk {} KiB, ({}) {} ...",
                    chunk >> 10,
                    mode.letter(),
                    mode.describe()
                );
                let out = child(
                    example,
                    "latency",
                    &[
                        "--chunk".into(),
                        chunk.to_string(),
                        "--mode".into(),
                        mode.letter().into(),
                        "--source".into(),
                        path(&source),
                        "--workdir".into(),
                        path(work),
                        "--duration-secs".into(),
                        a.duration.to_string(),
                        "--interval-ms".into(),
                        a.interval.to_string(),
                        "--link".into(),
                        link.into(),
                    ],
                )?;
                let l = Latency::parse(&out)?;
                eprintln!(
                    "  {} waiting reads: avg {} p99 {} ({} blocks still missing at the end)",
                    l.count,
                    summary::fmt_us(l.avg_us),
                    summary::fmt_us(l.p99_us),
                    l.missing_end
                );
                record::append(
                    &a.results,
                    &Line {
                        commit: &commit,
                        machine: &machine,
                        kind: "latency",
                        round,
                        disk_size: size,
                        chunk_size: chunk,
                        mode: Some(mode),
                        preempt: Some(mode != Mode::A),
                        break_chunks: Some(mode == Mode::C),
                        link: a.link,
                        max_bandwidth: Some(LINK_BYTES_PER_S),
                        duration_s: Some(a.duration),
                        interval_ms: Some(a.interval),
                        result: &l,
                    },
                )?;
                runs.latency.push((round, chunk, mode, l));
            }
        }
        if a.skip_big {
            continue;
        }
        eprintln!("round {round}: precopy of {} MiB ...", big_size >> 20);
        let out = child(
            example,
            "big",
            &[
                "--big-size".into(),
                big_size.to_string(),
                "--big-max-bandwidth".into(),
                big_bandwidth.map_or("none".into(), |b| b.to_string()),
                "--workdir".into(),
                path(work),
            ],
        )?;
        let p = Precopy::parse(&out)?;
        record::append(
            &a.results,
            &Line {
                commit: &commit,
                machine: &machine,
                kind: "precopy_total",
                round,
                disk_size: big_size,
                chunk_size: PRECOPY_CHUNK,
                mode: None,
                preempt: None,
                break_chunks: None,
                link: Link::Pacer,
                max_bandwidth: big_bandwidth,
                duration_s: None,
                interval_ms: None,
                result: &p,
            },
        )?;
        runs.precopy.push((round, p));
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::result::tests::LATENCY_OUT;

    #[test]
    fn a_record_line_carries_the_configuration_and_the_figures() {
        let l = Latency::parse(LATENCY_OUT).unwrap();
        let line = Line {
            commit: "c",
            machine: &procfs::machine(),
            kind: "latency",
            round: 2,
            disk_size: 1 << 30,
            chunk_size: 65536,
            mode: Some(Mode::C),
            preempt: Some(true),
            break_chunks: Some(true),
            link: Link::Proxy,
            max_bandwidth: Some(LINK_BYTES_PER_S),
            duration_s: Some(8.0),
            interval_ms: Some(5.0),
            result: &l,
        };
        let v: serde_json::Value = serde_json::to_value(&line).unwrap();
        assert_eq!(v["mode"], "c");
        assert_eq!(v["link"], "proxy");
        assert_eq!(v["avg_us"], 266.4);
        assert_eq!(v["round"], 2);
    }
}
