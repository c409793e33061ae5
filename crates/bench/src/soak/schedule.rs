//! When the events come: upgrades and kills at their periods, churn at its period offset by
//! half of it (at the default periods it never lands on an upgrade or a kill), all before the
//! end of the run; events due at once run one after the other.

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    Upgrade,
    Kill,
    Churn,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Upgrade => "upgrade",
            Kind::Kill => "kill",
            Kind::Churn => "churn",
        }
    }
}

/// (seconds from the start, kind), in order; a period of 0 or less turns that kind off.
pub fn plan(total_s: f64, upgrade_s: f64, kill_s: f64, churn_s: f64) -> Vec<(f64, Kind)> {
    let mut out = Vec::new();
    for (period, offset, kind) in [
        (upgrade_s, 0.0, Kind::Upgrade),
        (kill_s, 0.0, Kind::Kill),
        (churn_s, 0.5, Kind::Churn),
    ] {
        if period <= 0.0 {
            continue;
        }
        let mut k = 1.0 - offset;
        while k * period < total_s {
            out.push((k * period, kind));
            k += 1.0;
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_interleave_and_stop_before_the_end() {
        let p = plan(600.0, 300.0, 420.0, 120.0);
        let names: Vec<(f64, &str)> = p.iter().map(|(t, k)| (*t, k.name())).collect();
        assert_eq!(
            names,
            [
                (60.0, "churn"),
                (180.0, "churn"),
                (300.0, "upgrade"),
                (300.0, "churn"),
                (420.0, "kill"),
                (420.0, "churn"),
                (540.0, "churn"),
            ]
        );
        assert!(plan(600.0, 0.0, 0.0, 0.0).is_empty());
    }
}
