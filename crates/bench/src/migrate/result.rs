//! The `RESULT key=value ...` lines that the postcopy_latency example's `latency` and `big`
//! children print, as typed figures: a key that is missing or not a number is an error naming
//! it (an example of another version), not a NaN in the table.
use anyhow::{Context, Result};
use serde::Serialize;
use std::collections::BTreeMap;

/// A postcopy configuration's `RESULT` line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Latency {
    /// Reads that waited for their block (the destination's histogram).
    pub count: u64,
    pub avg_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// Every read, waited or not.
    pub reads: u64,
    pub client_p99_us: f64,
    pub missing_start: u64,
    pub missing_end: u64,
    pub urgent_served: u64,
    pub bytes_sent: u64,
    pub measured_s: f64,
    pub throughput_mbps: f64,
}

/// The precopy run's `RESULT` line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Precopy {
    pub total_s: f64,
    pub elapsed_s: f64,
    /// None when the source reported none.
    pub downtime_ms: Option<f64>,
    pub bytes_sent: u64,
    pub passes: u64,
    pub writes: u64,
    pub dirty_at_switchover: u64,
    pub throughput_mbps: f64,
}

/// The `key=value` pairs of the `RESULT` line in a child's stdout.
fn result_line(stdout: &str) -> Result<BTreeMap<&str, &str>> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .with_context(|| format!("no RESULT line in the example's output: {stdout:?}"))?;
    Ok(line
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .collect())
}

fn field<T: std::str::FromStr>(m: &BTreeMap<&str, &str>, key: &str) -> Result<T> {
    let v = m.get(key).with_context(|| {
        format!("the RESULT line has no {key}= (is the example from another version?)")
    })?;
    v.parse()
        .map_err(|_| anyhow::anyhow!("the RESULT line's {key}={v} is not a number"))
}

impl Latency {
    pub fn parse(stdout: &str) -> Result<Latency> {
        let m = result_line(stdout)?;
        Ok(Latency {
            count: field(&m, "count")?,
            avg_us: field(&m, "avg_us")?,
            p50_us: field(&m, "p50_us")?,
            p99_us: field(&m, "p99_us")?,
            max_us: field(&m, "max_us")?,
            reads: field(&m, "reads")?,
            client_p99_us: field(&m, "client_p99_us")?,
            missing_start: field(&m, "missing_start")?,
            missing_end: field(&m, "missing_end")?,
            urgent_served: field(&m, "urgent_served")?,
            bytes_sent: field(&m, "bytes_sent")?,
            measured_s: field(&m, "measured_s")?,
            throughput_mbps: field(&m, "throughput_mbps")?,
        })
    }
}

impl Precopy {
    pub fn parse(stdout: &str) -> Result<Precopy> {
        let m = result_line(stdout)?;
        let downtime: f64 = field(&m, "downtime_ms")?;
        Ok(Precopy {
            total_s: field(&m, "total_s")?,
            elapsed_s: field(&m, "elapsed_s")?,
            downtime_ms: downtime.is_finite().then_some(downtime),
            bytes_sent: field(&m, "bytes_sent")?,
            passes: field(&m, "passes")?,
            writes: field(&m, "writes")?,
            dirty_at_switchover: field(&m, "dirty_at_switchover")?,
            throughput_mbps: field(&m, "throughput_mbps")?,
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// The lines a latency child and the big child printed (crates/migration's
    /// postcopy_latency, 2026-11-26), with a log line before them.
    pub const LATENCY_OUT: &str = "postcopy_latency: a note\nRESULT count=97 avg_us=266.4 p50_us=201 p99_us=1662 max_us=2410 reads=1431 client_p99_us=1702 missing_start=523776 missing_end=301200 phase=postcopy urgent_served=97 bytes_sent=912457728 measured_s=8.01 throughput_mbps=941.2\n";
    pub const PRECOPY_OUT: &str = "RESULT total_s=37.214 elapsed_s=37.101 downtime_ms=265.31 bytes_sent=4304601088 passes=2 writes=33890 dirty_at_switchover=1966080 throughput_mbps=928.1\n";

    #[test]
    fn the_examples_result_lines_parse_into_typed_figures() {
        let l = Latency::parse(LATENCY_OUT).unwrap();
        assert_eq!((l.count, l.reads, l.missing_end), (97, 1431, 301200));
        assert_eq!((l.avg_us, l.p99_us), (266.4, 1662.0));
        let p = Precopy::parse(PRECOPY_OUT).unwrap();
        assert_eq!((p.passes, p.downtime_ms), (2, Some(265.31)));
        let nan = PRECOPY_OUT.replace("downtime_ms=265.31", "downtime_ms=NaN");
        assert_eq!(Precopy::parse(&nan).unwrap().downtime_ms, None);
    }

    #[test]
    fn a_missing_or_broken_field_is_named() {
        let err = Latency::parse(&LATENCY_OUT.replace("p99_us=1662 ", "")).unwrap_err();
        assert!(format!("{err}").contains("no p99_us="), "{err}");
        let err = Precopy::parse(&PRECOPY_OUT.replace("passes=2", "passes=two")).unwrap_err();
        assert!(format!("{err}").contains("passes=two"), "{err}");
        assert!(Latency::parse("child crashed\n").is_err());
    }
}
