//! Worker pool for sector crypto.
//!
//! Two ways in:
//! - `crypt` (blocking): a large run is cut into sector-aligned chunks; all but one go to the
//!   workers and the caller does the last itself, then waits. Small runs are done inline,
//!   because handing work to another core costs a few microseconds of wake-up latency.
//! - `submit` (asynchronous): an owned buffer is transformed on a worker and handed back to a
//!   completion callback. A frontend keeps many requests in flight (e.g. 32 per virtqueue)
//!   without a thread per request; a woken worker keeps taking queued jobs until the queue is
//!   empty before it sleeps again, so bursts of small requests cost one wake-up, not one each.
//!
//! Workers block on a channel when idle: no polling, no spinning.

use crate::{CryptoError, Direction, SectorCipher};
use crossbeam_channel::{Receiver, Sender};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Below this many bytes `crypt` stays on the caller's thread. At ~20 GB/s per core, 64 KiB
/// takes ~3 µs, the same order as waking a sleeping worker, so splitting smaller runs loses.
pub const DEFAULT_INLINE_THRESHOLD: usize = 64 * 1024;

/// Completion callback of an asynchronous job: the result and the buffer handed back.
pub type Completion = Box<dyn FnOnce(Result<(), CryptoError>, Vec<u8>) + Send + 'static>;

thread_local! {
    /// Set on pool workers: a `crypt` issued from a completion callback must not wait for
    /// chunks queued behind itself, so it runs inline.
    static IN_WORKER: Cell<bool> = const { Cell::new(false) };
}

/// Worker pool for sector crypto, sized to the machine by default.
pub struct CryptoPool {
    threads: usize,
    inline_threshold: usize,
    tx: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
}

enum Job {
    Chunk(ChunkJob),
    Owned(OwnedJob),
}

/// A slice of a caller's buffer, borrowed for the duration of one `crypt` call.
struct ChunkJob {
    cipher: Arc<dyn SectorCipher>,
    dir: Direction,
    first_sector: u64,
    ptr: *mut u8,
    len: usize,
    /// Counts the latch down when the job is dropped, whether it ran, failed, panicked or was
    /// never received, so the waiting caller can never be left hanging.
    done: LatchToken,
}

// SAFETY: the raw pointer refers to a disjoint sub-slice of a `&mut [u8]` that the issuing
// `crypt` call keeps borrowed, and `crypt` does not return (nor unwind past its frame) until
// every `LatchToken` of its jobs has been dropped, which happens only after the worker is done
// with the pointer. No other thread touches that sub-slice meanwhile.
unsafe impl Send for ChunkJob {}

struct OwnedJob {
    cipher: Arc<dyn SectorCipher>,
    dir: Direction,
    first_sector: u64,
    buf: Vec<u8>,
    done: Completion,
}

struct Latch {
    state: Mutex<LatchState>,
    cv: Condvar,
}

struct LatchState {
    pending: usize,
    error: Option<CryptoError>,
}

