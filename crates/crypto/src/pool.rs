//! Worker pool for sector crypto.
//!
//! Two ways in:
//! - `crypt` (blocking): a large run is cut into sector-aligned chunks that the caller and
//!   woken workers claim one by one (`split.rs`); the caller returns when all are done. Small
//!   runs are done inline, because waking another core costs more than it saves.
//! - `submit` (asynchronous): an owned buffer is transformed on a worker and handed back to a
//!   completion callback. A frontend keeps many requests in flight (e.g. 32 per virtqueue)
//!   without a thread per request; a woken worker keeps taking queued jobs until the queue is
//!   empty before it sleeps again, so bursts of small requests cost one wake-up, not one each.
//!
//! Workers block on a channel when idle: no polling, no spinning.

use crate::{CryptoError, Direction, SectorCipher};
use crossbeam_channel::{Receiver, Sender};
pub use split::RawRun;
use split::{Split, WaitOnDrop};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod split;

/// Below this many bytes `crypt` stays on the caller's thread. Measured with
/// `examples/pool_threshold.rs` (2-vCPU KVM guest, AES-256-XTS at ~11 GB/s per core, busy
/// host): splitting costs 0.5-3 µs of wake-up messages and starts to pay between 128 and
/// 256 KiB; on idle or bare-metal hosts helpers wake sooner and it pays earlier.
pub const DEFAULT_INLINE_THRESHOLD: usize = 128 * 1024;

/// Upper bound of the smallest chunk a split hands out.
const MAX_MIN_CHUNK: usize = 32 * 1024;

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
    /// Nanoseconds the workers spent running jobs, summed over workers (for utilisation).
    busy_ns: Arc<AtomicU64>,
    started: Instant,
}

enum Job {
    /// Help with a blocking `crypt` call.
    Help(Arc<Split>),
    Owned(OwnedJob),
}

struct OwnedJob {
    cipher: Arc<dyn SectorCipher>,
    dir: Direction,
    first_sector: u64,
    buf: Vec<u8>,
    done: Completion,
}

impl CryptoPool {
    /// A pool with `threads` workers (at least one).
    ///
    /// # Panics
    /// If the OS refuses to create a thread; use [`CryptoPool::try_new`] to handle that.
    pub fn new(threads: usize) -> Self {
        match Self::try_new(threads) {
            Ok(pool) => pool,
            Err(e) => panic!("{e}"),
        }
    }

