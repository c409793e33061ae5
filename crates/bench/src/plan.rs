//! An experiment expanded into the ordered list of its measurements, in interleaved rounds:
//! each round runs every arm of a workload next to the others (and, with a ceiling, between
//! two ceiling runs), so that storage or a machine whose speed drifts over minutes hits every
//! arm alike and each run has what it is compared with measured next to it.
use crate::config::{Order, Preset};

/// One measurement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub round: u32,
    /// The runs compared with each other: `r1/vhost/rr4k-d32-q1` (`r1/rr4k-d32-q1` when one
    /// ceiling serves every transport).
    pub group: String,
    pub peer: String,
    pub ceiling: bool,
    /// How the arm is reached (`vhost`, `nbd`, ...); `file` for the ceiling.
    pub transport: String,
    pub workload: String,
}

/// The transports of a workload and whether an arm runs it there; the driver's knowledge.
pub trait Fits {
    /// The transports the workload runs over (one group each, unless the ceiling is shared).
    fn transports(&self, workload: &str) -> Vec<String>;
    fn fits(&self, peer: &str, transport: &str, workload: &str) -> bool;
    /// Whether the ceiling runs around this workload's groups.
    fn has_ceiling(&self, workload: &str) -> bool;
    /// The transport an arm's samples name (the group's, unless the arm is reached another
    /// way).
    fn transport_of(&self, _peer: &str, transport: &str) -> String {
        transport.into()
    }
}

/// Every round of every workload: with `Order::Around` ceiling, each arm over each of the
/// workload's transports, ceiling; with `Order::Rotate` the ceiling and each arm once, the
/// first one moving by one per round.
pub fn expand(preset: &Preset, rounds: u32, fits: &dyn Fits) -> Vec<Step> {
    let mut steps = Vec::new();
    let pairs: Vec<(u32, &String)> = if preset.workload_major {
        preset
            .workloads
            .iter()
            .flat_map(|w| (1..=rounds).map(move |r| (r, w)))
            .collect()
    } else {
        (1..=rounds)
            .flat_map(|r| preset.workloads.iter().map(move |w| (r, w)))
            .collect()
    };
    for (round, w) in pairs {
        let transports = fits.transports(w);
        // One group per transport, unless one ceiling serves them all or the experiment has
        // no transports of its own (a driver's one way to reach its arms).
        let one_group = preset.shared_ceiling || preset.transports.is_empty();
        let groups: Vec<(String, Vec<String>)> = if one_group {
            vec![(format!("r{round}/{w}"), transports)]
        } else {
            transports
                .into_iter()
                .map(|t| (format!("r{round}/{t}/{w}"), vec![t]))
                .collect()
        };
        for (group, transports) in groups {
            let step = |peer: &str, ceiling: bool, transport: &str| Step {
                round,
                group: group.clone(),
                peer: peer.into(),
                ceiling,
                transport: if ceiling {
                    transport.into()
                } else {
                    fits.transport_of(peer, transport)
                },
                workload: w.clone(),
            };
            let mut runs: Vec<Step> = transports
                .iter()
                .flat_map(|t| {
                    preset
                        .peers
                        .iter()
                        .filter(|p| fits.fits(p, t, w))
                        .map(|p| step(p, false, t))
                        .collect::<Vec<_>>()
                })
                .collect();
            if runs.is_empty() {
                continue;
            }
            let ceiling = !preset.ceiling.is_empty() && fits.has_ceiling(w);
            match preset.order {
                Order::Around => {
                    // Every other round runs the arms the other way round: measured here, the
                    // arm right after the first ceiling run lost about 6 % to the one after it
                    // (the same binary in both slots), which a fixed order puts on one arm.
                    if round % 2 == 0 {
                        runs.reverse();
                    }
                    if ceiling {
                        runs.insert(0, step(&preset.ceiling, true, "file"));
                        runs.push(step(&preset.ceiling, true, "file"));
                    }
                }
                Order::Rotate => {
                    if ceiling {
                        runs.insert(0, step(&preset.ceiling, true, "file"));
                    }
                    let n = runs.len();
                    runs.rotate_left((round as usize - 1) % n);
                }
            }
            steps.extend(runs);
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    struct Local;
    impl Fits for Local {
        fn transports(&self, _: &str) -> Vec<String> {
            vec!["local".into()]
        }
        fn fits(&self, _: &str, _: &str, _: &str) -> bool {
            true
        }
        fn has_ceiling(&self, _: &str) -> bool {
            true
        }
    }

    #[test]
    fn rotated_rounds_start_one_arm_later_each_with_the_ceiling_among_them() {
        let c = Config::load(None).unwrap();
        let mut p = c.preset("convert").unwrap().clone();
        p.peers = vec!["x".into(), "y".into(), "z".into()];
        p.ceiling = "c".into();
        p.workloads = vec!["w".into()];
        let steps = expand(&p, 2, &Local);
        let order: Vec<&str> = steps.iter().map(|s| s.peer.as_str()).collect();
        assert_eq!(order, ["c", "x", "y", "z", "x", "y", "z", "c"]);
        assert_eq!(steps[0].group, "r1/w");
        assert!(steps[0].ceiling && steps[0].transport == "file");
    }
}
