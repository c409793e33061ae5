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

// SAFETY: `base..base+len` is a `&mut [u8]` (and `src..src+len`, when not null, a `&[u8]`)
// that the `crypt` call owning this `Split` keeps borrowed and does not touch while helpers
// may run. Each chunk index is claimed by exactly one
// thread (atomic `fetch_add`), so no two threads ever access the same bytes, and the caller does
// not return before every chunk has been processed (`wait`, also on unwind via `WaitOnDrop`).
// Helpers that arrive afterwards claim an index past the end and never dereference `base`.
unsafe impl Send for Split {}
// SAFETY: as for `Send`; the shared parts are an atomic, a mutex and a condvar.
unsafe impl Sync for Split {}

impl Split {
    /// Splits `data` into `chunk`-byte pieces (a multiple of the sector size). With `src`
    /// (as long as `data`), each piece is transformed from `src` into `data`; otherwise in
    /// place.
    pub(super) fn new(
        cipher: Arc<dyn SectorCipher>,
        dir: Direction,
        first_sector: u64,
        src: Option<&[u8]>,
        data: &mut [u8],
        chunk: usize,
    ) -> Self {
        // Chunks read `src` at the offsets they write `data`: a shorter source would be read
        // out of bounds.
        assert!(src.is_none_or(|s| s.len() == data.len()));
        let sector_size = cipher.sector_size();
        let chunk = chunk.max(sector_size);
        Split {
            cipher,
            dir,
            first_sector,
            sector_size,
            src: src.map_or(std::ptr::null(), <[u8]>::as_ptr),
            base: data.as_mut_ptr(),
            len: data.len(),
            chunk,
            chunks: data.len().div_ceil(chunk),
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
                // buffer (`start < len` because `i < chunks`); see `unsafe impl Send`.
                let data = unsafe { std::slice::from_raw_parts_mut(self.base.add(start), len) };
                if self.src.is_null() {
                    return self.cipher.crypt(self.dir, sector, data);
                }
                // SAFETY: as above, for the same chunk of the lent source, which nobody
                // writes while the call runs.
                let src = unsafe { std::slice::from_raw_parts(self.src.add(start), len) };
                self.cipher.crypt_into(self.dir, sector, src, data)
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