    /// A pool with `threads` workers (at least one), or an error if a thread cannot be spawned.
    pub fn try_new(threads: usize) -> Result<Self, CryptoError> {
        let threads = threads.max(1);
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let mut pool = CryptoPool {
            threads,
            inline_threshold: DEFAULT_INLINE_THRESHOLD,
            tx: Some(tx),
            workers: Vec::with_capacity(threads),
            busy_ns: Arc::new(AtomicU64::new(0)),
            started: Instant::now(),
        };
        for i in 0..threads {
            let rx = rx.clone();
            let busy = pool.busy_ns.clone();
            let handle = std::thread::Builder::new()
                .name(format!("cryptblk-crypto-{i}"))
                .spawn(move || worker(rx, &busy))
                // Dropping `pool` on this path stops and joins the workers already started.
                .map_err(|e| {
                    CryptoError::Worker(format!("cannot spawn crypto worker thread: {e}"))
                })?;
            pool.workers.push(handle);
        }
        Ok(pool)
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

    /// Time the workers spent running jobs since the pool started, summed over workers
    /// (work the calling threads do inline is not included).
    pub fn busy_time(&self) -> Duration {
        Duration::from_nanos(self.busy_ns.load(Ordering::Relaxed))
    }

    /// Average share of the workers' time spent working since the pool started (0.0..=1.0).
    pub fn utilisation(&self) -> f64 {
        let wall = self.started.elapsed().as_secs_f64() * self.threads as f64;
        if wall <= 0.0 {
            return 0.0;
        }
        (self.busy_time().as_secs_f64() / wall).min(1.0)
    }

    /// Transform `data` in place, split across the workers when it is large enough to gain.
    pub fn crypt(
        &self,
        cipher: &Arc<dyn SectorCipher>,
        dir: Direction,
        first_sector: u64,
        data: &mut [u8],
    ) -> Result<(), CryptoError> {
        let p = data.as_mut_ptr();
        // SAFETY: `data` is an exclusive borrow for the whole call, used only through `p`.
        unsafe { self.crypt_raw(cipher, dir, first_sector, p, p, data.len()) }
    }

    /// Transform `src` into `dst` (the same length) without modifying `src`, split across the
    /// workers like `crypt`: one pass over the data instead of a copy plus an in-place pass.
    pub fn crypt_into(
        &self,
        cipher: &Arc<dyn SectorCipher>,
        dir: Direction,
        first_sector: u64,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<(), CryptoError> {
        crate::check_same_len(src, dst)?;
        // SAFETY: two borrows of the same length, alive for the whole call; a shared and an
        // exclusive borrow never overlap.
        unsafe {
            self.crypt_raw(
                cipher,
                dir,
                first_sector,
                src.as_ptr(),
                dst.as_mut_ptr(),
                src.len(),
            )
        }
    }

    /// `SectorCipher::crypt_raw` split across the workers like `crypt`: for memory that must
    /// not become a Rust reference (guest RAM).
    ///
    /// # Safety
    /// As `SectorCipher::crypt_raw`: for the whole call `src` readable and `dst` writable for
    /// `len` bytes, the same range or disjoint ones.
    pub unsafe fn crypt_raw(
        &self,
        cipher: &Arc<dyn SectorCipher>,
        dir: Direction,
        first_sector: u64,
        src: *const u8,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), CryptoError> {
        let ss = cipher.sector_size();
        if ss == 0 || !len.is_multiple_of(ss) {
            return Err(CryptoError::InvalidLength(format!(
                "{len} bytes is not a whole number of {ss}-byte sectors"
            )));
        }
        let (tx, chunk) = match (&self.tx, self.chunk_size(len, ss)) {
            (Some(tx), Some(chunk)) if !IN_WORKER.with(Cell::get) => (tx, chunk),
            // SAFETY: forwarded from this function's contract.
            _ => return unsafe { cipher.crypt_raw(dir, first_sector, src, dst, len) },
        };
        let run = RawRun {
            first_sector,
            src,
            dst,
            len,
        };
        // SAFETY: forwarded.
        let errors = unsafe { self.run_split(tx, cipher, dir, &[run], chunk) };
        errors.into_iter().flatten().next().map_or(Ok(()), Err)
    }

    /// Transforms a batch of runs (e.g. every read a queue just completed), spread over the
    /// workers like `crypt` when the batch holds enough bytes to gain, even if each run alone
    /// is small. `results` receives each run's result, in order.
    ///
    /// # Safety
    /// As `SectorCipher::crypt_raw` for every run, for the whole call; runs do not overlap.
    pub unsafe fn crypt_raw_batch(
        &self,
        cipher: &Arc<dyn SectorCipher>,
        dir: Direction,
        runs: &[RawRun],
        results: &mut Vec<Result<(), CryptoError>>,
    ) {
        results.clear();
        let ss = cipher.sector_size();
        let total: usize = runs.iter().map(|r| r.len).sum();
        // A batch of small runs costs more to share out than one long run (a piece per run at
        // least): it splits from twice the single-run threshold.
        let split = match (&self.tx, self.chunk_size(total / 2, ss)) {
            (Some(tx), Some(chunk)) if runs.len() > 1 && !IN_WORKER.with(Cell::get) => {
                Some((tx, chunk))
            }
            _ => None,
        };
        let Some((tx, chunk)) = split else {
            for r in runs {
                // SAFETY: forwarded; a single run may still split on its own.
                results.push(unsafe {
                    self.crypt_raw(cipher, dir, r.first_sector, r.src, r.dst, r.len)
                });
            }
            return;
        };
        // SAFETY: forwarded.
        let errors = unsafe { self.run_split(tx, cipher, dir, runs, chunk) };
        results.extend(errors.into_iter().map(|e| e.map_or(Ok(()), Err)));
    }

    /// Shares `runs` out in `chunk`-byte pieces between this thread and woken workers.
    ///
    /// # Safety
    /// As `crypt_raw_batch`.
    unsafe fn run_split(
        &self,
        tx: &Sender<Job>,
        cipher: &Arc<dyn SectorCipher>,
        dir: Direction,
        runs: &[RawRun],
        chunk: usize,
    ) -> Vec<Option<CryptoError>> {
        // SAFETY: forwarded; `WaitOnDrop` keeps this call from returning (or unwinding)
        // while a helper may still use the runs.
        let split = Arc::new(unsafe { Split::new(cipher.clone(), dir, runs, chunk) });
        let guard = WaitOnDrop(split.clone());
        let helpers = (self.threads - 1).min(split.pieces().saturating_sub(1));
        for _ in 0..helpers {
            // Fails only once the pool is shut down; the caller then does every piece itself.
            let _ = tx.send(Job::Help(split.clone()));
        }
        split.work();
        let errors = split.wait();
        drop(guard);
        errors
    }

    /// Queue `buf` for transformation on a worker; `done` receives the result and the buffer.
    /// `done` runs on a worker thread and should hand off quickly (e.g. complete a request),
    /// not block. Jobs start in submission order; with several workers they may finish out
    /// of order.
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

    /// The chunk size for splitting a run of `len` bytes, or `None` to run it inline.
    fn chunk_size(&self, len: usize, ss: usize) -> Option<usize> {
        if self.threads < 2 || len < self.inline_threshold.max(2 * ss) {
            return None;
        }
        // About four chunks per thread evens out late helpers, but no chunk so small that
        // claiming it costs a noticeable share of its work.
        let floor = (self.inline_threshold / 4).clamp(ss, MAX_MIN_CHUNK);
        let chunk = (len / (self.threads * 4)).max(floor) / ss * ss;
        (chunk < len).then_some(chunk)
    }
}

impl std::fmt::Debug for CryptoPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CryptoPool")
            .field("threads", &self.threads)
            .field("inline_threshold", &self.inline_threshold)
            .field("queued", &self.tx.as_ref().map_or(0, |tx| tx.len()))
            .finish()
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

fn worker(rx: Receiver<Job>, busy_ns: &AtomicU64) {
    IN_WORKER.with(|w| w.set(true));
    // `recv` only sleeps when the queue is empty, so a burst is drained in one wake-up.
    while let Ok(job) = rx.recv() {
        let start = Instant::now();
        match job {
            Job::Help(split) => split.work(),
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
        let spent = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        busy_ns.fetch_add(spent, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
