//! `DirtyTracker`: a disk whose modified ranges are recorded while a migration runs, and that
//! can be fenced at switchover.

use super::checkpoint_stage::{CheckpointStage, RecordingPath};
use super::stage::TrackingStage;
use super::state::TrackState;
use super::CopyBeforeWrite;
use super::DirtyBitmap;
use super::TrackingError;
use crate::checkpoint::IntentLog;
use cryptblk_block::aio::{IoQueue, Pipeline, QueueOptions};
use cryptblk_block::open_pipeline;
use cryptblk_block::{BlockDevice, BlockError, Extent};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// A `BlockDevice` wrapper that records, while tracking is on, every range written or
/// discarded through it, so the migration sender can resend what changed after it was sent;
/// and that can be *fenced* at switchover, so that nothing changes the disk any more while
/// the last of it is sent.
///
/// The bitmap covers the wrapped (plaintext) device; [`DirtyTracker::file_range`] maps a range
/// to the image file that is actually migrated, by adding `payload_offset` (the LUKS data
/// offset; 0 for a raw image). Encryption is sector-local, so plaintext sector N is exactly the
/// ciphertext at `payload_offset + N * sector` and the mapping needs nothing else.
///
/// The bitmap (one bit per `granularity` bytes) is allocated by the first
/// [`start_tracking`](DirtyTracker::start_tracking), so a disk that never migrates never pays
/// for it.
pub struct DirtyTracker {
    inner: Arc<dyn BlockDevice>,
    state: Arc<TrackState>,
}

impl std::fmt::Debug for DirtyTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirtyTracker")
            .field("size", &self.inner.size())
            .field("granularity", &self.state.granularity)
            .field("payload_offset", &self.payload_offset())
            .field("tracking", &self.is_tracking())
            .field("fenced", &self.is_fenced())
            .field(
                "dirty_blocks",
                &self.state.bitmap.get().map(DirtyBitmap::count),
            )
            .finish()
    }
}

