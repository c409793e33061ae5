//! An engine that runs each request as a blocking call on the I/O thread pool, for devices
//! without a native asynchronous interface (the `threads` engine of a raw file, a synchronous
//! device). Finished jobs are put on a list and the pipeline's eventfd is signalled; `reap`
//! reports them on the owner's thread.
//!
//! A submitted batch is shared out as the old submission pool did: by the measured cost of a
//! request. Requests that finish in microseconds (the page cache, tmpfs) run on the submitting
//! thread itself, with pool threads woken only when the batch holds enough work to pay for
//! the wake-ups (`WORK_PER_HELPER_NS`); slow requests (a disk) all go to pool threads, so the
//! submitter returns to its event loop at once.

use super::thread_pool::{self, Job};
use super::{Engine, IoBuffers, IoOp, Notifier, Offload, Scratch, SlotRequest};
use crate::{BlockError, BlockErrorKind};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::Instant;

/// Requests that take at most this long on average run on the submitting thread.
const INLINE_NS: u64 = 20_000;
/// Expected work per woken helper: waking a thread costs a few microseconds and, on a busy
/// machine, takes a core from someone else; a helper pays off when it takes over tens of
/// microseconds of work (measured with the 2-vCPU throughput tests: one helper per two 4 KiB
/// requests halved IOPS compared with this rule).
const WORK_PER_HELPER_NS: u64 = 32_000;
/// Before the first measurement, requests count as slow (spread over the pool).
const UNMEASURED_NS: u64 = u64::MAX / 1024;

/// The blocking half of an engine: runs one request to its end on a pool thread.
pub(crate) trait BlockingIo: Send + Sync + 'static {
    /// `req.buffers` keep their memory valid for the call.
    fn run(&self, req: &SlotRequest, scratch: &mut Scratch) -> Result<(), BlockError>;
}

// Jobs stay boxed on these lists so that recycling them allocates nothing.
#[allow(clippy::vec_box)]
struct PoolShared<E> {
    io: E,
    /// Submitted jobs no thread has claimed yet.
    batch: Mutex<VecDeque<Box<ThreadJob>>>,
    done: Mutex<Vec<Box<ThreadJob>>>,
    /// The pipeline's: signalled here, cleared by the pipeline.
    notifier: Arc<Notifier>,
    /// Moving average of a request's run time, in nanoseconds.
    avg_ns: AtomicU64,
    /// A layer's data work, run with each read and write (`Engine::offload`).
    offload: OnceLock<Arc<dyn Offload>>,
}

impl<E: BlockingIo> PoolShared<E> {
    #[allow(clippy::vec_box)]
    fn done(&self) -> MutexGuard<'_, Vec<Box<ThreadJob>>> {
        // A list of finished jobs stays consistent whatever a panicking holder did.
        self.done.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn claim(&self) -> Option<Box<ThreadJob>> {
        self.batch
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
    }

    /// Runs submitted jobs until none is left unclaimed.
    fn work(&self) {
        while let Some(job) = self.claim() {
            self.run(job);
        }
    }

    /// Runs a job's request, with the offloaded data work around it.
    fn execute(&self, job: &mut ThreadJob) -> Result<(), BlockError> {
        let ThreadJob {
            req,
            scratch,
            transformed,
            transformed_buffers,
            ..
        } = job;
        match (self.offload.get(), req.op) {
            (Some(work), IoOp::Read) => {
                self.io.run(req, scratch)?;
                work.after_read(req.offset, &req.buffers)
            }
            (Some(work), IoOp::Write) => {
                // The transformed data goes through the job's own buffer, which is what is
                // written; the request's buffers are only read.
                let len = req.len as usize;
                let out = transformed.take(len);
                work.before_write(req.offset, &req.buffers, out)?;
                transformed_buffers.clear();
                // SAFETY: the job's own buffer, which it keeps (and nothing references) until
                // the swap back below, after the transfer returned.
                unsafe { transformed_buffers.add_raw(out.as_mut_ptr(), len) };
                std::mem::swap(&mut req.buffers, transformed_buffers);
                let result = self.io.run(req, scratch);
                std::mem::swap(&mut req.buffers, transformed_buffers);
                transformed_buffers.clear();
                result
            }
            _ => self.io.run(req, scratch),
        }
    }

    fn run(&self, mut job: Box<ThreadJob>) {
        let began = Instant::now();
        let job_ref = &mut *job;
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.execute(job_ref)));
        job.result = result.unwrap_or_else(|_| {
            Err(BlockError::new(BlockErrorKind::Io, "I/O engine panicked")
                .with_op(job.req.op.name()))
        });
        // Back to the cache from the thread (and CPU) that took them.
        job.scratch.release();
        job.transformed.release();
        // EWMA with weight 1/8; a lost update between threads only delays adaptation.
        let took = u64::try_from(began.elapsed().as_nanos()).unwrap_or(UNMEASURED_NS);
        let avg = self.avg_ns.load(Ordering::Relaxed);
        let next = avg - avg / 8 + took.min(UNMEASURED_NS) / 8;
        self.avg_ns.store(next, Ordering::Relaxed);
        let mut done = self.done();
        // The owner clears the notifier before it takes the whole list: a wake-up is needed
        // only when the list was empty (else one is pending for the jobs already on it).
        let first = done.is_empty();
        done.push(job);
        drop(done);
        if first {
            self.notifier.notify();
        }
    }
}

