//! A preset expanded into the ordered list of measurements: interleaved rounds, each group of
//! runs between two ceiling runs, so that storage whose speed drifts over minutes hits every
//! peer alike and each run has a ceiling measured next to it.
use crate::config::{Config, Preset, Transport};
use anyhow::Result;

/// One measurement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub round: u32,
    /// The runs that share the ceiling measured around them: `r1/vhost/rr4k-d32-q1`
    /// (`r1/rr4k-d32-q1` with a shared ceiling).
    pub group: String,
    pub peer: String,
    /// None for the ceiling (fio on the image itself).
    pub transport: Option<Transport>,
    pub workload: String,
}

impl Step {
    pub fn is_ceiling(&self) -> bool {
        self.transport.is_none()
    }
}

/// For each round and workload: ceiling, every peer over each transport, ceiling. Workloads
/// without a ceiling (idle, copy) get none, and run only over the transports that have them.
pub fn expand(config: &Config, preset: &Preset, rounds: u32) -> Result<Vec<Step>> {
    let mut steps = Vec::new();
    for round in 1..=rounds {
        let mut add_group = |group: String, workload: &str, transports: &[Transport]| {
            let io = config.workloads[workload].rw.is_io();
            let ceiling = |steps: &mut Vec<Step>| {
                steps.push(Step {
                    round,
                    group: group.clone(),
                    peer: preset.ceiling.clone(),
                    transport: None,
                    workload: workload.to_string(),
                })
            };
            let runs: Vec<Step> = transports
                .iter()
                .filter(|t| fits(config, workload, **t))
                .flat_map(|&t| {
                    let group = &group;
                    preset.peers.iter().map(move |p| Step {
                        round,
                        group: group.clone(),
                        peer: p.clone(),
                        transport: Some(t),
                        workload: workload.to_string(),
                    })
                })
                .collect();
            if runs.is_empty() {
                return;
            }
            if io {
                ceiling(&mut steps);
            }
            steps.extend(runs);
            if io {
                ceiling(&mut steps);
            }
        };
        for w in &preset.workloads {
            config.workload(w)?;
            if preset.shared_ceiling {
                add_group(format!("r{round}/{w}"), w, &preset.transports);
            } else {
                for &t in &preset.transports {
                    add_group(format!("r{round}/{}/{w}", t.name()), w, &[t]);
                }
            }
        }
    }
    Ok(steps)
}

/// Idle clients are vhost-user ones (libblkio); nbdcopy is an NBD client.
fn fits(config: &Config, workload: &str, t: Transport) -> bool {
    use crate::config::Rw;
    match config.workloads[workload].rw {
        Rw::Idle => t == Transport::Vhost,
        Rw::Copy => t == Transport::Nbd,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(steps: &[Step]) -> Vec<String> {
        steps
            .iter()
            .map(|s| {
                format!(
                    "{}:{}:{}",
                    s.group,
                    s.peer,
                    s.transport.map_or("-", Transport::name)
                )
            })
            .collect()
    }

    #[test]
    fn every_group_sits_between_two_ceilings_in_interleaved_rounds() {
        let c = Config::load(None).unwrap();
        let demo = c.preset("demo").unwrap();
        let steps = expand(&c, demo, 2).unwrap();
        // 2 rounds x 2 transports x 2 workloads x (f a d f).
        assert_eq!(steps.len(), 2 * 2 * 2 * 4);
        assert_eq!(
            names(&steps[..8]),
            [
                "r1/vhost/rr4k-d32-q1:f:-",
                "r1/vhost/rr4k-d32-q1:a:vhost",
                "r1/vhost/rr4k-d32-q1:d:vhost",
                "r1/vhost/rr4k-d32-q1:f:-",
                "r1/nbd/rr4k-d32-q1:f:-",
                "r1/nbd/rr4k-d32-q1:a:nbd",
                "r1/nbd/rr4k-d32-q1:d:nbd",
                "r1/nbd/rr4k-d32-q1:f:-",
            ]
        );
        assert!(steps[16..].iter().all(|s| s.round == 2));
    }

    #[test]
    fn a_shared_ceiling_surrounds_every_transport_of_the_workload() {
        let c = Config::load(None).unwrap();
        let rbd = c.preset("rbd").unwrap();
        let steps = expand(&c, rbd, 1).unwrap();
        let first: Vec<String> = names(&steps[..12]);
        assert_eq!(first[0], "r1/rr4k-d32-q1:f:-");
        assert_eq!(first[1], "r1/rr4k-d32-q1:a:nbd");
        assert_eq!(first[6], "r1/rr4k-d32-q1:a:vhost");
        assert_eq!(first[11], "r1/rr4k-d32-q1:f:-");
        // 4 workloads x (2 ceilings + 5 peers x 2 transports).
        assert_eq!(steps.len(), 4 * 12);
    }

    #[test]
    fn idle_and_copy_run_without_ceiling_on_their_transport_only() {
        let c = Config::load(None).unwrap();
        let serve = expand(&c, c.preset("serve").unwrap(), 1).unwrap();
        let idle: Vec<&Step> = serve.iter().filter(|s| s.workload == "idle").collect();
        assert_eq!(idle.len(), 4);
        assert!(idle.iter().all(|s| s.transport == Some(Transport::Vhost)));
        let nbd = expand(&c, c.preset("nbd").unwrap(), 1).unwrap();
        let copy: Vec<&Step> = nbd.iter().filter(|s| s.workload == "copy").collect();
        assert_eq!(copy.len(), 4);
        assert!(copy.iter().all(|s| !s.is_ceiling()));
    }
}
