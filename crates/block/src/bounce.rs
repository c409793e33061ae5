//! Reusable bounce buffers for encrypted writes, so that the write path does not allocate per
//! request. The free lists' locks are held only to pop or push a buffer, never across I/O.
//! Buffers are aligned so that a backend doing direct I/O can DMA straight from them.
//!
//! Size classes from 4 KiB to the largest write chunk, each power of four: an asynchronous
//! queue keeps as many writes in flight as the guest queues (up to a virtqueue's size), so a
//! 4 KiB write must not take a 128 KiB buffer, and a class keeps as many buffers as a budget of
//! `CLASS_BUDGET` bytes allows (512 of 4 KiB, 2 of 1 MiB). A request never allocates while a
//! kept buffer of its class is free, and what is kept is bounded (`CLASS_BUDGET` per class).

use crate::aligned::AlignedBuf;
use std::sync::{Mutex, MutexGuard};

/// Smallest class.
const MIN_CLASS: usize = 4096;
/// Bytes of free buffers each class keeps at most.
const CLASS_BUDGET: usize = 2 << 20;

pub(crate) struct BouncePool {
    /// Capacities MIN_CLASS, 4 x MIN_CLASS, ... up to the largest (the write chunk).
    classes: Vec<SizeClass>,
}

struct SizeClass {
    capacity: usize,
    /// Buffers kept for reuse; more than this are freed when returned.
    max_free: usize,
    free: Mutex<Vec<AlignedBuf>>,
}

impl BouncePool {
    /// Buffers up to `largest` bytes (the most a caller asks for at once); of that largest
    /// class at least `largest_kept` are kept.
    pub(crate) fn new(largest: usize, largest_kept: usize) -> Self {
        let mut classes = Vec::new();
        let mut capacity = MIN_CLASS.min(largest);
        loop {
            let last = capacity >= largest;
            let capacity_here = if last { largest } else { capacity };
            let kept = (CLASS_BUDGET / capacity_here).max(if last { largest_kept } else { 1 });
            classes.push(SizeClass {
                capacity: capacity_here,
                max_free: kept,
                free: Mutex::new(Vec::new()),
            });
            if last {
                break;
            }
            capacity *= 4;
        }
        BouncePool { classes }
    }

    fn class_for(&self, len: usize) -> Option<&SizeClass> {
        self.classes.iter().find(|c| len <= c.capacity)
    }

    /// A buffer of `len` bytes whose contents are unspecified (whatever a previous user left:
    /// callers overwrite all of it). A `len` above the largest class gets a one-off buffer.
    pub(crate) fn take(&self, len: usize) -> Bounce<'_> {
        Bounce {
            pool: self,
            buf: Some(self.take_owned(len)),
            len,
        }
    }

    /// Like `take`, for a holder that cannot borrow the pool (a request in flight on an
    /// asynchronous queue): the buffer (at least `len` bytes) goes back with `put_back`.
    pub(crate) fn take_owned(&self, len: usize) -> AlignedBuf {
        let class = self.class_for(len);
        class
            .and_then(|c| lock(&c.free).pop())
            .unwrap_or_else(|| AlignedBuf::zeroed(class.map_or(len, |c| c.capacity)))
    }

    /// Returns a buffer from `take_owned`; one-off oversized buffers are freed.
    pub(crate) fn put_back(&self, buf: AlignedBuf) {
        if let Some(class) = self.classes.iter().find(|c| c.capacity == buf.len()) {
            let mut free = lock(&class.free);
            if free.len() < class.max_free {
                free.push(buf);
            }
        }
    }

    #[cfg(test)]
    fn free_len(&self, capacity: usize) -> usize {
        self.classes
            .iter()
            .find(|c| c.capacity == capacity)
            .map_or(0, |c| lock(&c.free).len())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A free list of plain buffers cannot be left inconsistent by a panicking holder.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A buffer borrowed from a `BouncePool`; returned to it on drop (also on error paths).
pub(crate) struct Bounce<'a> {
    pool: &'a BouncePool,
    /// Always Some until drop hands it back.
    buf: Option<AlignedBuf>,
    len: usize,
}

impl std::ops::Deref for Bounce<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_deref().map_or(&[], |b| &b[..self.len])
    }
}

impl std::ops::DerefMut for Bounce<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        self.buf.as_deref_mut().map_or(&mut [], |b| &mut b[..len])
    }
}

impl Drop for Bounce<'_> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.put_back(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_per_class_and_bounded() {
        let pool = BouncePool::new(1 << 20, 1);
        {
            let mut a = pool.take(10);
            a.fill(1);
            let b = pool.take(4096);
            let c = pool.take(4097);
            let d = pool.take(1 << 20);
            let e = pool.take((1 << 20) + 1);
            assert_eq!(
                (&a[..], b.len(), c.len(), d.len(), e.len()),
                (&[1u8; 10][..], 4096, 4097, 1 << 20, (1 << 20) + 1)
            );
        }
        // Both 4 KiB buffers kept, the 16 KiB one and the 1 MiB one; the oversized one freed.
        assert_eq!(pool.free_len(4096), 2);
        assert_eq!(pool.free_len(16384), 1);
        assert_eq!(pool.free_len(1 << 20), 1);
        let f = pool.take(3);
        assert_eq!(f.len(), 3);
        assert_eq!(pool.free_len(4096), 1);
    }

    #[test]
    fn each_class_keeps_what_its_budget_allows() {
        let pool = BouncePool::new(1 << 20, 1);
        let held: Vec<_> = (0..600).map(|_| pool.take(4096)).collect();
        drop(held);
        assert_eq!(pool.free_len(4096), CLASS_BUDGET / 4096);
        let held: Vec<_> = (0..5).map(|_| pool.take(1 << 20)).collect();
        drop(held);
        assert_eq!(pool.free_len(1 << 20), 2);
    }
}
