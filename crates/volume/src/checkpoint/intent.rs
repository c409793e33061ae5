//! The write-intent log: before a write, discard or write-zeroes is submitted, the regions it
//! touches are durable in the newest checkpoint's bitmap (as md's write-intent bitmap).
//!
//! A region is flushed once per checkpoint: after that, a write to it finds its bit durable
//! and passes at the cost of a few atomic loads. The first writes to new regions share flushes
//! (group commit): each sets its bits and names its bitmap blocks under one mutex; one of them
//! writes every named block and fdatasyncs while the others wait on that flush, then all
//! find their bits durable.

use super::generation::Generation;
use super::CheckpointError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};

/// The log of one disk. Idle (one atomic load per write) until the disk has a checkpoint.
#[derive(Default)]
pub struct IntentLog {
    /// The newest checkpoint's generation, 0 with none: what a write is checked against.
    active: AtomicU64,
    current: RwLock<Option<Arc<Generation>>>,
    flush: Mutex<FlushState>,
    flushed: Condvar,
}

#[derive(Default)]
struct FlushState {
    /// Bitmap blocks of the current generation with wanted bits to write.
    pending: Vec<u64>,
    flushing: bool,
}

impl std::fmt::Debug for IntentLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IntentLog")
            .field("active", &self.active())
            .finish()
    }
}

impl IntentLog {
    /// The generation writes are recorded in (0: none, the log is idle).
    pub fn active(&self) -> u64 {
        self.active.load(Ordering::Acquire)
    }

    pub(crate) fn current(&self) -> Option<Arc<Generation>> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn lock(&self) -> MutexGuard<'_, FlushState> {
        self.flush.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes `generation` the one writes are recorded in (`None`: no checkpoint is left), once
    /// no flush is under way. `before` runs first under the same exclusion (a removal merges
    /// the bitmap being retired there).
    pub(crate) fn switch(
        &self,
        generation: Option<Arc<Generation>>,
        before: impl FnOnce() -> Result<(), CheckpointError>,
    ) -> Result<(), CheckpointError> {
        let mut state = self.lock();
        while state.flushing {
            state = self
                .flushed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        before()?;
        state.pending.clear();
        let id = generation.as_ref().map_or(0, |g| g.id);
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = generation;
        self.active.store(id, Ordering::Release);
        drop(state);
        // Writers waiting for a flush of the old generation look again.
        self.flushed.notify_all();
        Ok(())
    }

    /// Returns once the regions `len` image bytes at `offset` touch are durable in the
    /// current generation's bitmap (at once when they already are, or with no checkpoint).
    /// An error means they could not be recorded: the write they cover must not be done.
    pub fn record(&self, offset: u64, len: u64) -> Result<(), CheckpointError> {
        self.record_with(offset, len, |g| g.want(offset, len))
    }

    /// Every region becomes dirty in the current generation, durably (every byte of the image
    /// is about to change: a reencryption, the payload moving).
    pub fn record_all(&self) -> Result<(), CheckpointError> {
        self.record_with(0, u64::MAX, Generation::want_all)
    }

    fn record_with(
        &self,
        offset: u64,
        len: u64,
        want: impl Fn(&Generation) -> std::ops::Range<u64>,
    ) -> Result<(), CheckpointError> {
        let mut state = self.lock();
        // The generation whose wanted bits this write set and named.
        let mut wanted_in = 0;
        loop {
            let Some(generation) = self.current() else {
                return Ok(());
            };
            if generation.is_durable(offset, len) {
                return Ok(());
            }
            if wanted_in != generation.id {
                wanted_in = generation.id;
                for block in want(&generation) {
                    if !state.pending.contains(&block) {
                        state.pending.push(block);
                    }
                }
            }
            if state.flushing {
                state = self
                    .flushed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            state.flushing = true;
            let mut blocks = std::mem::take(&mut state.pending);
            drop(state);
            // Every write that named these blocks set its bits before it did: they are read
            // now, after, so the flush holds them all.
            blocks.sort_unstable();
            let flushed = generation.flush_blocks(&blocks);
            state = self.lock();
            state.flushing = false;
            self.flushed.notify_all();
            if let Err(e) = flushed {
                // Those waiting on this flush try again themselves, with its blocks.
                for block in blocks {
                    if !state.pending.contains(&block) {
                        state.pending.push(block);
                    }
                }
                return Err(e);
            }
        }
    }
}
