//! The migration driver (`cryptblk-bench migrate`, preset `migrate`): on-demand read latency on a migration destination during
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
use crate::config::{self, Config};
use crate::engine::{self, Driver, Measured};
use crate::plan::{Fits, Step};
use crate::procfs;
use crate::sample::{Metrics, Sample};
use crate::workdir::free_bytes;
use anyhow::{bail, Context, Result};
use example::{build_example, child};
use serde::Serialize;
use std::path::{Path, PathBuf};

mod example;
mod result;

pub use result::{Latency, Precopy};

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

pub fn run(a: &Args, config: &Config) -> Result<Vec<Sample>> {
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
    let mut preset = config.preset("migrate")?.clone();
    preset.workloads = chunks.iter().map(|c| chunk_name(*c)).collect();
    preset.peers = a.modes.iter().map(|m| m.letter().to_string()).collect();
    if !a.skip_big {
        preset.workloads.push("precopy".into());
        preset.peers.push("precopy".into());
    }
    let mut d = Migrate {
        a,
        example: &example,
        work: &work,
        source: work.join("src.raw"),
        size,
        big_size,
        big_bandwidth,
    };
    let outcome = child(
        &example,
        "source",
        &[
            "--source".into(),
            d.source.display().to_string(),
            "--size".into(),
            size.to_string(),
        ],
    )
    .and_then(|_| engine::run("migrate", &preset, a.rounds, &mut d, &a.results));
    let _ = std::fs::remove_dir_all(&work);
    outcome
}

/// A chunk size as its workload is named: `64K`, `2M`.
fn chunk_name(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{}M", bytes >> 20)
    } else {
        format!("{}K", bytes >> 10)
    }
}

struct Migrate<'a> {
    a: &'a Args,
    example: &'a Path,
    work: &'a Path,
    source: PathBuf,
    size: u64,
    big_size: u64,
    big_bandwidth: Option<u64>,
}

impl Fits for Migrate<'_> {
    fn transports(&self, _: &str) -> Vec<String> {
        vec!["tcp".into()]
    }
    fn fits(&self, peer: &str, _: &str, workload: &str) -> bool {
        (peer == "precopy") == (workload == "precopy")
    }
    fn has_ceiling(&self, _: &str) -> bool {
        false
    }
}

impl Driver for Migrate<'_> {
    fn storage(&self) -> String {
        format!(
            "{} MiB raw disk, link 1 Gbit/s ({}), {:.0} s of reads every {:.0} ms; precopy of {} MiB at {}",
            self.size >> 20,
            match self.a.link {
                Link::Pacer => "the sender's pacer",
                Link::Proxy => "shaping proxy, fair queueing",
            },
            self.a.duration,
            self.a.interval,
            self.big_size >> 20,
            self.big_bandwidth
                .map_or("loopback".into(), |b| format!("{b} bytes/s"))
        )
    }

    fn peer_name(&self, peer: &str) -> String {
        match peer {
            "a" => Mode::A.describe().into(),
            "b" => Mode::B.describe().into(),
            "c" => Mode::C.describe().into(),
            _ => "precopy, a 4 KiB random write per ms until switchover".into(),
        }
    }

    fn measure(&mut self, step: &Step) -> Result<Measured> {
        let path = |p: &Path| p.display().to_string();
        let figures = if step.peer == "precopy" {
            let out = child(
                self.example,
                "big",
                &[
                    "--big-size".into(),
                    self.big_size.to_string(),
                    "--big-max-bandwidth".into(),
                    self.big_bandwidth.map_or("none".into(), |b| b.to_string()),
                    "--workdir".into(),
                    path(self.work),
                ],
            )?;
            serde_json::to_value(Precopy::parse(&out)?)?
        } else {
            let chunk = config::parse_size(&step.workload)?;
            let link = match self.a.link {
                Link::Pacer => "pacer",
                Link::Proxy => "proxy",
            };
            let out = child(
                self.example,
                "latency",
                &[
                    "--chunk".into(),
                    chunk.to_string(),
                    "--mode".into(),
                    step.peer.clone(),
                    "--source".into(),
                    path(&self.source),
                    "--workdir".into(),
                    path(self.work),
                    "--duration-secs".into(),
                    self.a.duration.to_string(),
                    "--interval-ms".into(),
                    self.a.interval.to_string(),
                    "--link".into(),
                    link.into(),
                ],
            )?;
            serde_json::to_value(Latency::parse(&out)?)?
        };
        let metrics: Metrics = serde_json::from_value(figures)?;
        Ok(Measured {
            window_s: metrics
                .get("measured_s")
                .or(metrics.get("total_s"))
                .unwrap_or(0.0),
            metrics,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::result::tests::{LATENCY_OUT, PRECOPY_OUT};
    use super::*;

    #[test]
    fn a_childs_result_line_becomes_the_samples_metrics() {
        let l: Metrics = serde_json::from_value(
            serde_json::to_value(Latency::parse(LATENCY_OUT).unwrap()).unwrap(),
        )
        .unwrap();
        assert_eq!(l.get("avg_us"), Some(266.4));
        assert_eq!(l.get("count"), Some(97.0));
        let nan = PRECOPY_OUT.replace("downtime_ms=265.31", "downtime_ms=NaN");
        let p: Metrics =
            serde_json::from_value(serde_json::to_value(Precopy::parse(&nan).unwrap()).unwrap())
                .unwrap();
        assert_eq!(p.get("downtime_ms"), None);
        assert_eq!(p.get("passes"), Some(2.0));
        assert_eq!(
            [64 << 10, 2 << 20, 64 << 20].map(chunk_name),
            ["64K", "2M", "64M"]
        );
        assert_eq!(config::parse_size("64K").unwrap(), 64 << 10);
    }
}
