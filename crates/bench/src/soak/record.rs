//! The soak's results file: one JSON object per line, tagged by `record`. Kept apart from the
//! matrix's `Record` on purpose (a soak has no peers or rounds); small enough to fold into a
//! shared engine later.
//!
//! - `start`: the run's settings, machine, commit and the daemon's command line.
//! - `sample`: once a second, the serving daemon's memory, threads and descriptors, and the
//!   clients' cumulative counts.
//! - `idle`: the same figures with no client connected and only the configured disks attached,
//!   at the start and at the end (`when`), with what the descriptors point at and the
//!   threads' names.
//! - `event`: an upgrade, a kill and restart, or a disk churn; how long it took and its pause
//!   (from the event until every client had completed a request started after it).
//! - `failure`: a verify error, a request that failed or stalled.
//! - `summary`: what [`super::summary`] made of the rest ([`Summary`]).
use crate::sample::Machine;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "kebab-case")]
pub enum SoakRecord {
    Start {
        commit: String,
        machine: Machine,
        disks: usize,
        pool: usize,
        clients: usize,
        minutes: f64,
        memory_budget: String,
        seed: u64,
        command: String,
    },
    Sample(Sample),
    Idle {
        when: String,
        sample: Sample,
        /// Descriptors by what they point at, threads by name.
        #[serde(default)]
        descriptors: BTreeMap<String, u32>,
        #[serde(default)]
        threads: BTreeMap<String, u32>,
    },
    Event(Event),
    Failure {
        t_s: f64,
        kind: String,
        detail: String,
    },
    Summary(Box<Summary>),
}

/// The daemon serving at `t_s` (seconds from the start of the clients), as /proc shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub t_s: f64,
    pub pid: u32,
    /// VmRSS and RssAnon (the private part: what a leak would grow), KiB.
    pub rss_kib: u64,
    pub anon_kib: u64,
    pub threads: u32,
    pub fds: u32,
    /// Requests the clients completed, and errors, since the start.
    pub ops: u64,
    pub verify_errors: u64,
    pub client_errors: u64,
    /// Clients connected to a disk now.
    pub connected: u32,
    pub load1: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub t_s: f64,
    /// `upgrade`, `kill` (kill -9 and the same command line again) or `churn`.
    pub kind: String,
    pub detail: String,
    /// From the request to the daemon being ready again (upgrade, kill) or the last control
    /// call answered (churn), ms.
    pub took_ms: f64,
    /// From the event until every client completed a request started after it, ms; `None`
    /// if some did not within the bound.
    pub pause_ms: Option<f64>,
}

/// How much growth a run may show and still pass.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tolerances {
    /// Of VmRSS and RssAnon, over the run after the warm-up, MiB per hour.
    pub rss_slope_mib_h: f64,
    /// Idle RssAnon at the end over the start, MiB.
    pub idle_anon_growth_mib: f64,
    /// Idle threads and descriptors at the end over the start.
    pub idle_thread_growth: i64,
    pub idle_fd_growth: i64,
}

/// Threads and descriptors between two events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    pub from_s: f64,
    pub to_s: f64,
    /// The event that began it (`start` for the first).
    pub after: String,
    pub threads: (u32, u32),
    pub fds: (u32, u32),
    pub anon_mib: (f64, f64),
}

/// The pauses of one kind of event, ms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pauses {
    pub count: usize,
    pub median_ms: Option<f64>,
    pub worst_ms: Option<f64>,
    /// Events after which some client did not work again within the bound.
    pub unrecovered: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub seconds: f64,
    pub ops: u64,
    pub verify_errors: u64,
    pub client_errors: u64,
    pub warmup_s: f64,
    pub rss_slope_mib_h: Option<f64>,
    pub anon_slope_mib_h: Option<f64>,
    /// The steepest RssAnon slope within one daemon process that lived at least
    /// [`PROCESS_SPAN_S`] (its first [`PROCESS_SETTLE_S`] left out), MiB per hour.
    pub worst_process_anon_slope_mib_h: Option<f64>,
    pub idle_start: Option<Sample>,
    pub idle_end: Option<Sample>,
    pub phases: Vec<Phase>,
    pub pauses: BTreeMap<String, Pauses>,
    pub tolerances: Tolerances,
    /// Each tolerance broken, in words; empty: the run passed.
    pub failed: Vec<String>,
}

pub const PROCESS_SPAN_S: f64 = 120.0;
pub const PROCESS_SETTLE_S: f64 = 20.0;

/// Appends records to the results file as they come, and keeps them for the summary.
pub struct Recorder {
    file: Mutex<(std::fs::File, Vec<SoakRecord>)>,
}

impl Recorder {
    pub fn create(path: &Path) -> Result<Recorder> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Recorder {
            file: Mutex::new((file, Vec::new())),
        })
    }

    pub fn push(&self, record: SoakRecord) -> Result<()> {
        let mut guard = self.file.lock().unwrap();
        let line = serde_json::to_string(&record)?;
        writeln!(guard.0, "{line}").context("writing the results file")?;
        guard.1.push(record);
        Ok(())
    }

    pub fn records(&self) -> Vec<SoakRecord> {
        self.file.lock().unwrap().1.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_keep_their_tag_and_read_back() {
        let r = SoakRecord::Event(Event {
            t_s: 1.5,
            kind: "kill".into(),
            detail: "pid 1 -> 2".into(),
            took_ms: 80.0,
            pause_ms: None,
        });
        let line = serde_json::to_string(&r).unwrap();
        assert!(line.starts_with(r#"{"record":"event","#), "{line}");
        assert_eq!(serde_json::from_str::<SoakRecord>(&line).unwrap(), r);
    }
}
