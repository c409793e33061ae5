//! The read-path benchmark's tables: median IOPS of every peer per workload, then the ratios
//! that say where the encrypted path loses, each the median of the per-round ratios with the
//! worst (lowest) round.
use crate::record::Record;
use crate::stats::{median, Ratio};
use std::collections::BTreeSet;
use std::fmt::Write;

/// The pairs (numerator, denominator) of the ratio table; `o/d` only with an older binary.
fn pairs(old: bool) -> Vec<(&'static str, &'static str)> {
    let mut v = vec![("a", "d"), ("a", "fluks"), ("a", "fdec"), ("fdec", "fluks")];
    if old {
        v.push(("o", "d"));
    }
    v
}

/// `num`'s IOPS over `den`'s in each round of `workload` that has both.
pub(super) fn per_round(records: &[Record], workload: &str, num: &str, den: &str) -> Option<Ratio> {
    let iops = |round: u32, peer: &str| {
        records
            .iter()
            .find(|r| r.workload.name == workload && r.round == round && r.peer == peer)
            .and_then(|r| r.iops)
    };
    let rounds: BTreeSet<u32> = records.iter().map(|r| r.round).collect();
    let ratios: Vec<f64> = rounds
        .into_iter()
        .filter_map(|round| {
            let (n, d) = (iops(round, num)?, iops(round, den)?);
            (d > 0.0).then(|| n / d)
        })
        .collect();
    Ratio::of(&ratios)
}

fn median_of(
    records: &[Record],
    workload: &str,
    peer: &str,
    f: impl Fn(&Record) -> Option<f64>,
) -> Option<f64> {
    median(
        &records
            .iter()
            .filter(|r| r.workload.name == workload && r.peer == peer)
            .filter_map(f)
            .collect::<Vec<_>>(),
    )
}

/// Both tables, workloads in the order given.
pub fn markdown(records: &[Record], workloads: &[String], old: bool) -> String {
    let peers = super::peer_ids(old);
    let servers: Vec<&str> = peers
        .iter()
        .copied()
        .filter(|p| !p.starts_with('f'))
        .collect();
    let mut out =
        String::from("\nIOPS, median over rounds (server CPU per I/O in µs)\n\n| workload |");
    for p in &peers {
        let _ = write!(out, " {p} |");
    }
    out += "\n|---|";
    out += &"---:|".repeat(peers.len());
    out += "\n";
    for w in workloads {
        let _ = write!(out, "| {w} |");
        for p in &peers {
            let iops = median_of(records, w, p, |r| r.iops);
            let cpu = servers
                .contains(p)
                .then(|| median_of(records, w, p, |r| r.server_cpu_us_per_io))
                .flatten();
            let cell = match (iops, cpu) {
                (None, _) => "-".to_string(),
                (Some(i), None) => format!("{i:.0}"),
                (Some(i), Some(c)) => format!("{i:.0} ({c:.2})"),
            };
            let _ = write!(out, " {cell} |");
        }
        out += "\n";
    }
    let pairs = pairs(old);
    out += "\nRatios of IOPS: median of the per-round ratios (worst round)\n\n| workload |";
    for (n, d) in &pairs {
        let _ = write!(out, " {n}/{d} |");
    }
    out += "\n|---|";
    out += &"---|".repeat(pairs.len());
    out += "\n";
    for w in workloads {
        let _ = write!(out, "| {w} |");
        for (n, d) in &pairs {
            let cell = per_round(records, w, n, d).map_or("n/a".to_string(), |r| {
                format!("{:.2} ({:.2})", r.median, r.worst)
            });
            let _ = write!(out, " {cell} |");
        }
        out += "\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::tests::sample;

    fn run(round: u32, workload: &str, peer: &str, iops: f64) -> Record {
        let transport = if peer.starts_with('f') {
            "file"
        } else {
            "vhost"
        };
        let mut r = sample(&format!("r{round}/{workload}"), peer, transport, iops);
        r.workload.name = workload.into();
        r
    }

    #[test]
    fn ratios_are_medians_of_per_round_ratios_with_the_worst_round() {
        let w = "randread:4096:128";
        let mut records = Vec::new();
        for (round, d, a, fluks) in [
            (1, 100.0, 90.0, 95.0),
            (2, 50.0, 40.0, 50.0),
            (3, 200.0, 190.0, 200.0),
        ] {
            records.push(run(round, w, "fraw", 210.0));
            records.push(run(round, w, "fluks", fluks));
            records.push(run(round, w, "d", d));
            records.push(run(round, w, "a", a));
        }
        // A workload of writes: no fdec runs.
        records.push(run(1, "randwrite:4096:32", "a", 10.0));
        records.push(run(1, "randwrite:4096:32", "d", 20.0));
        // a/d per round: 0.9, 0.8, 0.95 -> median 0.9, worst 0.8.
        let ad = per_round(&records, w, "a", "d").unwrap();
        assert!(
            (ad.median - 0.9).abs() < 1e-9 && (ad.worst - 0.8).abs() < 1e-9,
            "{ad:?}"
        );
        assert_eq!(ad.rounds, 3);
        assert!(per_round(&records, w, "a", "fdec").is_none());
        let names = [w.to_string(), "randwrite:4096:32".to_string()];
        let text = markdown(&records, &names, false);
        assert!(
            text.contains("| randread:4096:128 | 0.90 (0.80) | 0.95 (0.80) | n/a | n/a |"),
            "{text}"
        );
        assert!(
            text.contains("| randwrite:4096:32 | 0.50 (0.50) | n/a | n/a | n/a |"),
            "{text}"
        );
        // Median IOPS per peer; servers with their CPU per I/O (50 % CPU / 90 IOPS).
        assert!(
            text.contains("| randread:4096:128 | 210 | 95 | - | 100 ("),
            "{text}"
        );
        assert!(!text.contains("o/d"), "{text}");
        assert!(markdown(&records, &names, true).contains("| o/d |"));
    }
}
