//! Dirty tracking: which blocks of a disk changed since they were last sent.
//!
//! The bitmap is written by every guest I/O thread and drained by the migration sender at the
//! same time, so it is a plain array of atomic words: setting bits is one `fetch_or` per word
//! and taking them is one `fetch_and` per word, with no lock that could stall guest I/O.

use crate::tracking_queue::TrackingQueue;
use crate::MigrationError;
use cryptblk_block::aio::{open_queue, IoQueue, QueueOptions};
use cryptblk_block::{BlockDevice, BlockError, BlockErrorKind, Extent};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

const WORD_BITS: u64 = 64;

/// A lock-free bitset over `size` bytes in blocks of `granularity` bytes (the last block may be
/// short). Any number of threads may set and take bits concurrently.
#[derive(Debug)]
pub struct DirtyBitmap {
    words: Box<[AtomicU64]>,
    granularity: u64,
    shift: u32,
    size: u64,
    blocks: u64,
    /// Number of set bits. Signed because a drainer may clear (and subtract) a bit before the
    /// setter that raised it has added it; readers clamp the transient negative to zero.
    count: AtomicI64,
}

impl DirtyBitmap {
    /// An all-clear bitmap. `granularity` must be a power of two (at least 1).
    pub fn new(size: u64, granularity: u64) -> Result<Self, MigrationError> {
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(MigrationError::InvalidOptions(format!(
                "dirty granularity {granularity} is not a power of two"
            )));
        }
        let blocks = size.div_ceil(granularity);
        let nwords = usize::try_from(blocks.div_ceil(WORD_BITS)).map_err(|_| {
            MigrationError::InvalidOptions(format!("disk of {size} bytes is too large to track"))
        })?;
        let words = (0..nwords).map(|_| AtomicU64::new(0)).collect();
        Ok(DirtyBitmap {
            words,
            granularity,
            shift: granularity.trailing_zeros(),
            size,
            blocks,
            count: AtomicI64::new(0),
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Number of blocks (bits).
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Number of dirty blocks.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Acquire).max(0) as u64
    }

    /// Bytes covered by the dirty blocks (the short last block counts as a full one; this is
    /// an estimate for convergence decisions, not an exact byte count).
    pub fn dirty_bytes(&self) -> u64 {
        self.count().saturating_mul(self.granularity).min(self.size)
    }

    pub fn is_set(&self, block: u64) -> bool {
        if block >= self.blocks {
            return false;
        }
        let w = &self.words[(block / WORD_BITS) as usize];
        w.load(Ordering::Acquire) & (1 << (block % WORD_BITS)) != 0
    }

    /// Marks every block that `len` bytes at `offset` touch (rounded outwards to the
    /// granularity, clipped to the size: a partial write dirties its whole block).
    pub fn set_range(&self, offset: u64, len: u64) {
        if len == 0 || offset >= self.size {
            return;
        }
        let end = offset.saturating_add(len).min(self.size);
        let first = offset >> self.shift;
        let last = (end - 1) >> self.shift; // inclusive
        self.set_blocks(first, last + 1);
    }

    /// Marks every block.
    pub fn set_all(&self) {
        self.set_blocks(0, self.blocks);
    }

    /// Clears every block (e.g. when a full pass is about to read everything anyway).
    pub fn clear_all(&self) {
        for w in self.words.iter() {
            let old = w.swap(0, Ordering::AcqRel);
            self.count
                .fetch_sub(i64::from(old.count_ones()), Ordering::AcqRel);
        }
    }

    fn set_blocks(&self, start: u64, end: u64) {
        let mut b = start;
        while b < end {
            let bit = b % WORD_BITS;
            let n = (WORD_BITS - bit).min(end - b);
            let mask = low_mask(n) << bit;
            let old = self.words[(b / WORD_BITS) as usize].fetch_or(mask, Ordering::AcqRel);
            let newly = (mask & !old).count_ones();
            if newly != 0 {
                self.count.fetch_add(i64::from(newly), Ordering::AcqRel);
            }
            b += n;
        }
    }

