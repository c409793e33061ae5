//! One blocking call shared between its caller and helper workers: a run of sectors (`crypt`
//! and its variants, all through `crypt_raw`), cut into pieces.
//!
//! The caller and any helpers claim pieces one at a time from an atomic counter. The caller
//! starts at once and never waits for a helper to be scheduled: a helper that wakes late finds
//! fewer (or no) pieces left. So handing out help costs the caller little more than the
//! wake-up messages, even on a busy or virtualised host where waking a thread takes tens of
//! microseconds.

use crate::{CryptoError, Direction, RawSectors, SectorCipher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// A piece of the run: raw addresses inside the `RawSectors` the pool's `crypt_raw` holds.
struct Piece {
    sector: u64,
    src: *const u8,
    dst: *mut u8,
    len: usize,
}

pub(super) struct Split {
    cipher: Arc<dyn SectorCipher>,
    dir: Direction,
    pieces: Vec<Piece>,
    next: AtomicUsize,
    progress: Mutex<Progress>,
    all_done: Condvar,
}

struct Progress {
    done: usize,
    /// The first error of any piece.
    error: Option<CryptoError>,
}

// SAFETY: every piece lies inside the `RawSectors` the caller of the pool's `crypt_raw` passed
// in, whose invariant holds its bytes valid until that call returns; the call does not touch
// them while helpers may run. Each piece index is claimed by exactly one thread (atomic
// `fetch_add`), and pieces never overlap, so no two threads of this split ever access the same
// bytes; the caller does not return before every piece has been processed (`wait`, also on
// unwind via `WaitOnDrop`). Helpers that arrive afterwards claim an index past the end and
// never dereference anything.
unsafe impl Send for Split {}
// SAFETY: as for `Send`; the shared parts are an atomic, a mutex and a condvar.
unsafe impl Sync for Split {}

impl Split {
    /// Cuts `bytes` into pieces of at most `chunk` bytes (a multiple of the sector size), the
    /// first numbered `first_sector`.
    ///
    /// # Safety
    /// The caller keeps `bytes` (so the memory it vouches for) alive and untouched until
    /// `wait` has returned.
    pub(super) unsafe fn new(
        cipher: Arc<dyn SectorCipher>,
        dir: Direction,
        first_sector: u64,
        bytes: &RawSectors<'_>,
        chunk: usize,
    ) -> Self {
        let ss = cipher.sector_size();
        let chunk = chunk.max(ss) / ss * ss;
        let mut pieces = Vec::with_capacity(bytes.len().div_ceil(chunk));
        let mut at = 0;
        while at < bytes.len() {
            let len = chunk.min(bytes.len() - at);
            pieces.push(Piece {
                sector: first_sector.wrapping_add((at / ss) as u64),
                src: bytes.src().wrapping_add(at),
                dst: bytes.dst().wrapping_add(at),
                len,
            });
            at += len;
        }
        Split {
            cipher,
            dir,
            pieces,
            next: AtomicUsize::new(0),
            progress: Mutex::new(Progress {
                done: 0,
                error: None,
            }),
            all_done: Condvar::new(),
        }
    }

    pub(super) fn pieces(&self) -> usize {
        self.pieces.len()
    }

    fn lock(&self) -> MutexGuard<'_, Progress> {
        // Plain fields, consistent even if a holder panicked; refusing would hang callers.
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Claims and transforms pieces until none are left.
    pub(super) fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(p) = self.pieces.get(i) else { return };
            // SAFETY: piece `i` was claimed by this thread alone and lies inside the caller's
            // `RawSectors`, valid until `wait` has returned; see `unsafe impl Send`. The value
            // lives only for this call.
            let piece = unsafe { RawSectors::new(p.src, p.dst, p.len) };
            let result = catch_unwind(AssertUnwindSafe(|| {
                self.cipher.crypt_raw(self.dir, p.sector, piece)
            }))
            .unwrap_or_else(|_| Err(CryptoError::Worker("sector cipher panicked".into())));
            // The mutex orders this piece's writes before the caller's return from `wait`.
            let mut progress = self.lock();
            if let Err(e) = result {
                progress.error.get_or_insert(e);
            }
            progress.done += 1;
            if progress.done == self.pieces.len() {
                self.all_done.notify_all();
            }
        }
    }

    /// Blocks until every piece is done; returns the first error.
    pub(super) fn wait(&self) -> Option<CryptoError> {
        let mut progress = self.lock();
        while progress.done < self.pieces.len() {
            progress = self
                .all_done
                .wait(progress)
                .unwrap_or_else(|e| e.into_inner());
        }
        progress.error.take()
    }
}

/// Waits for all pieces when dropped, so that even an unwinding caller cannot release the
/// borrowed memory while a helper still writes into it.
pub(super) struct WaitOnDrop(pub(super) Arc<Split>);

impl Drop for WaitOnDrop {
    fn drop(&mut self) {
        self.0.wait();
    }
}
