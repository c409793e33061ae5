//! The hand-off benchmark's table: every hand-off, then the median and maximum downtime of
//! each kind (idle, loaded) against its target.
use super::{HandoffRecord, IDLE_TARGET_MS, LOADED_TARGET_MS};

/// The markdown summary: every hand-off, then median and max of each kind against its target.
pub(super) fn summary(records: &[HandoffRecord]) -> String {
    let mut out = String::from("| # | from | to | kind | downtime ms | fio write IOPS |\n");
    out += "|---|---|---|---|---:|---:|\n";
    for r in records {
        out += &format!(
            "| {} | {} | {} | {} | {:.1} | {} |\n",
            r.n,
            r.from,
            r.to,
            if r.loaded { "loaded" } else { "idle" },
            r.downtime_ms,
            r.fio_write_iops.map_or("-".into(), |i| format!("{i:.0}"))
        );
    }
    out += "\n| kind | hand-offs | median ms | max ms | target ms | max within target |\n";
    out += "|---|---:|---:|---:|---:|---|\n";
    for (loaded, target) in [(false, IDLE_TARGET_MS), (true, LOADED_TARGET_MS)] {
        let mut ms: Vec<f64> = records
            .iter()
            .filter(|r| r.loaded == loaded)
            .map(|r| r.downtime_ms)
            .collect();
        if ms.is_empty() {
            continue;
        }
        ms.sort_by(f64::total_cmp);
        let median = crate::stats::median(&ms).unwrap_or(f64::NAN);
        let max = ms[ms.len() - 1];
        out += &format!(
            "| {} | {} | {median:.1} | {max:.1} | < {target:.0} | {} |\n",
            if loaded { "loaded" } else { "idle" },
            ms.len(),
            if max < target { "yes" } else { "no" }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procfs;

    fn record(n: u32, loaded: bool, downtime_ms: f64) -> HandoffRecord {
        HandoffRecord {
            commit: "c".into(),
            machine: procfs::machine(),
            started: 0,
            load1: 0.0,
            n,
            from: "A",
            to: "B",
            loaded,
            downtime_ms,
            fio_write_iops: loaded.then_some(1000.0),
        }
    }

    #[test]
    fn the_summary_judges_the_worst_hand_off_of_each_kind() {
        let text = summary(&[
            record(1, false, 20.0),
            record(2, true, 300.0),
            record(3, true, 700.0),
            record(4, false, 40.0),
        ]);
        assert!(
            text.contains("| idle | 2 | 30.0 | 40.0 | < 100 | yes |"),
            "{text}"
        );
        assert!(
            text.contains("| loaded | 2 | 500.0 | 700.0 | < 500 | no |"),
            "{text}"
        );
    }
}
