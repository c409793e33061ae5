//! The state a tracked disk shares between its synchronous wrapper and its queues' tracking
//! stages: the fence, the count of operations under way, and where modified ranges are marked.

use super::{CopyBeforeWrite, DirtyBitmap};
use crate::checkpoint::IntentLog;
use cryptblk_block::{BlockError, BlockErrorKind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

/// The tracker's state, shared with the asynchronous queues opened through it.
pub(crate) struct TrackState {
    pub(super) bitmap: OnceLock<DirtyBitmap>,
    pub(super) granularity: u64,
    /// Where volume offset 0 lies in the image file; moves when a raw disk is encrypted in
    /// place (its data shifts up by the header), never while tracking.
    pub(super) payload_offset: AtomicU64,
    pub(super) tracking: AtomicBool,
    pub(super) fenced: AtomicBool,
    /// Operations between their fence check and their completion, by the parity of the
    /// `epoch` they entered in (so the ones entered before a point can be waited for).
    pub(super) in_flight: [AtomicU64; 2],
    pub(super) epoch: AtomicU64,
    /// Operations ever entered: how a backup sees that the disk's own users are busy
    /// ([`GuestActivity`](super::GuestActivity)).
    pub(super) entered: AtomicU64,
    /// A backup's copy-before-write, while one runs (`copying` says so in one load).
    pub(super) copying: AtomicBool,
    pub(super) cbw: RwLock<Option<Arc<CopyBeforeWrite>>>,
    /// The checkpoints' write-intent log (idle without a checkpoint).
    pub(crate) intent: Arc<IntentLog>,
}

/// Ends an operation's stay in `in_flight`, also when it fails.
pub(super) struct InFlight<'a>(&'a AtomicU64);

impl InFlight<'_> {
    /// The epoch parity it is counted in, for `leave`.
    pub(super) fn forget(self, state: &TrackState) -> usize {
        let parity = usize::from(!std::ptr::eq(self.0, &state.in_flight[0]));
        std::mem::forget(self);
        parity
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl TrackState {
    /// Counts an asynchronous operation in (until `leave` with the parity returned), or
    /// refuses it when fenced.
    pub(crate) fn enter_async(&self, op: &'static str) -> Result<usize, BlockError> {
        Ok(self.enter(op)?.forget(self))
    }

    /// Ends an operation counted in by `enter_async`.
    pub(crate) fn leave(&self, parity: usize) {
        self.in_flight[parity].fetch_sub(1, Ordering::SeqCst);
    }

    /// Operations under way, whatever their epoch.
    pub(super) fn in_flight(&self) -> u64 {
        self.in_flight[0].load(Ordering::SeqCst) + self.in_flight[1].load(Ordering::SeqCst)
    }

    pub(super) fn enter(&self, op: &'static str) -> Result<InFlight<'_>, BlockError> {
        let parity = (self.epoch.load(Ordering::SeqCst) & 1) as usize;
        self.in_flight[parity].fetch_add(1, Ordering::SeqCst);
        self.entered.fetch_add(1, Ordering::Relaxed);
        let guard = InFlight(&self.in_flight[parity]);
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

    /// Waits until every operation that entered before this call has finished (those
    /// entering meanwhile are not waited for); gives up after `timeout`.
    pub(super) fn drain_entered(&self, timeout: std::time::Duration) -> Result<(), BlockError> {
        let deadline = std::time::Instant::now() + timeout;
        let wait = |parity: usize| {
            while self.in_flight[parity].load(Ordering::SeqCst) != 0 {
                if std::time::Instant::now() >= deadline {
                    return Err(BlockError::new(
                        BlockErrorKind::Io,
                        format!(
                            "requests to the disk are still in flight after {} s (is the \
                             image's storage answering?)",
                            timeout.as_secs_f64()
                        ),
                    ));
                }
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
            Ok(())
        };
        let now = (self.epoch.load(Ordering::SeqCst) & 1) as usize;
        // Stragglers of an earlier drain that gave up would join the next epoch's count.
        wait(now ^ 1)?;
        self.epoch.fetch_add(1, Ordering::SeqCst);
        wait(now)
    }

    /// The backup's copy-before-write, while one runs.
    pub(super) fn copy_before_write(&self) -> Option<Arc<CopyBeforeWrite>> {
        if !self.copying.load(Ordering::SeqCst) {
            return None;
        }
        self.cbw
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether a modifying request of `len` volume bytes at `offset` must take the
    /// synchronous path to have the backup's old bytes copied first (a few loads otherwise).
    pub(crate) fn needs_copy(&self, offset: u64, len: u64) -> bool {
        self.copy_before_write().is_some_and(|cbw| {
            let (offset, len) = self.file_range(offset, len);
            cbw.needs_copy(offset, len)
        })
    }

    /// Before a modifying request: the backup's old bytes of what it touches go to the
    /// scratch (never an error: a copy that cannot be made fails the backup, not the request).
    pub(crate) fn copy_old(&self, offset: u64, len: u64) {
        if let Some(cbw) = self.copy_before_write() {
            let (offset, len) = self.file_range(offset, len);
            cbw.copy(offset, len);
        }
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