impl DirtyTracker {
    /// Wraps `inner`; dirty blocks will be `granularity` bytes (a power of two; use the
    /// encryption sector size, or a multiple of it to save memory at the cost of resending
    /// more). Tracking starts off.
    pub fn new(
        inner: Arc<dyn BlockDevice>,
        payload_offset: u64,
        granularity: u64,
    ) -> Result<Self, TrackingError> {
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(TrackingError(format!(
                "dirty granularity {granularity} is not a power of two"
            )));
        }
        if !payload_offset.is_multiple_of(granularity) {
            return Err(TrackingError(format!(
                "the payload offset {payload_offset} is not a multiple of the {granularity}-byte \
                 dirty granularity"
            )));
        }
        Ok(DirtyTracker {
            inner,
            state: Arc::new(TrackState {
                bitmap: OnceLock::new(),
                granularity,
                payload_offset: AtomicU64::new(payload_offset),
                tracking: AtomicBool::new(false),
                fenced: AtomicBool::new(false),
                in_flight: [AtomicU64::new(0), AtomicU64::new(0)],
                epoch: AtomicU64::new(0),
                entered: AtomicU64::new(0),
                copying: AtomicBool::new(false),
                cbw: std::sync::RwLock::new(None),
                intent: Arc::new(IntentLog::default()),
            }),
        })
    }

    pub fn inner(&self) -> &Arc<dyn BlockDevice> {
        &self.inner
    }

    /// The bitmap, once tracking was started at least once.
    pub fn bitmap(&self) -> Option<&DirtyBitmap> {
        self.state.bitmap.get()
    }

    pub fn granularity(&self) -> u64 {
        self.state.granularity
    }

    /// The checkpoints' write-intent log every modifying request passes (a
    /// [`CheckpointStore`](crate::CheckpointStore) opened with it records through it).
    pub fn intent_log(&self) -> &Arc<IntentLog> {
        &self.state.intent
    }

    pub fn payload_offset(&self) -> u64 {
        self.state.payload_offset.load(Ordering::Acquire)
    }

    /// Moves the payload to `offset` bytes into the image file: a raw disk encrypted in place
    /// now has its data behind a LUKS2 header. Refused while tracking (a migration copies the
    /// file by these offsets) and off the dirty granularity.
    pub fn set_payload_offset(&self, offset: u64) -> Result<(), TrackingError> {
        if self.is_tracking() {
            return Err(TrackingError(
                "the payload cannot move while a migration tracks the disk".into(),
            ));
        }
        if !offset.is_multiple_of(self.state.granularity) {
            return Err(TrackingError(format!(
                "the payload offset {offset} is not a multiple of the {}-byte dirty granularity",
                self.state.granularity
            )));
        }
        // Every byte of the image moves: each checkpoint counts all of it changed.
        self.state
            .intent
            .record_all()
            .map_err(|e| TrackingError(format!("recording the move in the checkpoint log: {e}")))?;
        self.state.payload_offset.store(offset, Ordering::Release);
        Ok(())
    }

    /// Marks every block dirty (the first pass has to send everything) and turns tracking on.
    /// Call it before the first pass starts reading: a write that completes before this is
    /// read by that pass, one that completes after it is marked again.
    pub fn start_tracking(&self) -> Result<&DirtyBitmap, TrackingError> {
        let bitmap = match self.state.bitmap.get() {
            Some(b) => b,
            None => {
                let b = DirtyBitmap::new(self.inner.size(), self.state.granularity)?;
                let _ = self.state.bitmap.set(b);
                self.state.bitmap.get().expect("just set")
            }
        };
        bitmap.set_all();
        self.state.tracking.store(true, Ordering::SeqCst);
        Ok(bitmap)
    }

    /// Turns tracking off (the bitmap keeps what it has), e.g. when a migration is cancelled.
    pub fn stop_tracking(&self) {
        self.state.tracking.store(false, Ordering::SeqCst);
    }

    pub fn is_tracking(&self) -> bool {
        self.state.tracking.load(Ordering::SeqCst)
    }

    /// Makes every later operation fail, then waits until the operations already under way
    /// have finished (and marked what they wrote). After it returns the disk does not change
    /// any more: what the bitmap says is dirty is all that is left to send.
    pub fn fence(&self) {
        self.state.fenced.store(true, Ordering::SeqCst);
        while self.state.in_flight() != 0 {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }

    /// Lets operations through again (a migration that failed before the destination took
    /// over: the source carries on).
    pub fn unfence(&self) {
        self.state.fenced.store(false, Ordering::SeqCst);
    }

    pub fn is_fenced(&self) -> bool {
        self.state.fenced.load(Ordering::SeqCst)
    }

    /// Starts copy-before-write for a backup: from when this returns, every write, discard or
    /// write-zeroes through this tracker (its own methods and every queue opened on it) first
    /// copies the old bytes of the image regions it changes to `cbw`'s scratch, so a
    /// [`BackupView`](super::BackupView) over `cbw` keeps reading the image as it is now.
    /// Waits for the requests already under way (they could not copy); gives up, undoing
    /// it, after `timeout`.
    pub fn start_copy_before_write(
        &self,
        cbw: Arc<CopyBeforeWrite>,
        timeout: std::time::Duration,
    ) -> Result<(), BlockError> {
        {
            let mut slot = self
                .state
                .cbw
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if slot.is_some() {
                return Err(BlockError::new(
                    cryptblk_block::BlockErrorKind::Unsupported,
                    "a backup's copy-before-write already runs on this disk",
                ));
            }
            *slot = Some(cbw);
        }
        self.state.copying.store(true, Ordering::SeqCst);
        // A request that entered before this saw no copy-before-write and may still write.
        self.state.drain_entered(timeout).inspect_err(|_| {
            self.stop_copy_before_write();
        })
    }

    /// How busy the disk's own users (its VM, its NBD clients) are, for a backup that yields to
    /// them.
    pub fn activity(&self) -> super::GuestActivity {
        super::GuestActivity::of(self.state.clone())
    }

    /// Ends copy-before-write (the backup ended): writes pass without a copy again.
    pub fn stop_copy_before_write(&self) {
        self.state.copying.store(false, Ordering::SeqCst);
        self.state
            .cbw
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
    }

    /// The image-file range holding the ciphertext of `len` plaintext bytes at `offset`.
    pub fn file_range(&self, offset: u64, len: u64) -> (u64, u64) {
        (offset + self.payload_offset(), len)
    }
}

impl BlockDevice for DirtyTracker {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        let _op = self.state.enter("read")?;
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        let _op = self.state.enter("write")?;
        self.state.record("write", offset, buf.len() as u64)?;
        self.state.copy_old(offset, buf.len() as u64);
        let res = self.inner.write_at(buf, offset);
        self.state.mark(offset, buf.len() as u64);
        res
    }
    fn flush(&self) -> Result<(), BlockError> {
        let _op = self.state.enter("flush")?;
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        let _op = self.state.enter("discard")?;
        self.state.record("discard", offset, len)?;
        self.state.copy_old(offset, len);
        let res = self.inner.discard(offset, len);
        self.state.mark(offset, len);
        res
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        self.inner.block_status(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        let _op = self.state.enter("write zeroes")?;
        self.state.record("write zeroes", offset, len)?;
        self.state.copy_old(offset, len);
        let res = self.inner.write_zeroes(offset, len);
        self.state.mark(offset, len);
        res
    }
    /// The wrapped device's pipeline with the tracking and checkpoint stages in front: the
    /// same fence, dirty marking and write-intent log, on the asynchronous path. The
    /// checkpoint stage sends a write whose region is not recorded yet to the synchronous
    /// path, which records it first: the wrapped device's own methods behind the log (the
    /// stages behind see the volume's offsets, as they do).
    fn pipeline(&self, opts: &QueueOptions) -> Option<Result<Pipeline, BlockError>> {
        Some(open_pipeline(&self.inner, opts).map(|mut pipeline| {
            let capacity = pipeline.capacity();
            pipeline.push_front(Box::new(CheckpointStage::new(self.state.clone(), capacity)));
            pipeline.push_front(Box::new(TrackingStage::new(self.state.clone(), capacity)));
            pipeline.set_sync_path(Arc::new(RecordingPath {
                state: self.state.clone(),
                inner: self.inner.clone(),
            }));
            pipeline
        }))
    }
}
