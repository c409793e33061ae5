//! The submission pool: threads that run requests a queue worker has popped, so that one
//! virtqueue keeps many requests in flight and a single queue's stream uses every core.
//!
//! Why a thread pool rather than io_uring: on an encrypted disk most of a request's cost is
//! crypto (CPU) plus a page-cache copy or a device read, and `BlockDevice` is synchronous. A
//! pool runs both in parallel with no second, asynchronous device API. Its price is a thread
//! wake-up, which the queue worker pays once per helper rather than per request, by
//! sharing each batch of requests with the woken threads (so a queue at depth 1 pays none).
//! Workers sleep on a channel.

use std::sync::{Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A fixed set of threads running queued jobs in submission order (completion order varies).
pub struct Executor {
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Executor {
    /// Starts `threads` workers (at least one).
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let mut executor = Executor {
            tx: Some(tx),
            threads: Vec::new(),
        };
        for i in 0..threads.max(1) {
            let rx: Receiver<Job> = rx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("cryptblk-io-{i}"))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                })?;
            executor.threads.push(handle);
        }
        Ok(executor)
    }

    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Queues `job`; runs it on the caller's thread if the pool is shut down.
    pub fn spawn(&self, job: Job) {
        match &self.tx {
            Some(tx) => {
                if let Err(crossbeam_channel::SendError(job)) = tx.send(job) {
                    job();
                }
            }
            None => job(),
        }
    }

    /// Default thread count: two per core (one can wait in a read or fdatasync while the other
    /// runs crypto), at least 4 so a queue keeps some I/O in flight on a small machine, at most
    /// 32.
    pub fn default_threads() -> usize {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (2 * cores).clamp(4, 32)
    }
}

impl Drop for Executor {
    /// Finishes every queued job, then joins the threads.
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Counts one queue's requests between pop and used-ring entry, so that stopping the queue
/// (GET_VRING_BASE, disconnect, shutdown) can wait until every popped request is answered.
#[derive(Default)]
pub struct InFlight {
    count: Mutex<usize>,
    idle: Condvar,
}

impl InFlight {
    pub fn inc(&self) {
        *self.count.lock().unwrap_or_else(PoisonError::into_inner) += 1;
    }

    pub fn dec(&self) {
        let mut n = self.count.lock().unwrap_or_else(PoisonError::into_inner);
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.idle.notify_all();
        }
    }

    /// Blocks until no request is in flight.
    pub fn wait_idle(&self) {
        let mut n = self.count.lock().unwrap_or_else(PoisonError::into_inner);
        while *n > 0 {
            n = self.idle.wait(n).unwrap_or_else(PoisonError::into_inner);
        }
    }
}