impl Latch {
    fn new(pending: usize) -> Arc<Self> {
        Arc::new(Latch {
            state: Mutex::new(LatchState {
                pending,
                error: None,
            }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LatchState> {
        // The state is two plain fields updated under the lock; it stays consistent even if a
        // holder panicked, and refusing to count down would hang the caller.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks until every token is gone; returns the first error any chunk reported.
    fn wait(&self) -> Option<CryptoError> {
        let mut st = self.lock();
        while st.pending > 0 {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.error.take()
    }
}

struct LatchToken {
    latch: Arc<Latch>,
    result: Option<Result<(), CryptoError>>,
}

impl Drop for LatchToken {
    fn drop(&mut self) {
        let result = self.result.take().unwrap_or_else(|| {
            Err(CryptoError::Worker(
                "chunk abandoned: worker panicked or the pool shut down".into(),
            ))
        });
        let mut st = self.latch.lock();
        if let Err(e) = result {
            st.error.get_or_insert(e);
        }
        st.pending -= 1;
        if st.pending == 0 {
            self.latch.cv.notify_all();
        }
    }
}

/// Waits for the workers when dropped, so that an unwinding caller cannot release the borrowed
/// buffer while workers still write into it.
struct WaitOnDrop(Arc<Latch>);

impl Drop for WaitOnDrop {
    fn drop(&mut self) {
        self.0.wait();
    }
}

impl CryptoPool {
    /// A pool with `threads` workers (at least one).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let workers = (0..threads)
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("cryptblk-crypto-{i}"))
                    .spawn(move || worker(rx))
                    .expect("failed to spawn a crypto worker thread")
            })
            .collect();
        CryptoPool {
            threads,
            inline_threshold: DEFAULT_INLINE_THRESHOLD,
            tx: Some(tx),
            workers,
        }
    }

    /// One worker per available core.
    pub fn with_default_threads() -> Self {
        Self::new(
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
        )
    }

    /// Overrides the size below which `crypt` does not split (for tuning and tests).
    pub fn with_inline_threshold(mut self, bytes: usize) -> Self {
        self.inline_threshold = bytes;
        self
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Transform `data` in place, split across the workers when it is large enough to gain.
    pub fn crypt(
        &self,
        cipher: &Arc<dyn SectorCipher>,
        dir: Direction,
        first_sector: u64,
        data: &mut [u8],
    ) -> Result<(), CryptoError> {
        let ss = cipher.sector_size();
        if ss == 0 || !data.len().is_multiple_of(ss) {
            return Err(CryptoError::InvalidLength(format!(
                "{} bytes is not a whole number of {ss}-byte sectors",
                data.len()
            )));
        }
        let parts = self.parts_for(data.len(), ss);
        let tx = match &self.tx {
            Some(tx) if parts > 1 && !IN_WORKER.with(Cell::get) => tx,
            _ => return cipher.crypt(dir, first_sector, data),
        };

        let sectors = data.len() / ss;
        let (base, extra) = (sectors / parts, sectors % parts);
        let latch = Latch::new(parts - 1);
        let wait_guard = WaitOnDrop(latch.clone());
        let mut rest: &mut [u8] = data;
        let mut sector = first_sector;
        for i in 0..parts - 1 {
            let n = base + usize::from(i < extra);
            let (chunk, tail) = rest.split_at_mut(n * ss);
            rest = tail;
            let job = ChunkJob {
                cipher: cipher.clone(),
                dir,
                first_sector: sector,
                ptr: chunk.as_mut_ptr(),
                len: chunk.len(),
                done: LatchToken {
                    latch: latch.clone(),
                    result: None,
                },
            };
            // A send can only fail once the pool is shut down; the returned job is dropped
            // here, counting the latch down with an error.
            let _ = tx.send(Job::Chunk(job));
            sector = sector.wrapping_add(n as u64);
        }
        // Caught so that a panicking cipher gives the same error here as on a worker.
        let own = catch_unwind(AssertUnwindSafe(|| cipher.crypt(dir, sector, rest)))
            .unwrap_or_else(|_| Err(CryptoError::Worker("sector cipher panicked".into())));
        let workers = latch.wait();
        drop(wait_guard);
        own?;
        workers.map_or(Ok(()), Err)
    }

    /// Queue `buf` for transformation on a worker; `done` receives the result and the buffer.
    /// `done` runs on a worker thread and should hand off quickly (e.g. complete a request),
    /// not block. Jobs are started in submission order.
    pub fn submit<F>(
        &self,
        cipher: Arc<dyn SectorCipher>,
        dir: Direction,
        first_sector: u64,
        buf: Vec<u8>,
        done: F,
    ) where
        F: FnOnce(Result<(), CryptoError>, Vec<u8>) + Send + 'static,
    {
        let job = OwnedJob {
            cipher,
            dir,
            first_sector,
            buf,
            done: Box::new(done),
        };
        match &self.tx {
            Some(tx) => {
                if let Err(crossbeam_channel::SendError(Job::Owned(job))) = tx.send(Job::Owned(job))
                {
                    (job.done)(
                        Err(CryptoError::Worker("crypto pool is shut down".into())),
                        job.buf,
                    );
                }
            }
            None => (job.done)(
                Err(CryptoError::Worker("crypto pool is shut down".into())),
                job.buf,
            ),
        }
    }

    fn parts_for(&self, len: usize, ss: usize) -> usize {
        if len < self.inline_threshold.max(ss * 2) {
            return 1;
        }
        // Chunks below half the threshold would cost more to hand over than they save.
        let by_size = (len / (self.inline_threshold / 2).max(ss)).max(1);
        self.threads.min(by_size).min(len / ss)
    }
}

impl Drop for CryptoPool {
    fn drop(&mut self) {
        // Closing the channel lets workers finish what is queued and then exit.
        self.tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker(rx: Receiver<Job>) {
    IN_WORKER.with(|w| w.set(true));
    // `recv` only sleeps when the queue is empty, so a burst is drained in one wake-up.
    while let Ok(job) = rx.recv() {
        match job {
            Job::Chunk(mut job) => {
                let result = catch_unwind(AssertUnwindSafe(|| {
                    // SAFETY: see `unsafe impl Send for ChunkJob`: the pointer and length
                    // describe a live, exclusively lent sub-slice until `job.done` drops.
                    let data = unsafe { std::slice::from_raw_parts_mut(job.ptr, job.len) };
                    job.cipher.crypt(job.dir, job.first_sector, data)
                }));
                job.done.result =
                    Some(result.unwrap_or_else(|_| {
                        Err(CryptoError::Worker("sector cipher panicked".into()))
                    }));
                // `job` (and with it the token) drops here, after the last use of the pointer.
            }
            Job::Owned(job) => {
                let OwnedJob {
                    cipher,
                    dir,
                    first_sector,
                    mut buf,
                    done,
                } = job;
                let result = catch_unwind(AssertUnwindSafe(|| {
                    cipher.crypt(dir, first_sector, &mut buf)
                }))
                .unwrap_or_else(|_| Err(CryptoError::Worker("sector cipher panicked".into())));
                // A panicking callback must not take the worker down with it.
                let _ = catch_unwind(AssertUnwindSafe(move || done(result, buf)));
            }
        }
    }
}

#[cfg(test)]
mod tests;
