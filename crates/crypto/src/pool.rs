//! Worker pool for sector crypto.
//!
//! `crypt` and its variants: a large run is cut into sector-aligned chunks that the caller and
//! woken workers claim one by one (`split.rs`); the caller returns when all are done. Runs
//! below the inline threshold are done on the caller's thread, because waking another core
//! costs more than it saves. (The request path calls this once per request and only a request
//! above the threshold reaches the workers: sharing a batch of small requests made the queue's
//! thread wait for a descheduled worker, see docs/performance.md.)
//!
//! Workers block on a channel when idle: no polling, no spinning.

use crate::{CryptoError, Direction, RawSectors, SectorCipher};
use crossbeam_channel::{Receiver, Sender};
use split::{Split, WaitOnDrop};
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

/// Help with a blocking `crypt` call.
enum Job {
    Help(Arc<Split>),
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
        self.crypt_raw(cipher, dir, first_sector, RawSectors::from_mut(data))
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
        self.crypt_raw(cipher, dir, first_sector, RawSectors::between(src, dst)?)
    }

    /// `SectorCipher::crypt_raw` split across the workers like `crypt`: for memory that must
    /// not become a Rust reference (guest RAM).
    pub fn crypt_raw(
        &self,
        cipher: &Arc<dyn SectorCipher>,
        dir: Direction,
        first_sector: u64,
        bytes: RawSectors<'_>,
    ) -> Result<(), CryptoError> {
        let ss = cipher.sector_size();
        let len = bytes.len();
        if ss == 0 || !len.is_multiple_of(ss) {
            return Err(CryptoError::InvalidLength(format!(
                "{len} bytes is not a whole number of {ss}-byte sectors"
            )));
        }
        let (tx, chunk) = match (&self.tx, self.chunk_size(len, ss)) {
            (Some(tx), Some(chunk)) => (tx, chunk),
            _ => return cipher.crypt_raw(dir, first_sector, bytes),
        };
        // The pieces the workers transform are raw addresses inside `bytes`. `bytes` is this
        // call's own value, kept (by this borrow) to the end of the call, and `run_split` does
        // not return, nor unwind, before every piece is done: the memory it vouches for is
        // valid for as long as any thread uses a piece.
        self.run_split(tx, cipher, dir, first_sector, &bytes, chunk)
            .map_or(Ok(()), Err)
    }

    /// Shares `bytes` out in `chunk`-byte pieces between this thread and woken workers;
    /// returns the first error of any piece once all of them are done.
    fn run_split(
        &self,
        tx: &Sender<Job>,
        cipher: &Arc<dyn SectorCipher>,
        dir: Direction,
        first_sector: u64,
        bytes: &RawSectors<'_>,
        chunk: usize,
    ) -> Option<CryptoError> {
        // SAFETY: `bytes` is borrowed for this whole call, and `WaitOnDrop` keeps this call
        // from returning (or unwinding) while a helper may still use a piece of it.
        let split =
            Arc::new(unsafe { Split::new(cipher.clone(), dir, first_sector, bytes, chunk) });
        let guard = WaitOnDrop(split.clone());
        let helpers = (self.threads - 1).min(split.pieces().saturating_sub(1));
        for _ in 0..helpers {
            // Fails only once the pool is shut down; the caller then does every piece itself.
            let _ = tx.send(Job::Help(split.clone()));
        }
        split.work();
        let error = split.wait();
        drop(guard);
        error
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
    // `recv` only sleeps when the queue is empty, so a burst is drained in one wake-up.
    while let Ok(job) = rx.recv() {
        let start = Instant::now();
        match job {
            Job::Help(split) => split.work(),
        }
        let spent = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        busy_ns.fetch_add(spent, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
