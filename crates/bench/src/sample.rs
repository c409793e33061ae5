//! The one sample type: every measurement of every experiment is a `Sample`, appended as one
//! JSON line to a results file, so that every figure can be rendered again, compared with an
//! older run or checked by a program. Its fields are those of the records the harness has
//! always written (`preset`, `peer`, ... and the metrics flat beside them), so older reports
//! read new files and `load` reads every older file, including the reencryption records of
//! before the engine (`legacy`).
use anyhow::{Context, Result};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

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

/// Named figures of one measurement (`iops`, `lat_p99_us`, `seconds`, ...; see
/// `metric::info`). A figure not taken is absent, not zero.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics(pub BTreeMap<String, f64>);

impl Metrics {
    pub fn get(&self, name: &str) -> Option<f64> {
        self.0.get(name).copied()
    }

    /// Sets `name` when `value` is a finite number.
    pub fn set(&mut self, name: &str, value: Option<f64>) -> &mut Metrics {
        if let Some(v) = value.filter(|v| v.is_finite()) {
            self.0.insert(name.to_string(), v);
        }
        self
    }

    pub fn with(mut self, name: &str, value: Option<f64>) -> Metrics {
        self.set(name, value);
        self
    }
}

/// Whole numbers are written as integers: the record's counters (`server_rss_kib`) were
/// integers, and older readers take them as such.
impl Serialize for Metrics {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, &v)| {
            let n = if v.fract() == 0.0 && v.abs() < 9e15 {
                serde_json::Number::from(v as i64)
            } else {
                serde_json::Number::from_f64(v).unwrap_or_else(|| 0.into())
            };
            (k, n)
        }))
    }
}

/// Numbers are figures; null (a figure an older harness did not take) and anything else is
/// left out.
impl<'de> Deserialize<'de> for Metrics {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Metrics, D::Error> {
        let all = BTreeMap::<String, serde_json::Value>::deserialize(d)?;
        Ok(Metrics(
            all.into_iter()
                .filter_map(|(k, v)| Some((k, v.as_f64()?)))
                .collect(),
        ))
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// `git rev-parse HEAD` of the tree measured (with `-dirty` if it had changes).
    pub commit: String,
    pub machine: Machine,
    /// The experiment (the preset of the table it ran).
    pub preset: String,
    /// Where it ran: `ext4 /var/tmp, 8192 MiB, cache none`.
    pub storage: String,
    pub round: u32,
    /// The runs that share the ceiling measured around them: `r1/vhost/rr4k-d32-q1`.
    pub group: String,
    /// The arm measured (a peer of the table).
    pub peer: String,
    pub peer_name: String,
    /// `file` for a ceiling run, else how the arm was reached (`vhost`, `nbd`, ...).
    pub transport: String,
    pub ceiling: bool,
    pub workload: WorkloadRecord,
    /// Seconds since the epoch when the measurement started.
    pub started: u64,
    /// The 1-minute load average just before the run (`/proc/loadavg`).
    pub load1: f64,
    /// Length of the measured window, in seconds.
    pub window_s: f64,
    #[serde(flatten)]
    pub metrics: Metrics,
}

impl Sample {
    pub fn get(&self, metric: &str) -> Option<f64> {
        self.metrics.get(metric)
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

/// Appends one sample as one line and flushes it, so an interrupted run keeps what it
/// measured.
pub fn append(path: &Path, sample: &Sample) -> Result<()> {
    let mut line = serde_json::to_string(sample)?;
    line.push('\n');
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    f.write_all(line.as_bytes())
        .with_context(|| format!("appending to {}", path.display()))
}

/// Every sample of a results file; a line that is not one is an error naming its number.
pub fn load(path: &Path) -> Result<Vec<Sample>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text).with_context(|| format!("in {}", path.display()))
}

pub fn parse(text: &str) -> Result<Vec<Sample>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let value: serde_json::Value =
                serde_json::from_str(l).with_context(|| format!("line {} is not JSON", i + 1))?;
            let sample = if value.get("preset").is_some() {
                serde_json::from_value(value)
            } else {
                legacy::sample(value)
            };
            sample.with_context(|| format!("line {} is not a sample", i + 1))
        })
        .collect()
}

/// The lines `cryptblk-bench reencrypt` wrote before the engine (`part`, `what`, figures).
mod legacy {
    use super::*;

    #[derive(Deserialize)]
    struct PartRecord {
        commit: String,
        machine: Machine,
        /// offline, online or online-encrypt.
        part: String,
        round: u32,
        what: String,
        #[serde(flatten)]
        metrics: Metrics,
    }

