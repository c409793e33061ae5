//! Which blocks of a disk changed since they were last sent: a lock-free bitset.
//!
//! The bitmap is written by every guest I/O thread and drained by the migration sender at the
//! same time, so it is a plain array of atomic words: setting bits is one `fetch_or` per word
//! and taking them is one `fetch_and` per word, with no lock that could stall guest I/O.

use super::TrackingError;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

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
    pub fn new(size: u64, granularity: u64) -> Result<Self, TrackingError> {
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(TrackingError(format!(
                "dirty granularity {granularity} is not a power of two"
            )));
        }
        let blocks = size.div_ceil(granularity);
        let nwords = usize::try_from(blocks.div_ceil(WORD_BITS))
            .map_err(|_| TrackingError(format!("disk of {size} bytes is too large to track")))?;
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
        // Only the words of the range: this is asked on every write during a backup or with a
        // checkpoint, so it must not walk the rest of the bitmap (`next_run` would, to measure
        // the run it finds).
        let (mut b, end) = (offset >> self.shift, ((end - 1) >> self.shift) + 1);
        while b < end {
            let bit = b % WORD_BITS;
            let n = (WORD_BITS - bit).min(end - b);
            let mask = low_mask(n) << bit;
            if self.words[(b / WORD_BITS) as usize].load(Ordering::Acquire) & mask != mask {
                return false;
            }
            b += n;
        }
        true
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

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
        assert!(bm.all_set(63 * 512, 2 * 512), "across a word boundary");
        assert!(!bm.all_set(127 * 512, 2 * 512), "block 128 is clear");
        assert!(bm.all_set(200 * 512, 100 * 512) && bm.all_set(299 * 512, 1 << 20));
        assert!(!bm.all_set(0, 300 * 512) && bm.all_set(5, 0));
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
