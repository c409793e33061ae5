//! The state a tracked disk shares between its synchronous wrapper and its queues' tracking
//! stages: the fence, the count of operations under way, and where modified ranges are marked.

use super::DirtyBitmap;
use crate::checkpoint::IntentLog;
use cryptblk_block::{BlockError, BlockErrorKind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The tracker's state, shared with the asynchronous queues opened through it.
pub(crate) struct TrackState {
    pub(super) bitmap: OnceLock<DirtyBitmap>,
    pub(super) granularity: u64,
    /// Where volume offset 0 lies in the image file; moves when a raw disk is encrypted in
    /// place (its data shifts up by the header), never while tracking.
    pub(super) payload_offset: AtomicU64,
    pub(super) tracking: AtomicBool,
    pub(super) fenced: AtomicBool,
    /// Operations between their fence check and their completion.
    pub(super) in_flight: AtomicU64,
    /// The checkpoints' write-intent log (idle without a checkpoint).
    pub(crate) intent: Arc<IntentLog>,
}

/// Ends an operation's stay in `in_flight`, also when it fails.
pub(super) struct InFlight<'a>(&'a AtomicU64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl TrackState {
    /// Counts an asynchronous operation in (until `leave`), or refuses it when fenced.
    pub(crate) fn enter_async(&self, op: &'static str) -> Result<(), BlockError> {
        let guard = self.enter(op)?;
        std::mem::forget(guard);
        Ok(())
    }

    /// Ends an operation counted in by `enter_async`.
    pub(crate) fn leave(&self) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    pub(super) fn enter(&self, op: &'static str) -> Result<InFlight<'_>, BlockError> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight(&self.in_flight);
        if self.fenced.load(Ordering::SeqCst) {
            return Err(BlockError::new(
                BlockErrorKind::Io,
                "the disk is being handed over to a migration destination (or already was); \
                 it serves no more I/O here",
            )
            .with_op(op));
        }
        Ok(guard)
    }

    /// The image-file range holding `len` volume bytes at `offset`.
    pub(crate) fn file_range(&self, offset: u64, len: u64) -> (u64, u64) {
        (
            offset.saturating_add(self.payload_offset.load(Ordering::Acquire)),
            len,
        )
    }

    /// Records `len` volume bytes at `offset` in the checkpoints' write-intent log (at once
    /// when already recorded or without a checkpoint); an error means `op` must not run.
    pub(crate) fn record(&self, op: &'static str, offset: u64, len: u64) -> Result<(), BlockError> {
        if self.intent.active() == 0 {
            return Ok(());
        }
        let (offset, len) = self.file_range(offset, len);
        self.intent.record(offset, len).map_err(|e| {
            BlockError::new(
                BlockErrorKind::Io,
                format!("recording the change in the disk's checkpoint log failed, so it was not done: {e}"),
            )
            .with_op(op)
            .at(offset)
        })
    }

    /// Marks after the inner operation finished (successfully or not: a failed write may
    /// have changed part of the range). Marking *before* would be wrong: the sender could take
    /// the bit and read the old data before the write landed, and then nothing would be left
    /// to say the block changed. Marking after, before returning to the guest, means an
    /// acknowledged write is either seen by a read that starts after it, or still dirty.
    pub(crate) fn mark(&self, offset: u64, len: u64) {
        if self.tracking.load(Ordering::SeqCst) {
            if let Some(bitmap) = self.bitmap.get() {
                bitmap.set_range(offset, len);
            }
        }
    }
}
