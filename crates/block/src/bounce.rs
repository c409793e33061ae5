//! Reusable bounce buffers for encrypted writes, so that the write path does not allocate per
//! request. The free list's lock is held only to pop or push a buffer, never across I/O.
//! Buffers are aligned so that a backend doing direct I/O can DMA straight from them.

use crate::aligned::AlignedBuf;
use std::sync::{Mutex, MutexGuard};

pub(crate) struct BouncePool {
    free: Mutex<Vec<AlignedBuf>>,
    /// Buffers kept for reuse; more than this are freed when returned.
    max_free: usize,
    capacity: usize,
}

impl BouncePool {
    pub(crate) fn new(capacity: usize, max_free: usize) -> Self {
        BouncePool {
            free: Mutex::new(Vec::new()),
            max_free,
            capacity,
        }
    }

    /// A buffer holding a copy of `src` (callers pass at most `capacity` bytes; a larger `src`
    /// gets a one-off buffer that is not kept).
    pub(crate) fn take_copy(&self, src: &[u8]) -> Bounce<'_> {
        let pooled = if src.len() <= self.capacity {
            lock(&self.free).pop()
        } else {
            None
        };
        let mut buf = pooled.unwrap_or_else(|| AlignedBuf::zeroed(self.capacity.max(src.len())));
        buf[..src.len()].copy_from_slice(src);
        Bounce {
            pool: self,
            buf: Some(buf),
            len: src.len(),
        }
    }

    #[cfg(test)]
    fn free_len(&self) -> usize {
        lock(&self.free).len()
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
        let Some(buf) = self.buf.take() else { return };
        // One-off oversized buffers are not kept.
        if buf.len() != self.pool.capacity {
            return;
        }
        let mut free = lock(&self.pool.free);
        if free.len() < self.pool.max_free {
            free.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_bounded() {
        let pool = BouncePool::new(64, 2);
        {
            let a = pool.take_copy(&[1; 10]);
            let b = pool.take_copy(&[2; 64]);
            let c = pool.take_copy(&[3; 5]);
            assert_eq!(
                (&a[..], b.len(), &c[..]),
                (&[1u8; 10][..], 64, &[3u8; 5][..])
            );
        }
        assert_eq!(pool.free_len(), 2);
        let d = pool.take_copy(&[4; 3]);
        assert_eq!(&d[..], &[4, 4, 4]);
        assert_eq!(pool.free_len(), 1);
    }
}
