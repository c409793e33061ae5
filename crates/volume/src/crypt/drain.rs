//! Waiting, with a bound, until no request a generation admitted is in flight.
//!
//! Before a hotzone is rewritten, the reencryption driver must see every request the queues
//! admitted under the previous routes complete. A request the device never answers would
//! keep it waiting forever, so the wait gives up after [`DRAIN_TIMEOUT`]; the reencryption
//! step then fails (the disk keeps serving) and a later one tries again.
//!
//! The counts are kept per generation *parity*, so stragglers left behind by a wait that gave
//! up must be seen to finish before any later generation is published: the generation after
//! next has their parity, and new requests would join their count.
use cryptblk_block::{BlockError, BlockErrorKind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a hotzone waits for the requests admitted before it was fenced off.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the wait looks again at the counts.
const DRAIN_POLL: Duration = Duration::from_micros(100);

/// A stage's requests in flight, by generation parity; only the stage's thread writes them.
#[derive(Default)]
pub(crate) struct StageCounts {
    pub(super) in_flight: [AtomicU64; 2],
}

impl StageCounts {
    /// Adds `delta` (+1 or -1) to the count of `parity`. Only the owning stage calls this,
    /// from one thread, so a load and a store suffice.
    pub(crate) fn add(&self, parity: usize, delta: i64) {
        let c = &self.in_flight[parity];
        c.store(
            c.load(Ordering::Relaxed).wrapping_add_signed(delta),
            Ordering::Relaxed,
        );
    }
}

pub(crate) struct Drain {
    timeout: Duration,
    /// The parity whose requests a wait gave up on, until they are seen to finish.
    pending: Mutex<Option<usize>>,
}

impl Drain {
    pub(crate) fn new(timeout: Duration) -> Drain {
        Drain {
            timeout,
            pending: Mutex::new(None),
        }
    }

    /// Before publishing a generation: the stragglers an earlier wait gave up on must be done.
    pub(crate) fn settle_pending(&self, stages: &[Arc<StageCounts>]) -> Result<(), BlockError> {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(parity) = *pending {
            self.wait(stages, parity)?;
            *pending = None;
        }
        Ok(())
    }

    /// After publishing a generation: the requests admitted under the previous one (of
    /// `parity`) must be done; if they are not within the bound, they are remembered.
    pub(crate) fn previous(
        &self,
        stages: &[Arc<StageCounts>],
        parity: usize,
    ) -> Result<(), BlockError> {
        self.wait(stages, parity).inspect_err(|_| {
            *self.pending.lock().unwrap_or_else(PoisonError::into_inner) = Some(parity);
        })
    }

    fn wait(&self, stages: &[Arc<StageCounts>], parity: usize) -> Result<(), BlockError> {
        let deadline = Instant::now() + self.timeout;
        for counts in stages {
            while counts.in_flight[parity].load(Ordering::Relaxed) != 0 {
                if Instant::now() >= deadline {
                    return Err(BlockError::new(
                        BlockErrorKind::Io,
                        format!(
                            "requests admitted before the hotzone was fenced off are still in flight after {} s (is the device answering?)",
                            self.timeout.as_secs_f64()
                        ),
                    ));
                }
                std::thread::sleep(DRAIN_POLL);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHORT: Duration = Duration::from_millis(50);

    #[test]
    fn gives_up_on_a_hung_request_and_waits_for_it_before_the_next_generation() {
        let drain = Drain::new(SHORT);
        let stage = Arc::new(StageCounts::default());
        let stages = [stage.clone()];
        // A request admitted under generation 0 (parity 0) never completes.
        stage.add(0, 1);
        let started = Instant::now();
        let e = drain.previous(&stages, 0).unwrap_err();
        assert!(started.elapsed() >= SHORT && started.elapsed() < 10 * SHORT);
        assert!(e.to_string().contains("still in flight"), "{e}");
        // Other parities' requests do not release it: the straggler's parity stays pending.
        stage.add(1, 1);
        assert!(drain.settle_pending(&stages).is_err());
        stage.add(1, -1);
        // Once it completes, the next generation may be published and waited for.
        stage.add(0, -1);
        drain.settle_pending(&stages).unwrap();
        drain.previous(&stages, 1).unwrap();
        drain.settle_pending(&stages).unwrap();
    }

    #[test]
    fn waits_as_long_as_requests_finish_within_the_bound() {
        let drain = Drain::new(Duration::from_secs(10));
        let stage = Arc::new(StageCounts::default());
        stage.add(1, 1);
        let s = stage.clone();
        let done = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            s.add(1, -1);
        });
        drain.previous(&[stage], 1).unwrap();
        done.join().unwrap();
    }
}
