//! An `IoQueue` that runs each request as a blocking call on the I/O thread pool, for engines
//! without a native asynchronous interface. Completed jobs are put on a list and the queue's
//! eventfd is signalled; `drain` hands them out on the owner's thread.

use super::thread_pool::{self, Job};
use super::{Completion, IoOp, IoQueue, IoRequest, IoVec, Notifier, QueueFull};
use crate::{BlockError, BlockErrorKind};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The blocking half of an engine: runs one request to its end on a pool thread.
pub(crate) trait BlockingIo: Send + Sync + 'static {
    /// # Safety
    /// `iov` is valid as promised to `IoQueue::push` for the request.
    unsafe fn run(&self, req: &JobRequest, scratch: &mut Scratch) -> Result<(), BlockError>;
}

/// The request a job carries (its own copy of the buffer list).
pub(crate) struct JobRequest {
    pub op: IoOp,
    pub offset: u64,
    pub len: u64,
    pub iov: Vec<IoVec>,
    pub fua: bool,
}

/// Per-job memory an engine may reuse from one request to the next (a bounce buffer).
#[derive(Default)]
pub(crate) struct Scratch {
    pub buf: Option<crate::AlignedBuf>,
}

/// Bounce buffers up to this size stay with their job for the next request.
const KEEP_SCRATCH: usize = 1 << 20;

impl Scratch {
    /// A buffer of at least `len` bytes (contents unspecified).
    pub fn take(&mut self, len: usize) -> &mut [u8] {
        if self.buf.as_ref().is_none_or(|b| b.len() < len) {
            self.buf = Some(crate::AlignedBuf::zeroed(len));
        }
        match self.buf.as_deref_mut() {
            Some(buf) => &mut buf[..len],
            None => &mut [],
        }
    }

    fn trim(&mut self) {
        if self.buf.as_ref().is_some_and(|b| b.len() > KEEP_SCRATCH) {
            self.buf = None;
        }
    }
}

// Jobs stay boxed on these lists: the box is what travels to a pool thread as a
// `Box<dyn Job>`, so keeping it avoids an allocation per request.
#[allow(clippy::vec_box)]
struct Shared<E> {
    done: Mutex<Vec<Box<ThreadJob<E>>>>,
    notifier: Notifier,
    /// The notifier is a parent queue's: the parent clears it before it drains this queue,
    /// and this queue must not, or it could swallow the wake-up of a completion the parent
    /// has not collected yet.
    parent_clears: bool,
}

impl<E> Shared<E> {
    #[allow(clippy::vec_box)]
    fn done(&self) -> MutexGuard<'_, Vec<Box<ThreadJob<E>>>> {
        // A list of finished jobs stays consistent whatever a panicking holder did.
        self.done.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct ThreadJob<E> {
    engine: Arc<E>,
    shared: Arc<Shared<E>>,
    req: JobRequest,
    tag: u64,
    result: Result<(), BlockError>,
    scratch: Scratch,
}

impl<E: BlockingIo> Job for ThreadJob<E> {
    fn run(mut self: Box<Self>) {
        let job = &mut *self;
        // SAFETY: the job was pushed under `IoQueue::push`'s contract, which keeps the buffers
        // valid until its completion is handed out, and that happens only after this returns.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
            job.engine.run(&job.req, &mut job.scratch)
        }));
        job.result = result.unwrap_or_else(|_| {
            Err(BlockError::new(BlockErrorKind::Io, "I/O engine panicked")
                .with_op(job.req.op.name()))
        });
        let shared = Arc::clone(&self.shared);
        shared.done().push(self);
        shared.notifier.notify();
    }
}

/// The queue. Jobs (with their buffer lists and bounce buffers) are recycled, so a queue in
/// steady state allocates nothing per request.
#[allow(clippy::vec_box)]
pub(crate) struct ThreadedQueue<E: BlockingIo> {
    engine: Arc<E>,
    shared: Arc<Shared<E>>,
    capacity: usize,
    in_flight: usize,
    /// Jobs handed to pool threads and not yet taken back from the done list: what `Drop`
    /// waits for.
    in_pool: usize,
    /// Pushed, not yet submitted.
    pending: Vec<Box<ThreadJob<E>>>,
    spare: Vec<Box<ThreadJob<E>>>,
    /// Swapped with the shared list in `drain`, so draining allocates nothing.
    finished: Vec<Box<ThreadJob<E>>>,
}

