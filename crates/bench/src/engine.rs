//! The one engine: an experiment of the table expanded into interleaved rounds (`plan`), each
//! step measured by the experiment's driver, stamped into a `Sample` (commit, machine, round,
//! arm, load average) and appended to the results file as soon as it is taken.
use crate::config::Preset;
use crate::plan::{self, Fits, Step};
use crate::sample::{self, Metrics, Sample, WorkloadRecord};
use crate::{metric, procfs};
use anyhow::{Context, Result};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// What one step measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    /// The measured window, in seconds.
    pub window_s: f64,
    pub metrics: Metrics,
}

/// What runs an experiment's steps.
pub trait Driver: Fits {
    fn measure(&mut self, step: &Step) -> Result<Measured>;
    /// Where the experiment runs, as its samples say: `ext4 /var/tmp, 8192 MiB, cache none`.
    fn storage(&self) -> String;
    fn peer_name(&self, peer: &str) -> String;
    fn workload(&self, name: &str) -> WorkloadRecord {
        WorkloadRecord {
            name: name.into(),
            ..WorkloadRecord::default()
        }
    }
    /// After the last step: checks and clean-up that belong to the whole run.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Runs every step of the experiment; returns the samples taken (also appended to `results`).
pub fn run(
    name: &str,
    preset: &Preset,
    rounds: u32,
    driver: &mut dyn Driver,
    results: &Path,
) -> Result<Vec<Sample>> {
    if rounds == 0 {
        anyhow::bail!("{name}: --rounds must be at least 1");
    }
    let steps = plan::expand(preset, rounds, driver);
    eprintln!(
        "{name}: {} measurements in {rounds} interleaved round(s); results appended to {}",
        steps.len(),
        results.display()
    );
    let (commit, machine, storage) = (procfs::commit(), procfs::machine(), driver.storage());
    let mut taken = Vec::new();
    for step in &steps {
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let load1 = procfs::load1();
        let m = driver.measure(step).with_context(|| {
            format!(
                "round {} {} peer {} {}",
                step.round, step.workload, step.peer, step.transport
            )
        })?;
        let s = Sample {
            commit: commit.clone(),
            machine: machine.clone(),
            preset: name.into(),
            storage: storage.clone(),
            round: step.round,
            group: step.group.clone(),
            peer: step.peer.clone(),
            peer_name: driver.peer_name(&step.peer),
            transport: step.transport.clone(),
            ceiling: step.ceiling,
            workload: driver.workload(&step.workload),
            started,
            load1,
            window_s: m.window_s,
            metrics: m.metrics,
        };
        let figures: Vec<String> = preset
            .metrics
            .iter()
            .filter_map(|k| {
                Some(format!(
                    "{} {}",
                    metric::show(k, Some(s.get(k)?)),
                    metric::label(k)
                ))
            })
            .take(4)
            .collect();
        eprintln!(
            "  {} {}: {}, load {:.2}",
            s.group,
            s.peer,
            figures.join(", "),
            load1
        );
        sample::append(results, &s)?;
        taken.push(s);
    }
    driver.finish()?;
    Ok(taken)
}
