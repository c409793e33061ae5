//! One blocking `crypt` call shared between its caller and helper workers.
//!
//! The run is cut into sector-aligned chunks that the caller and any helpers claim one at a
//! time from an atomic counter. The caller starts at once and never waits for a helper to be
//! scheduled: a helper that wakes late finds fewer (or no) chunks left. So handing out help
//! costs the caller little more than the wake-up messages, even on a busy or virtualised host
//! where waking a thread takes tens of microseconds.

use crate::{CryptoError, Direction, SectorCipher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

pub(super) struct Split {
    cipher: Arc<dyn SectorCipher>,
    dir: Direction,
    first_sector: u64,
    sector_size: usize,
    /// Where chunks are read from when the transform is out of place; null when in place.
    src: *const u8,
    base: *mut u8,
    len: usize,
    chunk: usize,
    chunks: usize,
    next: AtomicUsize,
    progress: Mutex<Progress>,
    all_done: Condvar,
}

struct Progress {
    done: usize,
    error: Option<CryptoError>,
}

// SAFETY: `base..base+len` (and `src..src+len`, when not null) are ranges that the caller of
// the `crypt_raw` call owning this `Split` vouched for until it returns, and that call does
// not touch them while helpers may run. Each chunk index is claimed by exactly one
// thread (atomic `fetch_add`), so no two threads ever access the same bytes, and the caller does
// not return before every chunk has been processed (`wait`, also on unwind via `WaitOnDrop`).
// Helpers that arrive afterwards claim an index past the end and never dereference `base`.
unsafe impl Send for Split {}
// SAFETY: as for `Send`; the shared parts are an atomic, a mutex and a condvar.
unsafe impl Sync for Split {}

impl Split {
    /// Splits the `len` bytes at `dst` into `chunk`-byte pieces (a multiple of the sector
    /// size). With a non-null `src` (also `len` bytes), each piece is transformed from `src`
    /// into `dst`; otherwise in place.
    ///
    /// # Safety
    /// As `SectorCipher::crypt_raw` for `src`/`dst`/`len`, until `wait` has returned.
    pub(super) unsafe fn new(
        cipher: Arc<dyn SectorCipher>,
        dir: Direction,
        first_sector: u64,
        src: *const u8,
        dst: *mut u8,
        len: usize,
        chunk: usize,
    ) -> Self {
        let sector_size = cipher.sector_size();
        let chunk = chunk.max(sector_size);
        Split {
            cipher,
            dir,
            first_sector,
            sector_size,
            src,
            base: dst,
            len,
            chunk,
            chunks: len.div_ceil(chunk),
            next: AtomicUsize::new(0),
            progress: Mutex::new(Progress {
                done: 0,
                error: None,
            }),
            all_done: Condvar::new(),
        }
    }

    pub(super) fn chunks(&self) -> usize {
        self.chunks
    }

    fn lock(&self) -> MutexGuard<'_, Progress> {
        // Two plain fields, consistent even if a holder panicked; refusing would hang callers.
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Claims and transforms chunks until none are left.
    pub(super) fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.chunks {
                return;
            }
            let start = i * self.chunk;
            let len = self.chunk.min(self.len - start);
            let sector = self
                .first_sector
                .wrapping_add((start / self.sector_size) as u64);
            let result = catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: chunk `i` was claimed by this thread alone and lies inside the lent
                // ranges (`start + len <= self.len` because `i < chunks`); see `unsafe impl
                // Send`. In place, the source is the destination chunk itself.
                unsafe {
                    let dst = self.base.add(start);
                    let src = if self.src.is_null() {
                        dst.cast_const()
                    } else {
                        self.src.add(start)
                    };
                    self.cipher.crypt_raw(self.dir, sector, src, dst, len)
                }
            }))
            .unwrap_or_else(|_| Err(CryptoError::Worker("sector cipher panicked".into())));
            // The mutex orders this chunk's writes before the caller's return from `wait`.
            let mut p = self.lock();
            if let Err(e) = result {
                p.error.get_or_insert(e);
            }
            p.done += 1;
            if p.done == self.chunks {
                self.all_done.notify_all();
            }
        }
    }

    /// Blocks until every chunk is done; returns the first error.
    pub(super) fn wait(&self) -> Option<CryptoError> {
        let mut p = self.lock();
        while p.done < self.chunks {
            p = self.all_done.wait(p).unwrap_or_else(|e| e.into_inner());
        }
        p.error.take()
    }
}

/// Waits for all chunks when dropped, so that even an unwinding caller cannot release the
/// borrowed buffer while a helper still writes into it.
pub(super) struct WaitOnDrop(pub(super) Arc<Split>);

impl Drop for WaitOnDrop {
    fn drop(&mut self) {
        self.0.wait();
    }
}