    /// Finds the first dirty block at or after `start_block` and atomically takes (clears) the
    /// contiguous run of dirty blocks beginning there, at most `max_blocks` long. Returns
    /// `(first_block, block_count)`. A block set again after it was taken stays dirty for the
    /// next call, which is what makes resending correct: the caller reads the data only after
    /// taking the bits, so it sees every write that set them.
    pub fn take_next_run(&self, start_block: u64, max_blocks: u64) -> Option<(u64, u64)> {
        if max_blocks == 0 {
            return None;
        }
        let first = self.find_next_set(start_block)?;
        let mut taken = 0u64;
        let mut b = first;
        while taken < max_blocks && b < self.blocks {
            let bit = b % WORD_BITS;
            let word = &self.words[(b / WORD_BITS) as usize];
            let cur = word.load(Ordering::Acquire);
            let ones = u64::from((cur >> bit).trailing_ones()).min(max_blocks - taken);
            let ones = ones.min(self.blocks - b);
            if ones == 0 {
                break;
            }
            let mask = low_mask(ones) << bit;
            let old = word.fetch_and(!mask, Ordering::AcqRel);
            let got = old & mask;
            // Only a concurrent drainer can clear bits; the contiguous prefix of what we really
            // took is ours to return, and anything we cleared beyond a gap must be put back so
            // no dirty block is ever lost.
            let prefix = u64::from((got >> bit).trailing_ones());
            let ours = low_mask(prefix) << bit;
            let give_back = got & !ours;
            if give_back != 0 {
                word.fetch_or(give_back, Ordering::AcqRel);
            }
            if prefix != 0 {
                self.count.fetch_sub(prefix as i64, Ordering::AcqRel);
            }
            if prefix == 0 && taken == 0 {
                // Raced with another drainer for the very first bit: look further on.
                return self.take_next_run(b + 1, max_blocks);
            }
            taken += prefix;
            b += prefix;
            if prefix < ones || (b % WORD_BITS) != 0 {
                break;
            }
        }
        if taken == 0 {
            None
        } else {
            Some((first, taken))
        }
    }

    fn find_next_set(&self, start_block: u64) -> Option<u64> {
        if start_block >= self.blocks {
            return None;
        }
        let mut wi = (start_block / WORD_BITS) as usize;
        let mut v = self.words[wi].load(Ordering::Acquire) & !low_mask(start_block % WORD_BITS);
        loop {
            if v != 0 {
                let b = wi as u64 * WORD_BITS + u64::from(v.trailing_zeros());
                return (b < self.blocks).then_some(b);
            }
            wi += 1;
            if wi >= self.words.len() {
                return None;
            }
            v = self.words[wi].load(Ordering::Acquire);
        }
    }

    /// Clears every block that `len` bytes at `offset` touch.
    pub fn clear_range(&self, offset: u64, len: u64) {
        if len == 0 || offset >= self.size {
            return;
        }
        let end = offset.saturating_add(len).min(self.size);
        let (start, end) = (offset >> self.shift, ((end - 1) >> self.shift) + 1);
        let mut b = start;
        while b < end {
            let bit = b % WORD_BITS;
            let n = (WORD_BITS - bit).min(end - b);
            let mask = low_mask(n) << bit;
            let old = self.words[(b / WORD_BITS) as usize].fetch_and(!mask, Ordering::AcqRel);
            let cleared = (mask & old).count_ones();
            if cleared != 0 {
                self.count.fetch_sub(i64::from(cleared), Ordering::AcqRel);
            }
            b += n;
        }
    }