/// A pool thread sent to help with a queue's submitted batch. Weak: a helper still waiting
/// for a thread must not keep the queue's engine (and so the image file and its lock) alive
/// after the queue is gone.
struct Helper<E>(Weak<PoolShared<E>>);

impl<E: BlockingIo> Job for Helper<E> {
    fn run(self: Box<Self>) {
        if let Some(shared) = self.0.upgrade() {
            shared.work();
        }
    }
}

/// One request and what its run needs, recycled from request to request.
struct ThreadJob {
    req: SlotRequest,
    slot: usize,
    result: Result<(), BlockError>,
    scratch: Scratch,
    /// A write's data after the offloaded work, and the one-entry list naming it.
    transformed: Scratch,
    transformed_buffers: IoBuffers,
}

/// How many pool threads to wake for a batch of `n` requests of `avg_ns` each, given that the
/// submitter works on it too when `inline`.
fn helpers_for(n: usize, avg_ns: u64, inline: bool) -> usize {
    let cap = thread_pool::io_thread_count();
    if !inline {
        return n.min(cap);
    }
    let work = (n as u64).saturating_mul(avg_ns.max(1));
    let wanted = usize::try_from(work / WORK_PER_HELPER_NS).unwrap_or(usize::MAX);
    wanted.min(n.saturating_sub(1)).min(cap)
}

/// The engine. Jobs (with their buffer lists and bounce buffers) are kept by slot and reused, so
/// an engine in steady state allocates nothing per request.
#[allow(clippy::vec_box)]
pub(crate) struct ThreadedEngine<E: BlockingIo> {
    shared: Arc<PoolShared<E>>,
    /// Each slot's job while it is idle.
    idle: Vec<Option<Box<ThreadJob>>>,
    /// Jobs submitted and not yet taken back from the done list: what `Drop` waits for.
    in_pool: usize,
    /// Started, not yet submitted.
    pending: Vec<Box<ThreadJob>>,
    /// Swapped with the shared list in `reap`, so reaping allocates nothing.
    finished: Vec<Box<ThreadJob>>,
}

impl<E: BlockingIo> ThreadedEngine<E> {
    pub(crate) fn new(io: E, capacity: usize, notifier: Arc<Notifier>) -> Self {
        ThreadedEngine {
            shared: Arc::new(PoolShared {
                io,
                batch: Mutex::new(VecDeque::with_capacity(capacity)),
                done: Mutex::new(Vec::with_capacity(capacity)),
                notifier,
                avg_ns: AtomicU64::new(UNMEASURED_NS),
                offload: OnceLock::new(),
            }),
            idle: (0..capacity).map(|_| None).collect(),
            in_pool: 0,
            pending: Vec::with_capacity(capacity),
            finished: Vec::with_capacity(capacity),
        }
    }

    /// Waits until a job is back on the done list (clearing the notifier meanwhile: only
    /// called where nothing else signals it).
    fn wait_for_done(&self) {
        while self.shared.done().is_empty() {
            self.shared.notifier.wait();
            if self.shared.done().is_empty() {
                self.shared.notifier.clear();
            }
        }
    }
}

impl<E: BlockingIo> Engine for ThreadedEngine<E> {
    fn start(&mut self, slot: usize, req: &SlotRequest) -> Option<Result<(), BlockError>> {
        let mut job = self.idle[slot].take().unwrap_or_else(|| {
            Box::new(ThreadJob {
                req: SlotRequest::default(),
                slot,
                result: Ok(()),
                scratch: Scratch::default(),
                transformed: Scratch::default(),
                transformed_buffers: IoBuffers::with_capacity(1),
            })
        });
        job.req.copy_from(req);
        self.pending.push(job);
        None
    }

    fn submit(&mut self) -> Result<(), BlockError> {
        let n = self.pending.len();
        if n == 0 {
            return Ok(());
        }
        self.in_pool += n;
        self.shared
            .batch
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(self.pending.drain(..));
        let avg = self.shared.avg_ns.load(Ordering::Relaxed);
        let inline = avg <= INLINE_NS;
        for _ in 0..helpers_for(n, avg, inline) {
            thread_pool::spawn(Box::new(Helper(Arc::downgrade(&self.shared))));
        }
        if inline {
            self.shared.work();
        }
        Ok(())
    }

    fn reap(&mut self, out: &mut dyn FnMut(usize, Result<(), BlockError>)) {
        std::mem::swap(&mut *self.shared.done(), &mut self.finished);
        self.in_pool -= self.finished.len();
        for mut job in self.finished.drain(..) {
            let result = std::mem::replace(&mut job.result, Ok(()));
            let slot = job.slot;
            job.req.release_buffers();
            self.idle[slot] = Some(job);
            out(slot, result);
        }
    }

    fn wait(&mut self) {
        if self.in_pool > 0 {
            self.wait_for_done();
        }
    }

    fn offload(&mut self, work: Arc<dyn Offload>) -> bool {
        self.shared.offload.set(work).is_ok()
    }
}

impl<E: BlockingIo> Drop for ThreadedEngine<E> {
    /// Pool threads may still use the buffers of jobs handed to them: wait until every one
    /// is back, and until no helper still holds the engine (the image's lock must be free
    /// once the queue is gone). Their completions are not reported.
    fn drop(&mut self) {
        while self.in_pool > 0 {
            self.wait_for_done();
            let back = std::mem::take(&mut *self.shared.done());
            self.in_pool -= back.len();
        }
        // A helper that ran the last job lets go right after it.
        while Arc::strong_count(&self.shared) > 1 {
            std::thread::yield_now();
        }
    }
}