impl<E: BlockingIo> ThreadedQueue<E> {
    pub(crate) fn new(engine: Arc<E>, capacity: usize) -> Result<Self, BlockError> {
        let notifier = Notifier::new().map_err(|e| BlockError::io("eventfd", e))?;
        Ok(Self::build(engine, capacity, notifier, false))
    }

    /// A queue that signals a parent queue's `notifier` (a clone of it). The parent clears it
    /// (before draining this queue); this queue never does.
    pub(crate) fn with_notifier(engine: Arc<E>, capacity: usize, notifier: Notifier) -> Self {
        Self::build(engine, capacity, notifier, true)
    }

    fn build(engine: Arc<E>, capacity: usize, notifier: Notifier, parent_clears: bool) -> Self {
        let capacity = capacity.max(1);
        ThreadedQueue {
            engine,
            shared: Arc::new(Shared {
                done: Mutex::new(Vec::with_capacity(capacity)),
                notifier,
                parent_clears,
            }),
            capacity,
            in_flight: 0,
            in_pool: 0,
            pending: Vec::with_capacity(capacity),
            spare: Vec::new(),
            finished: Vec::with_capacity(capacity),
        }
    }

    fn job(&mut self) -> Box<ThreadJob<E>> {
        self.spare.pop().unwrap_or_else(|| {
            Box::new(ThreadJob {
                engine: self.engine.clone(),
                shared: self.shared.clone(),
                req: JobRequest {
                    op: IoOp::Flush,
                    offset: 0,
                    len: 0,
                    iov: Vec::new(),
                    fua: false,
                },
                tag: 0,
                result: Ok(()),
                scratch: Scratch::default(),
            })
        })
    }
}

impl<E: BlockingIo> IoQueue for ThreadedQueue<E> {
    fn notifier(&self) -> RawFd {
        self.shared.notifier.as_raw_fd()
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    unsafe fn push(&mut self, req: &IoRequest<'_>) -> Result<(), QueueFull> {
        if self.in_flight >= self.capacity {
            return Err(QueueFull(self.in_flight));
        }
        let mut job = self.job();
        job.req.op = req.op;
        job.req.offset = req.offset;
        job.req.len = req.len;
        job.req.fua = req.fua;
        job.req.iov.clear();
        job.req.iov.extend_from_slice(req.iov);
        job.tag = req.tag;
        self.in_flight += 1;
        self.pending.push(job);
        Ok(())
    }

    fn submit(&mut self) -> Result<(), BlockError> {
        for job in self.pending.drain(..) {
            self.in_pool += 1;
            thread_pool::spawn(job);
        }
        Ok(())
    }

    fn drain(&mut self, out: &mut dyn FnMut(Completion)) {
        if !self.shared.parent_clears {
            self.shared.notifier.clear();
        }
        std::mem::swap(&mut *self.shared.done(), &mut self.finished);
        self.in_pool -= self.finished.len();
        for mut job in self.finished.drain(..) {
            self.in_flight -= 1;
            let result = std::mem::replace(&mut job.result, Ok(()));
            let tag = job.tag;
            job.req.iov.clear();
            job.scratch.trim();
            self.spare.push(job);
            out(Completion { tag, result });
        }
    }

    fn wait(&mut self) {
        while self.in_flight > self.pending.len() && self.shared.done().is_empty() {
            self.shared.notifier.wait();
            // The counter stays set until `drain` clears it; avoid spinning on it (a
            // parent's notifier is the parent's to clear: poll it briefly instead).
            if self.shared.done().is_empty() {
                if self.shared.parent_clears {
                    std::thread::sleep(std::time::Duration::from_micros(100));
                } else {
                    self.shared.notifier.clear();
                }
            }
        }
    }
}

impl<E: BlockingIo> Drop for ThreadedQueue<E> {
    /// Pool threads may still use the buffers of jobs handed to them: wait until every one
    /// is back. Their completions are not handed out.
    fn drop(&mut self) {
        while self.in_pool > 0 {
            let back = std::mem::take(&mut *self.shared.done());
            self.in_pool -= back.len();
            if back.is_empty() {
                self.shared.notifier.wait();
                if self.shared.parent_clears {
                    std::thread::sleep(std::time::Duration::from_micros(100));
                } else {
                    self.shared.notifier.clear();
                }
            }
        }
    }
}
