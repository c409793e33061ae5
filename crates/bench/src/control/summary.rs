//! The control benchmark's table, from its records: medians over rounds, the IOPS of churn
//! and spawn runs over the quiet run of the same round, and the round trips.
use super::ControlRecord;
use crate::rounds::{self, Better};
use std::collections::BTreeMap;

pub fn render(records: &[ControlRecord], loops: usize, runtime: f64, left: &[String]) -> String {
    let runs = |mode: &str, f: fn(&ControlRecord) -> Option<f64>| -> BTreeMap<u32, f64> {
        records
            .iter()
            .filter(|r| r.part == "run" && r.what == mode)
            .filter_map(|r| Some((r.round, f(r)?)))
            .collect()
    };
    let median = |mode: &str, f: fn(&ControlRecord) -> Option<f64>, digits: usize| {
        let v: Vec<f64> = runs(mode, f).into_values().collect();
        crate::stats::median(&v).map_or("n/a".into(), |m| format!("{m:.digits$}"))
    };
    let iops = |mode| runs(mode, |r| r.iops);
    let iops_ratio = |a, b| rounds::show(rounds::ratio(&iops(a), &iops(b), Better::Higher));
    let trip = |what: &str| {
        records
            .iter()
            .find(|r| r.part == "round-trip" && r.what == what)
            .and_then(|r| r.median_us)
    };
    let ms = |what| trip(what).map_or("n/a".into(), |us| format!("{:.1} ms", us / 1e3));
    let churn: Vec<&ControlRecord> = records
        .iter()
        .filter(|r| r.part == "run" && r.what == "churn")
        .collect();
    let per_round: Vec<String> = churn
        .iter()
        .map(|r| r.ops.unwrap_or(0).to_string())
        .collect();
    let failed: u64 = churn.iter().filter_map(|r| r.errors).sum();
    let rounds_run = runs("quiet", |r| r.iops).len();
    let mut out = format!(
        "\n## cryptblk serve --control: control-plane throughput and its cost to the data path\n\n\
         fio --ioengine=nbd 4k randread depth 32, {runtime} s per run, {rounds_run} round(s) \
         (quiet, churn and spawn-only runs rotate); medians, ratios are medians of per-round \
         ratios (worst round); daemon CPU over fio's window, 100 % = one core.\n\n\
         | measurement | value |\n|---|---:|\n"
    );
    out += &format!(
        "| data-path IOPS, no control traffic | {} |\n",
        median("quiet", |r| r.iops, 0)
    );
    out += &format!(
        "| data-path IOPS during churn ({loops} loops of ctl disk-add / disk-list / stats / disk-remove) | {} |\n",
        median("churn", |r| r.iops, 0)
    );
    out += &format!(
        "| IOPS ratio churn / quiet | {} |\n",
        iops_ratio("churn", "quiet")
    );
    out += &format!(
        "| data-path IOPS during spawn-only loops (cryptblk --version) | {} |\n",
        median("spawn", |r| r.iops, 0)
    );
    out += &format!(
        "| IOPS ratio spawn-only / quiet | {} |\n",
        iops_ratio("spawn", "quiet")
    );
    out += &format!(
        "| IOPS ratio churn / spawn-only (the control traffic's own cost) | {} |\n",
        iops_ratio("churn", "spawn")
    );
    out += &format!(
        "| daemon CPU %, quiet / churn / spawn-only | {} / {} / {} |\n",
        median("quiet", |r| r.server_cpu_pct, 1),
        median("churn", |r| r.server_cpu_pct, 1),
        median("spawn", |r| r.server_cpu_pct, 1)
    );
    out += &format!(
        "| control ops/s during churn | {} |\n",
        median("churn", |r| r.ops_per_s, 1)
    );
    out += &format!(
        "| process starts/s in the spawn-only loops | {} |\n",
        median("spawn", |r| r.ops_per_s, 1)
    );
    out += &format!(
        "| completed control ops per round | {} ({failed} failed in all) |\n",
        per_round.join(" ")
    );
    out += &format!(
        "| `cryptblk ctl stats` round trip, new process, median of 50 | {} |\n",
        ms("ctl-stats")
    );
    out += &format!(
        "| `cryptblk --version` (process start alone), median of 50 | {} |\n",
        ms("version")
    );
    out += &format!(
        "| JSON-RPC \"stats\" on an open connection, median of 50 | {} |\n",
        trip("rpc-stats").map_or("n/a".into(), |us| format!("{us:.0} µs"))
    );
    out += &format!(
        "| disks left after the churn | {} |\n",
        if left.is_empty() {
            "none".to_string()
        } else {
            left.join(" ")
        }
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procfs;

    fn run(round: u32, what: &str, iops: f64, ops: Option<u64>) -> ControlRecord {
        ControlRecord {
            commit: "c".into(),
            machine: procfs::machine(),
            part: "run".into(),
            round,
            what: what.into(),
            started: 0,
            load1: 0.0,
            window_s: Some(10.0),
            iops: Some(iops),
            lat_p99_us: None,
            server_cpu_pct: Some(50.0),
            loops: ops.map(|_| 4),
            ops,
            errors: ops.map(|_| u64::from(round == 2)),
            ops_per_s: ops.map(|o| o as f64 / 10.0),
            median_us: None,
            samples: None,
        }
    }

    fn trip(what: &str, us: f64) -> ControlRecord {
        ControlRecord {
            part: "round-trip".into(),
            round: 0,
            what: what.into(),
            iops: None,
            median_us: Some(us),
            samples: Some(50),
            ..run(0, "", 0.0, None)
        }
    }

    #[test]
    fn the_table_pairs_each_round_with_its_quiet_run_and_shows_the_round_trips() {
        let records = [
            run(1, "quiet", 40000.0, None),
            run(1, "churn", 30000.0, Some(3000)),
            run(1, "spawn", 31250.0, Some(5000)),
            run(2, "churn", 34000.0, Some(3400)),
            run(2, "spawn", 36000.0, Some(5200)),
            run(2, "quiet", 40000.0, None),
            trip("ctl-stats", 2500.0),
            trip("version", 1500.0),
            trip("rpc-stats", 77.4),
        ];
        let text = render(&records, 4, 10.0, &[]);
        // 0.75 and 0.85; the worst round is the lower.
        assert!(
            text.contains("| IOPS ratio churn / quiet | 0.80 (worst 0.75) |"),
            "{text}"
        );
        assert!(
            text.contains("| IOPS ratio churn / spawn-only (the control traffic's own cost) | 0.95 (worst 0.94) |"),
            "{text}"
        );
        assert!(
            text.contains("| control ops/s during churn | 320.0 |"),
            "{text}"
        );
        assert!(
            text.contains("| completed control ops per round | 3000 3400 (1 failed in all) |"),
            "{text}"
        );
        assert!(text.contains("median of 50 | 2.5 ms |"), "{text}");
        assert!(text.contains("| 77 µs |"), "{text}");
        assert!(
            text.contains("| disks left after the churn | none |"),
            "{text}"
        );
        assert!(render(&records, 4, 10.0, &["d2".into()]).contains("| d2 |"));
    }
}