    /// The same measurement as the engine records it now (experiment `reencrypt` or
    /// `encrypt-online`, the part as the workload, the in-place copy as the offline ceiling).
    pub fn sample(value: serde_json::Value) -> serde_json::Result<Sample> {
        let r: PartRecord = serde_json::from_value(value)?;
        let (preset, workload, transport) = match r.part.as_str() {
            "offline" => ("reencrypt", "offline", "file"),
            "online" => ("reencrypt", "online", "vhost"),
            _ => ("encrypt-online", "online", "vhost"),
        };
        let metrics = r.metrics;
        Ok(Sample {
            commit: r.commit,
            machine: r.machine,
            preset: preset.into(),
            storage: String::new(),
            round: r.round,
            group: format!("r{}/{workload}", r.round),
            peer_name: r.what.clone(),
            ceiling: r.what == "copy",
            transport: if r.what == "copy" { "file" } else { transport }.into(),
            peer: r.what,
            workload: WorkloadRecord {
                name: workload.into(),
                ..WorkloadRecord::default()
            },
            window_s: metrics.get("seconds").unwrap_or(0.0),
            metrics,
            // Not taken then.
            load1: f64::NAN,
            ..Sample::default()
        })
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A sample with the given identity and IOPS (the rest plausible).
    pub fn sample(group: &str, peer: &str, transport: &str, iops: f64) -> Sample {
        let round = group[1..].split('/').next().unwrap().parse().unwrap();
        let server_cpu = (transport != "file").then_some(50.0);
        Sample {
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
            metrics: Metrics::default()
                .with("iops", Some(iops))
                .with("mib_s", Some(iops * 4096.0 / 1048576.0))
                .with("lat_mean_us", Some(100.0))
                .with("lat_p50_us", Some(90.0))
                .with("lat_p99_us", Some(300.0))
                .with("lat_p999_us", Some(900.0))
                .with("server_cpu_pct", server_cpu)
                .with("client_cpu_pct", Some(40.0))
                .with(
                    "server_cpu_us_per_io",
                    cpu_us_per_io(server_cpu, Some(iops)),
                ),
        }
    }

    #[test]
    fn samples_round_trip_through_the_results_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("results.jsonl");
        let a = sample("r1/vhost/rr", "a", "vhost", 20000.0);
        let mut f = sample("r1/vhost/rr", "f", "file", 40000.0);
        f.metrics.0.remove("lat_p999_us");
        f.metrics.set("server_rss_kib", Some(5120.0));
        append(&path, &a).unwrap();
        append(&path, &f).unwrap();
        assert_eq!(load(&path).unwrap(), vec![a, f]);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2);
        // Whole numbers as integers, the record's old counters among them.
        assert!(text.contains("\"server_cpu_us_per_io\":25}"), "{text}");
        assert!(text.contains("\"server_rss_kib\":5120"), "{text}");
        assert!(text.contains("\"preset\":\"demo\""), "{text}");
    }

    #[test]
    fn a_broken_line_is_named() {
        let good = serde_json::to_string(&sample("r1/nbd/w", "a", "nbd", 1.0)).unwrap();
        let err = parse(&format!("{good}\n{{\"iops\": 3}}\n")).unwrap_err();
        assert!(format!("{err:#}").contains("line 2"), "{err:#}");
    }

    #[test]
    fn a_reencryption_line_of_before_the_engine_reads_as_a_sample() {
        let old = r#"{"commit":"c","machine":{"nproc":2,"cpu_model":"x","kernel":"k"},"part":"offline","round":2,"what":"copy","seconds":5.5,"mib_s":700.0,"iops":null,"lat_p99_us":null,"lat_p999_us":null}"#;
        let s = &parse(old).unwrap()[0];
        assert_eq!(
            (s.preset.as_str(), s.group.as_str(), s.peer.as_str()),
            ("reencrypt", "r2/offline", "copy")
        );
        assert!(s.ceiling);
        assert_eq!(s.get("seconds"), Some(5.5));
        assert_eq!(s.get("iops"), None);
    }

    #[test]
    fn cpu_per_io_is_cpu_percent_times_ten_thousand_over_iops() {
        // Half a core at 25,000 IOPS: 0.5 s of CPU per second / 25,000 = 20 µs.
        assert_eq!(cpu_us_per_io(Some(50.0), Some(25_000.0)), Some(20.0));
        assert_eq!(cpu_us_per_io(Some(50.0), Some(0.0)), None);
        assert_eq!(cpu_us_per_io(None, Some(1.0)), None);
    }
}