    /// Whether every block that `len` bytes at `offset` touch is set (true for an empty range).
    pub fn all_set(&self, offset: u64, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return true;
        }
        let (first, last) = (offset >> self.shift, (end - 1) >> self.shift);
        self.next_run(first, false).is_none_or(|(b, _)| b > last)
    }

    /// The next run of blocks at or after `start_block` whose bit equals `value`, without
    /// changing anything: `(first_block, block_count)`. For walking a bitmap that is not being
    /// drained concurrently (a snapshot's worth of accuracy is all it gives otherwise).
    pub fn next_run(&self, start_block: u64, value: bool) -> Option<(u64, u64)> {
        let word_of = |b: u64| {
            let w = self.words[(b / WORD_BITS) as usize].load(Ordering::Acquire);
            if value {
                w
            } else {
                !w
            }
        };
        let mut b = start_block;
        // Find the first block with the value.
        loop {
            if b >= self.blocks {
                return None;
            }
            let w = word_of(b) >> (b % WORD_BITS);
            if w != 0 {
                b += u64::from(w.trailing_zeros());
                break;
            }
            b = (b / WORD_BITS + 1) * WORD_BITS;
        }
        if b >= self.blocks {
            return None;
        }
        let first = b;
        // Extend while the value holds.
        loop {
            let w = word_of(b) >> (b % WORD_BITS);
            let ones = u64::from(w.trailing_ones()).min(WORD_BITS - b % WORD_BITS);
            b += ones;
            if b >= self.blocks {
                return Some((first, self.blocks - first));
            }
            if ones == 0 {
                return Some((first, b - first));
            }
            if !b.is_multiple_of(WORD_BITS) {
                return Some((first, b - first));
            }
        }
    }

    /// Byte range `(offset, len)` of `count` blocks from `first` (the last block may be short).
    pub fn block_range(&self, first: u64, count: u64) -> (u64, u64) {
        let off = first << self.shift;
        let end = ((first + count) << self.shift).min(self.size);
        (off, end - off)
    }
}

/// `n` low bits set (n <= 64).
fn low_mask(n: u64) -> u64 {
    if n >= WORD_BITS {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

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

/// The tracker's state, shared with the asynchronous queues opened through it.
pub(crate) struct TrackState {
    bitmap: OnceLock<DirtyBitmap>,
    granularity: u64,
    payload_offset: u64,
    tracking: AtomicBool,
    fenced: AtomicBool,
    /// Operations between their fence check and their completion.
    in_flight: AtomicU64,
}

impl std::fmt::Debug for DirtyTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirtyTracker")
            .field("size", &self.inner.size())
            .field("granularity", &self.state.granularity)
            .field("payload_offset", &self.state.payload_offset)
            .field("tracking", &self.is_tracking())
            .field("fenced", &self.is_fenced())
            .field(
                "dirty_blocks",
                &self.state.bitmap.get().map(DirtyBitmap::count),
            )
            .finish()
    }
}

