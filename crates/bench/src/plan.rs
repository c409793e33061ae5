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
    use crate::matrix::MatrixFits;

    fn names(steps: &[Step]) -> Vec<String> {
        steps
            .iter()
            .map(|s| format!("{}:{}:{}", s.group, s.peer, s.transport))
            .collect()
    }

    fn matrix(c: &Config, preset: &str, rounds: u32) -> Vec<Step> {
        let p = c.preset(preset).unwrap();
        expand(
            p,
            rounds,
            &MatrixFits {
                config: c,
                preset: p,
            },
        )
    }

    #[test]
    fn every_group_sits_between_two_ceilings_in_interleaved_rounds() {
        let c = Config::load(None).unwrap();
        let steps = matrix(&c, "demo", 2);
        // 2 rounds x 2 transports x 2 workloads x (f a d f).
        assert_eq!(steps.len(), 2 * 2 * 2 * 4);
        assert_eq!(
            names(&steps[..8]),
            [
                "r1/vhost/rr4k-d32-q1:f:file",
                "r1/vhost/rr4k-d32-q1:a:vhost",
                "r1/vhost/rr4k-d32-q1:d:vhost",
                "r1/vhost/rr4k-d32-q1:f:file",
                "r1/nbd/rr4k-d32-q1:f:file",
                "r1/nbd/rr4k-d32-q1:a:nbd",
                "r1/nbd/rr4k-d32-q1:d:nbd",
                "r1/nbd/rr4k-d32-q1:f:file",
            ]
        );
        assert!(steps[16..].iter().all(|s| s.round == 2));
    }

    #[test]
    fn a_shared_ceiling_surrounds_every_transport_of_the_workload() {
        let c = Config::load(None).unwrap();
        let first = names(&matrix(&c, "rbd", 1)[..12]);
        assert_eq!(first[0], "r1/rr4k-d32-q1:f:file");
        assert_eq!(first[1], "r1/rr4k-d32-q1:a:nbd");
        assert_eq!(first[6], "r1/rr4k-d32-q1:a:vhost");
        assert_eq!(first[11], "r1/rr4k-d32-q1:f:file");
        // 4 workloads x (2 ceilings + 5 peers x 2 transports).
        assert_eq!(matrix(&c, "rbd", 1).len(), 4 * 12);
    }

    #[test]
    fn idle_and_copy_run_without_ceiling_on_their_transport_only() {
        let c = Config::load(None).unwrap();
        let serve = matrix(&c, "serve", 1);
        let idle: Vec<&Step> = serve.iter().filter(|s| s.workload == "idle").collect();
        assert_eq!(idle.len(), 4);
        assert!(idle.iter().all(|s| s.transport == "vhost"));
        let nbd = matrix(&c, "nbd", 1);
        let copy: Vec<&Step> = nbd.iter().filter(|s| s.workload == "copy").collect();
        assert_eq!(copy.len(), 4);
        assert!(copy.iter().all(|s| !s.ceiling));
    }

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
