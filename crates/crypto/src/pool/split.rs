//! One blocking call shared between its caller and helper workers: a run of sectors (`crypt`
//! and its variants), cut into pieces.
//!
//! The caller and any helpers claim pieces one at a time from an atomic counter. The caller
//! starts at once and never waits for a helper to be scheduled: a helper that wakes late finds
//! fewer (or no) pieces left. So handing out help costs the caller little more than the
//! wake-up messages, even on a busy or virtualised host where waking a thread takes tens of
//! microseconds.

use crate::{CryptoError, Direction, SectorCipher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// One run of a batch: `len` bytes read at `src` and written at `dst` (the same address, or
/// disjoint ranges), the first of its sectors numbered `first_sector`.
#[derive(Debug, Clone, Copy)]
pub struct RawRun {
    pub first_sector: u64,
    pub src: *const u8,
    pub dst: *mut u8,
    pub len: usize,
}

// SAFETY: a RawRun is addresses and lengths; whoever hands it to the pool vouches for
// the memory (its contract), whichever thread transforms it.
unsafe impl Send for RawRun {}
// SAFETY: as for Send; shared references only read the fields.
unsafe impl Sync for RawRun {}

/// A piece of one run.
struct Piece {
    run: usize,
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
    /// The first error of each run.
    errors: Vec<Option<CryptoError>>,
}

// SAFETY: every piece lies inside a run the caller of the `crypt_raw` call
// owning this `Split` vouched for until it returns, and that call does not touch them while
// helpers may run. Each piece index is claimed by exactly one thread (atomic `fetch_add`), and
// pieces never overlap, so no two threads ever access the same bytes; the caller does not
// return before every piece has been processed (`wait`, also on unwind via `WaitOnDrop`).
// Helpers that arrive afterwards claim an index past the end and never dereference anything.
unsafe impl Send for Split {}
// SAFETY: as for `Send`; the shared parts are an atomic, a mutex and a condvar.
unsafe impl Sync for Split {}

impl Split {
    /// Cuts each run into pieces of at most `chunk` bytes (a multiple of the sector size).
    ///
    /// # Safety
    /// As `SectorCipher::crypt_raw` for every run, until `wait` has returned; runs do not
    /// overlap each other.
    pub(super) unsafe fn new(
        cipher: Arc<dyn SectorCipher>,
        dir: Direction,
        runs: &[RawRun],
        chunk: usize,
    ) -> Self {
        let ss = cipher.sector_size();
        let chunk = chunk.max(ss) / ss * ss;
        let mut pieces = Vec::new();
        for (i, run) in runs.iter().enumerate() {
            let mut at = 0;
            while at < run.len {
                let len = chunk.min(run.len - at);
                pieces.push(Piece {
                    run: i,
                    sector: run.first_sector.wrapping_add((at / ss) as u64),
                    src: run.src.wrapping_add(at),
                    dst: run.dst.wrapping_add(at),
                    len,
                });
                at += len;
            }
        }
        Split {
            cipher,
            dir,
            pieces,
            next: AtomicUsize::new(0),
            progress: Mutex::new(Progress {
                done: 0,
                errors: runs.iter().map(|_| None).collect(),
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
            let result = catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: piece `i` was claimed by this thread alone and lies inside a lent
                // run; see `unsafe impl Send`.
                unsafe {
                    self.cipher
                        .crypt_raw(self.dir, p.sector, p.src, p.dst, p.len)
                }
            }))
            .unwrap_or_else(|_| Err(CryptoError::Worker("sector cipher panicked".into())));
            // The mutex orders this piece's writes before the caller's return from `wait`.
            let mut progress = self.lock();
            if let Err(e) = result {
                progress.errors[p.run].get_or_insert(e);
            }
            progress.done += 1;
            if progress.done == self.pieces.len() {
                self.all_done.notify_all();
            }
        }
    }

    /// Blocks until every piece is done; returns each run's first error.
    pub(super) fn wait(&self) -> Vec<Option<CryptoError>> {
        let mut progress = self.lock();
        while progress.done < self.pieces.len() {
            progress = self
                .all_done
                .wait(progress)
                .unwrap_or_else(|e| e.into_inner());
        }
        std::mem::take(&mut progress.errors)
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
