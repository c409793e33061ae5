//! Ratios of two jobs measured in the same interleaved rounds: one ratio per round (so that a
//! slow spell of the machine hits both sides of it), then their median and the worst round.
use std::collections::BTreeMap;

/// Which way a ratio is good: the worst round is the lowest for a speed-up, the highest for a
/// time over a time that should stay small.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Better {
    Higher,
    Lower,
}

/// The median of the per-round ratios and the worst of them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub worst: f64,
    pub rounds: usize,
}

/// `num[round] / den[round]` for every round that has both (and a non-zero denominator),
/// summarised.
pub fn ratio(num: &BTreeMap<u32, f64>, den: &BTreeMap<u32, f64>, better: Better) -> Option<Spread> {
    let per_round: Vec<f64> = num
        .iter()
        .filter_map(|(round, n)| den.get(round).filter(|d| **d != 0.0).map(|d| n / d))
        .filter(|r| r.is_finite())
        .collect();
    let worst = match better {
        Better::Higher => per_round.iter().copied().reduce(f64::min)?,
        Better::Lower => per_round.iter().copied().reduce(f64::max)?,
    };
    Some(Spread {
        median: crate::stats::median(&per_round)?,
        worst,
        rounds: per_round.len(),
    })
}

/// `1.23 (worst 1.10)`, or `n/a` when no round had both jobs.
pub fn show(s: Option<Spread>) -> String {
    s.map_or_else(
        || "n/a".into(),
        |s| format!("{:.2} (worst {:.2})", s.median, s.worst),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn by_round(values: &[(u32, f64)]) -> BTreeMap<u32, f64> {
        values.iter().copied().collect()
    }

    #[test]
    fn ratios_pair_values_of_the_same_round_and_the_worst_depends_on_the_direction() {
        let slow = by_round(&[(1, 30.0), (2, 20.0), (3, 90.0), (4, 5.0)]);
        let fast = by_round(&[(1, 10.0), (2, 10.0), (3, 10.0)]);
        // Round 4 has no partner and is left out: 3, 2 and 9.
        let up = ratio(&slow, &fast, Better::Higher).unwrap();
        assert_eq!((up.median, up.worst, up.rounds), (3.0, 2.0, 3));
        let down = ratio(&slow, &fast, Better::Lower).unwrap();
        assert_eq!((down.median, down.worst), (3.0, 9.0));
        assert_eq!(show(Some(up)), "3.00 (worst 2.00)");
    }

    #[test]
    fn no_common_round_or_a_zero_denominator_gives_no_ratio() {
        let a = by_round(&[(1, 1.0)]);
        assert_eq!(ratio(&a, &by_round(&[(2, 1.0)]), Better::Higher), None);
        assert_eq!(ratio(&a, &by_round(&[(1, 0.0)]), Better::Higher), None);
        assert_eq!(show(None), "n/a");
    }
}
