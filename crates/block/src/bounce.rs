//! Reusable bounce buffers for encrypted writes, so that the write path does not allocate per
//! request. The free lists' locks are held only to pop or push a buffer, never across I/O.
//! Buffers are aligned so that a backend doing direct I/O can DMA straight from them.
//!
//! Two size classes: small writes (the common 4-128 KiB) are many at once and each would
//! otherwise fault in and clear a large buffer, so many small buffers are kept; a few large
//! ones serve the rare big writes. A request never allocates while a kept buffer of its
//! class is free, and what is kept is bounded (`SMALL * small_kept() + large * large_kept`).

use crate::aligned::AlignedBuf;
use std::sync::{Mutex, MutexGuard};

/// Capacity of a small buffer.
const SMALL: usize = 128 * 1024;

/// Small buffers kept for reuse: about the number of threads that write at once (frontends
/// run two to four per core: submission pools, queue threads, NBD connection workers), so
/// that a burst of concurrent writes does not allocate. At most 8 MiB per disk.
fn small_kept() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (4 * cores).clamp(16, 64)
}

pub(crate) struct BouncePool {
    small: SizeClass,
    large: SizeClass,
}

struct SizeClass {
    capacity: usize,
    /// Buffers kept for reuse; more than this are freed when returned.
    max_free: usize,
    free: Mutex<Vec<AlignedBuf>>,
}

impl SizeClass {
    fn new(capacity: usize, max_free: usize) -> Self {
        SizeClass {
            capacity,
            max_free,
            free: Mutex::new(Vec::new()),
        }
    }
}

impl BouncePool {
    /// Large buffers hold `large` bytes (the most a caller asks for at once); `large_kept` of
    /// them are kept for reuse.
    pub(crate) fn new(large: usize, large_kept: usize) -> Self {
        BouncePool {
            small: SizeClass::new(SMALL.min(large), small_kept()),
            large: SizeClass::new(large, large_kept),
        }
    }

    fn class_for(&self, len: usize) -> Option<&SizeClass> {
        if len <= self.small.capacity {
            Some(&self.small)
        } else if len <= self.large.capacity {
            Some(&self.large)
        } else {
            None
        }
    }

    /// A buffer of `len` bytes whose contents are unspecified (whatever a previous user left:
    /// callers overwrite all of it). A `len` above the large capacity gets a one-off buffer.
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
        let class = [&self.small, &self.large]
            .into_iter()
            .find(|c| c.capacity == buf.len());
        if let Some(class) = class {
            let mut free = lock(&class.free);
            if free.len() < class.max_free {
                free.push(buf);
            }
        }
    }

    #[cfg(test)]
    fn free_len(&self) -> (usize, usize) {
        (lock(&self.small.free).len(), lock(&self.large.free).len())
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
            let b = pool.take(SMALL);
            let c = pool.take(SMALL + 1);
            let d = pool.take(1 << 20);
            let e = pool.take((1 << 20) + 1);
            assert_eq!(
                (&a[..], b.len(), c.len(), d.len(), e.len()),
                (&[1u8; 10][..], SMALL, SMALL + 1, 1 << 20, (1 << 20) + 1)
            );
        }
        // Both small buffers kept; one large kept (limit 1); the oversized one freed.
        assert_eq!(pool.free_len(), (2, 1));
        let f = pool.take(3);
        assert_eq!(f.len(), 3);
        assert_eq!(pool.free_len(), (1, 1));
    }

    #[test]
    fn small_class_is_capped() {
        let pool = BouncePool::new(1 << 20, 1);
        let held: Vec<_> = (0..small_kept() + 5).map(|_| pool.take(4096)).collect();
        drop(held);
        assert_eq!(pool.free_len(), (small_kept(), 0));
    }
}
