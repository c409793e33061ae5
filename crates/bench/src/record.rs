//! One JSON record per measurement, appended as a line to the results file (JSON lines), so
//! that every figure can be re-rendered, compared with an older run or checked by a program.
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

/// What one run measured, over its window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measurement {
    pub window_s: f64,
    pub iops: Option<f64>,
    pub mib_s: Option<f64>,
    pub lat_mean_us: Option<f64>,
    pub lat_p50_us: Option<f64>,
    pub lat_p99_us: Option<f64>,
    pub lat_p999_us: Option<f64>,
    pub server_cpu_pct: Option<f64>,
    pub client_cpu_pct: Option<f64>,
    /// The server's VmRSS / VmHWM after an idle run, in KiB.
    pub server_rss_kib: Option<u64>,
    pub server_hwm_kib: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    pub nproc: u32,
    pub cpu_model: String,
    pub kernel: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkloadRecord {
    pub name: String,
    pub rw: String,
    pub bs: u64,
    pub depth: u32,
    pub queues: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// `git rev-parse HEAD` of the tree measured (with `-dirty` if it had changes).
    pub commit: String,
    pub machine: Machine,
    pub preset: String,
    /// Where the images were: `ext4 /var/tmp, 8 GiB, cache none`.
    pub storage: String,
    pub round: u32,
    /// The runs that share the ceiling measured around them (see `plan::Step::group`).
    pub group: String,
    pub peer: String,
    pub peer_name: String,
    /// `file` for the ceiling (fio on the image), else `vhost` or `nbd`.
    pub transport: String,
    pub ceiling: bool,
    pub workload: WorkloadRecord,
    /// Seconds since the epoch when the measurement started.
    pub started: u64,
    /// The 1-minute load average just before the run (`/proc/loadavg`).
    pub load1: f64,
    /// Length of the measured window, in seconds.
    pub window_s: f64,
    pub iops: Option<f64>,
    pub mib_s: Option<f64>,
    pub lat_mean_us: Option<f64>,
    pub lat_p50_us: Option<f64>,
    pub lat_p99_us: Option<f64>,
    pub lat_p999_us: Option<f64>,
    /// The server's utime + stime over the window as a share of it (100 = one core).
    pub server_cpu_pct: Option<f64>,
    pub client_cpu_pct: Option<f64>,
    /// Server CPU per request in µs: CPU% x 10^4 / IOPS.
    pub server_cpu_us_per_io: Option<f64>,
    /// The server's VmRSS / VmHWM after the run (idle runs).
    pub server_rss_kib: Option<u64>,
    pub server_hwm_kib: Option<u64>,
}

impl Record {
    /// What measurement `m` (started at `started`, load average `load1`) gives a record; the
    /// caller names the run (commit, peer, workload, ...) with struct update syntax.
    pub fn measured(started: u64, load1: f64, m: &Measurement) -> Record {
        Record {
            started,
            load1,
            window_s: m.window_s,
            iops: m.iops,
            mib_s: m.mib_s,
            lat_mean_us: m.lat_mean_us,
            lat_p50_us: m.lat_p50_us,
            lat_p99_us: m.lat_p99_us,
            lat_p999_us: m.lat_p999_us,
            server_cpu_pct: m.server_cpu_pct,
            client_cpu_pct: m.client_cpu_pct,
            server_cpu_us_per_io: cpu_us_per_io(m.server_cpu_pct, m.iops),
            server_rss_kib: m.server_rss_kib,
            server_hwm_kib: m.server_hwm_kib,
            ..Record::default()
        }
    }
}

/// µs of CPU per request: `cpu_pct` percent of a core over a second is `cpu_pct * 10^4` µs,
/// spread over `iops` requests.
pub fn cpu_us_per_io(cpu_pct: Option<f64>, iops: Option<f64>) -> Option<f64> {
    match (cpu_pct, iops) {
        (Some(c), Some(i)) if i > 0.0 => Some(c * 1e4 / i),
        _ => None,
    }
}

/// Appends one record (of any of the harness's kinds) as one line and flushes it, so an
/// interrupted run keeps what it measured.
pub fn append(path: &Path, record: &impl Serialize) -> Result<()> {
    let mut line = serde_json::to_string(record)?;
    line.push('\n');
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    f.write_all(line.as_bytes())
        .with_context(|| format!("appending to {}", path.display()))
}

/// Every record of a results file; a line that is not a record is an error naming its number.
pub fn load(path: &Path) -> Result<Vec<Record>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text).with_context(|| format!("in {}", path.display()))
}

pub fn parse(text: &str) -> Result<Vec<Record>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("line {} is not a record", i + 1))
        })
        .collect()
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A record with the given identity and IOPS (the rest plausible).
    pub fn sample(group: &str, peer: &str, transport: &str, iops: f64) -> Record {
        let round = group[1..].split('/').next().unwrap().parse().unwrap();
        Record {
            commit: "0123abc".into(),
            machine: Machine {
                nproc: 2,
                cpu_model: "Test CPU".into(),
                kernel: "6.1.0".into(),
            },
            preset: "demo".into(),
            storage: "tmpfs /dev/shm, 256 MiB, cache default".into(),
            round,
            group: group.into(),
            peer: peer.into(),
            peer_name: format!("peer {peer}"),
            transport: transport.into(),
            ceiling: transport == "file",
            workload: WorkloadRecord {
                name: group.rsplit('/').next().unwrap().into(),
                rw: "randread".into(),
                bs: 4096,
                depth: 32,
                queues: 1,
            },
            started: 1_700_000_000,
            load1: 0.5,
            window_s: 2.0,
            iops: Some(iops),
            mib_s: Some(iops * 4096.0 / 1048576.0),
            lat_mean_us: Some(100.0),
            lat_p50_us: Some(90.0),
            lat_p99_us: Some(300.0),
            lat_p999_us: Some(900.0),
            server_cpu_pct: (transport != "file").then_some(50.0),
            client_cpu_pct: Some(40.0),
            server_cpu_us_per_io: cpu_us_per_io((transport != "file").then_some(50.0), Some(iops)),
            server_rss_kib: None,
            server_hwm_kib: None,
        }
    }

    #[test]
    fn records_round_trip_through_the_results_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("results.jsonl");
        let a = sample("r1/vhost/rr", "a", "vhost", 20000.0);
        let mut f = sample("r1/vhost/rr", "f", "file", 40000.0);
        f.lat_p999_us = None;
        append(&path, &a).unwrap();
        append(&path, &f).unwrap();
        assert_eq!(load(&path).unwrap(), vec![a, f]);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2);
        assert!(text.contains("\"server_cpu_us_per_io\":25.0"), "{text}");
    }

    #[test]
    fn a_broken_line_is_named() {
        let good = serde_json::to_string(&sample("r1/nbd/w", "a", "nbd", 1.0)).unwrap();
        let err = parse(&format!("{good}\n{{\"iops\": 3}}\n")).unwrap_err();
        assert!(format!("{err:#}").contains("line 2"), "{err:#}");
    }

    #[test]
    fn cpu_per_io_is_cpu_percent_times_ten_thousand_over_iops() {
        // Half a core at 25,000 IOPS: 0.5 s of CPU per second / 25,000 = 20 µs.
        assert_eq!(cpu_us_per_io(Some(50.0), Some(25_000.0)), Some(20.0));
        assert_eq!(cpu_us_per_io(Some(50.0), Some(0.0)), None);
        assert_eq!(cpu_us_per_io(None, Some(1.0)), None);
    }
}