/// Ends an operation's stay in `in_flight`, also when it fails.
struct InFlight<'a>(&'a AtomicU64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
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
    ) -> Result<Self, MigrationError> {
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(MigrationError::InvalidOptions(format!(
                "dirty granularity {granularity} is not a power of two"
            )));
        }
        if !payload_offset.is_multiple_of(granularity) {
            return Err(MigrationError::InvalidOptions(format!(
                "the payload offset {payload_offset} is not a multiple of the {granularity}-byte \
                 dirty granularity"
            )));
        }
        Ok(DirtyTracker {
            inner,
            state: Arc::new(TrackState {
                bitmap: OnceLock::new(),
                granularity,
                payload_offset,
                tracking: AtomicBool::new(false),
                fenced: AtomicBool::new(false),
                in_flight: AtomicU64::new(0),
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

    pub fn payload_offset(&self) -> u64 {
        self.state.payload_offset
    }

    /// Marks every block dirty (the first pass has to send everything) and turns tracking on.
    /// Call it before the first pass starts reading: a write that completes before this is
    /// read by that pass, one that completes after it is marked again.
    pub fn start_tracking(&self) -> Result<&DirtyBitmap, MigrationError> {
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
        while self.state.in_flight.load(Ordering::SeqCst) != 0 {
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

    /// The image-file range holding the ciphertext of `len` plaintext bytes at `offset`.
    pub fn file_range(&self, offset: u64, len: u64) -> (u64, u64) {
        (offset + self.state.payload_offset, len)
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

    fn enter(&self, op: &'static str) -> Result<InFlight<'_>, BlockError> {
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
        let res = self.inner.discard(offset, len);
        self.state.mark(offset, len);
        res
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        self.inner.block_status(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        let _op = self.state.enter("write zeroes")?;
        let res = self.inner.write_zeroes(offset, len);
        self.state.mark(offset, len);
        res
    }
    /// The wrapped device's queue behind a `TrackingQueue`: the same fence and dirty
    /// marking, on the asynchronous path.
    fn native_queue(&self, opts: &QueueOptions) -> Option<Result<Box<dyn IoQueue>, BlockError>> {
        Some(
            open_queue(&self.inner, opts)
                .and_then(|inner| TrackingQueue::new(inner, self.state.clone()))
                .map(|queue| Box::new(queue) as Box<dyn IoQueue>),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One sweep taking every dirty run as byte ranges of at most `max_run_bytes`, as the
    /// sender does.
    fn drain(bm: &DirtyBitmap, max_run_bytes: u64) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut next = 0;
        while let Some((first, count)) = bm.take_next_run(next, max_run_bytes / bm.granularity()) {
            runs.push(bm.block_range(first, count));
            next = first + count;
        }
        runs
    }

    #[test]
    fn set_and_drain_runs() {
        let bm = DirtyBitmap::new(1000 * 512 + 100, 512).unwrap();
        assert_eq!(bm.blocks(), 1001);
        bm.set_range(10, 1); // block 0
        bm.set_range(512 * 60, 512 * 10); // blocks 60..70, crosses a word boundary
        bm.set_range(1000 * 512, 50); // last, short block
        assert_eq!(bm.count(), 12);
        let runs = drain(&bm, 1 << 20);
        assert_eq!(
            runs,
            vec![(0, 512), (60 * 512, 10 * 512), (1000 * 512, 100)]
        );
        assert_eq!(bm.count(), 0);
        assert!(drain(&bm, 1 << 20).is_empty());
    }

    #[test]
    fn runs_are_capped_and_rounded_outwards() {
        let bm = DirtyBitmap::new(1 << 20, 4096).unwrap();
        bm.set_range(4095, 2); // touches blocks 0 and 1
        assert!(bm.is_set(0) && bm.is_set(1) && !bm.is_set(2));
        bm.set_all();
        assert_eq!(bm.count(), 256);
        let runs = drain(&bm, 64 * 4096);
        assert_eq!(runs.len(), 4);
        assert!(runs.iter().all(|&(_, l)| l == 64 * 4096));
        assert_eq!(bm.count(), 0);
    }

    #[test]
    fn concurrent_set_and_take_lose_nothing() {
        let bm = Arc::new(DirtyBitmap::new(64 * 4096 * 8, 4096).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let setters: Vec<_> = (0..4)
            .map(|t| {
                let bm = bm.clone();
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        let block = (i * 7 + t * 13) % bm.blocks();
                        bm.set_range(block * 4096, 4096);
                    }
                })
            })
            .collect();
        let drainer = {
            let (bm, stop) = (bm.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    n += drain(&bm, 1 << 20).len() as u64;
                }
                n
            })
        };
        for s in setters {
            s.join().unwrap();
        }
        stop.store(true, Ordering::SeqCst);
        drainer.join().unwrap();
        // Whatever the drainer did not take is still set, and the count agrees with the bits.
        let set = (0..bm.blocks()).filter(|&b| bm.is_set(b)).count() as u64;
        assert_eq!(set, bm.count());
    }

    #[test]
    fn next_run_finds_runs_of_either_value_across_words() {
        let bm = DirtyBitmap::new(300 * 512, 512).unwrap();
        bm.set_range(10 * 512, 118 * 512); // blocks 10..128: ends exactly on a word boundary
        bm.set_range(200 * 512, 100 * 512); // 200..300: the end of the bitmap
        assert_eq!(bm.next_run(0, true), Some((10, 118)));
        assert_eq!(bm.next_run(0, false), Some((0, 10)));
        assert_eq!(bm.next_run(128, false), Some((128, 72)));
        assert_eq!(bm.next_run(128, true), Some((200, 100)));
        assert_eq!(bm.next_run(300, true), None);
        assert!(bm.all_set(10 * 512, 118 * 512) && !bm.all_set(9 * 512, 2));
        bm.clear_range(250 * 512, 1);
        assert_eq!(bm.next_run(200, true), Some((200, 50)));
        assert_eq!(bm.count(), 118 + 99);
    }

    #[test]
    fn rejects_bad_granularity() {
        assert!(DirtyBitmap::new(100, 0).is_err());
        assert!(DirtyBitmap::new(100, 3000).is_err());
    }
}
