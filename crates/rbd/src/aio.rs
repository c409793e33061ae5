//! An RBD image's engine on librbd's own asynchronous calls (`rbd_aio_readv`,
//! `rbd_aio_writev`, `rbd_aio_flush`, `rbd_aio_discard`, `rbd_aio_write_zeroes`), so a queue
//! keeps as many requests in flight in the cluster as its owner pushes, without a thread per
//! request: at about a millisecond per request, that is where RBD throughput comes from.
//!
//! librbd runs a completion callback on one of its own threads. The callback here only
//! records (slot, return value) in a list preallocated to the queue's depth and signals the
//! pipeline's eventfd; everything else (FUA's follow-up flush, errors, reporting) happens in
//! `reap`, on the owner's thread. Per-slot state is allocated once, with the engine: in
//! steady state a request allocates nothing on our side.
//!
//! Each request sent to librbd holds a strong count on the engine's callback state (the
//! finished list, the eventfd, the callback arguments), and its callback gives it back as the
//! very last thing it does. The owner may see a request finished (and drop the queue) between
//! the callback's push and its notify; the state, and so the eventfd, then lives on until that
//! callback returns, instead of being freed (and its fd number reused) under it.

use crate::ffi::{self, AioCompletion, Api};
use crate::handle::{self, Completion};
use crate::{block_error, Image, RbdError};
use cryptblk_block::aio::{Engine, IoOp, Notifier, SlotRequest};
use cryptblk_block::BlockError;
use libc::c_void;
use std::sync::{Arc, Mutex};

/// What the callback needs, shared with librbd's threads; freed when the engine and every
/// request librbd still holds have let go of it.
struct CallbackState {
    api: &'static Api,
    /// The pipeline's.
    notifier: Arc<Notifier>,
    /// (slot, librbd's return value) of requests librbd finished; never grows past the depth.
    finished: Mutex<Vec<(usize, isize)>>,
    /// One per slot, at a stable address inside this allocation: what librbd hands back.
    args: Box<[CallbackArg]>,
}

/// The callback argument of one slot: where to report. Immutable once made. `shared` points at
/// the `CallbackState` holding this argument; a request in flight owns one strong count of it.
struct CallbackArg {
    shared: *const CallbackState,
    slot: usize,
}

/// What the owner remembers about the transfer in a slot.
#[derive(Default)]
struct RbdTransfer {
    /// The request, copied at start; the memory its buffers point to is the caller's, valid
    /// until the slot is reported.
    req: SlotRequest,
    /// A FUA write whose data landed and whose flush is now in flight.
    flushing: bool,
}

/// The engine of a pipeline on an open RBD image.
pub struct RbdEngine {
    image: Arc<Image>,
    shared: Arc<CallbackState>,
    /// By the pipeline's slot index.
    transfers: Vec<RbdTransfer>,
    /// Started, not yet sent to librbd.
    pending: Vec<usize>,
    /// The finished list swapped out of `shared` while reaping (same capacity, no allocation).
    scratch: Vec<(usize, isize)>,
    /// Started and not yet reported: what `Drop` waits for.
    outstanding: usize,
}

// SAFETY: the raw pointers in `shared.args` point at `shared` itself, kept alive by the engine's
// Arc and by one strong count per request in flight; its other fields are a Mutex and an
// eventfd, safe to use from any thread. `IoBuffers` are Send. The image is Send and Sync.
unsafe impl Send for RbdEngine {}

impl RbdEngine {
    /// An engine of `capacity` slots signalling `notifier`.
    pub fn new(
        image: Arc<Image>,
        capacity: usize,
        notifier: Arc<Notifier>,
    ) -> Result<RbdEngine, BlockError> {
        let api = ffi::api().map_err(|e| block_error("open queue", 0, e))?;
        let shared = Arc::new_cyclic(|this| CallbackState {
            api,
            notifier,
            finished: Mutex::new(Vec::with_capacity(capacity)),
            args: (0..capacity)
                .map(|slot| CallbackArg {
                    shared: this.as_ptr(),
                    slot,
                })
                .collect(),
        });
        let transfers = (0..capacity).map(|_| RbdTransfer::default()).collect();
        Ok(RbdEngine {
            image,
            shared,
            transfers,
            pending: Vec::with_capacity(capacity),
            scratch: Vec::with_capacity(capacity),
            outstanding: 0,
        })
    }

    /// Hands the request in `slot` (or its FUA flush) to librbd; a call librbd refuses at once
    /// is reported through the finished list like any other completion.
    fn send(&mut self, slot: usize) {
        let arg = &self.shared.args[slot] as *const CallbackArg as *mut c_void;
        // The request's own count on `CallbackState`, given back by its callback (or below if librbd
        // refuses it): `arg` and the eventfd stay valid until the callback has returned.
        std::mem::forget(Arc::clone(&self.shared));
        let started = Completion::new(self.shared.api, on_complete, arg).and_then(|completion| {
            let image = self.image.handle();
            let state = &self.transfers[slot];
            let req = &state.req;
            match (req.op, state.flushing) {
                (_, true) | (IoOp::Flush, _) => image.start_flush(completion),
                // SAFETY: the iovec list lives in the slot, whose `IoBuffers` keep the memory it
                // points to valid until the slot is reported, after the callback ran.
                (IoOp::Read, _) => unsafe {
                    image.start_readv(req.buffers.iov(), req.offset, completion)
                },
                // SAFETY: as for a read.
                (IoOp::Write, _) => unsafe {
                    image.start_writev(req.buffers.iov(), req.offset, completion)
                },
                (IoOp::Discard, _) => image.start_discard(req.offset, req.len, completion),
                (IoOp::WriteZeroes, _) => {
                    image.start_write_zeroes(req.offset, req.len as usize, completion)
                }
            }
        });
        if let Err(errno) = started {
            // librbd refused the request (its completion released), so the callback will not run.
            self.release_request_count();
            self.report(slot, -(errno as isize));
        }
    }

    /// Gives back the count `send` took for a request whose callback will never run.
    fn release_request_count(&self) {
        // SAFETY: `send` leaked exactly one clone of `self.shared` for this request, and
        // librbd refused the request, so no callback will give it back; `self.shared` keeps
        // another count, so this never frees.
        unsafe { Arc::decrement_strong_count(Arc::as_ptr(&self.shared)) };
    }

    fn report(&self, slot: usize, ret: isize) {
        lock(&self.shared.finished).push((slot, ret));
        self.shared.notifier.notify();
    }
}

/// Runs on a librbd thread: record, wake, and give back the request's count on the callback
/// state, last.
extern "C" fn on_complete(completion: AioCompletion, arg: *mut c_void) {
    // SAFETY: `arg` is the CallbackArg this request was created with; it lives inside the state,
    // of which this request holds a strong count until the end of this function.
    let arg = unsafe { &*(arg as *const CallbackArg) };
    let shared_ptr = arg.shared;
    // SAFETY: as above: this request's count keeps the state alive.
    let shared = unsafe { &*shared_ptr };
    // SAFETY: librbd passes the finished request's completion, finished once, here.
    let ret = unsafe { handle::finish(shared.api, completion) };
    lock(&shared.finished).push((arg.slot, ret));
    // The owner may already have drained that entry and dropped the queue: `shared` (and the
    // eventfd) is still ours until the count is given back below.
    shared.notifier.notify();
    // SAFETY: `send` leaked one clone of the Arc for this request; this gives it back. If it
    // was the last, the state (with `arg`) is freed here: neither is used after this line.
    unsafe { Arc::decrement_strong_count(shared_ptr) };
}

/// The finished list's lock; a panic elsewhere while it was held leaves a list still valid.
fn lock(m: &Mutex<Vec<(usize, isize)>>) -> std::sync::MutexGuard<'_, Vec<(usize, isize)>> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Engine for RbdEngine {
    fn start(&mut self, slot: usize, req: &SlotRequest) -> Option<Result<(), BlockError>> {
        let state = &mut self.transfers[slot];
        state.req.copy_from(req);
        state.flushing = false;
        self.outstanding += 1;
        self.pending.push(slot);
        None
    }

    fn submit(&mut self) -> Result<(), BlockError> {
        let pending = std::mem::take(&mut self.pending);
        for &slot in &pending {
            self.send(slot);
        }
        // Keep the vector's capacity for the next batch.
        self.pending = pending;
        self.pending.clear();
        Ok(())
    }

    fn reap(&mut self, out: &mut dyn FnMut(usize, Result<(), BlockError>)) {
        std::mem::swap(&mut *lock(&self.shared.finished), &mut self.scratch);
        let mut finished = std::mem::take(&mut self.scratch);
        for &(slot, ret) in &finished {
            let state = &mut self.transfers[slot];
            if ret >= 0 && state.req.fua && state.req.op == IoOp::Write && !state.flushing {
                // The data landed; the write completes once it is durable.
                state.flushing = true;
                self.send(slot);
                continue;
            }
            let result = if ret < 0 {
                let err = RbdError::Call {
                    op: if state.flushing {
                        "flush"
                    } else {
                        state.req.op.name()
                    },
                    image: self.image.name().to_owned(),
                    errno: (-ret) as i32,
                };
                Err(block_error(state.req.op.name(), state.req.offset, err))
            } else {
                Ok(())
            };
            self.outstanding -= 1;
            state.req.release_buffers();
            out(slot, result);
        }
        finished.clear();
        self.scratch = finished;
    }

    fn wait(&mut self) {
        if self.outstanding > 0 {
            self.shared.notifier.wait();
        }
    }
}

impl Drop for RbdEngine {
    fn drop(&mut self) {
        // librbd reads and writes the caller's buffers and the slots' iovec lists until each
        // request finished: wait for all of them (FUA flushes included). The callback state
        // itself is kept alive by the callbacks still returning, not by this wait.
        self.submit().ok();
        while self.outstanding > 0 {
            self.shared.notifier.clear();
            self.reap(&mut |_, _| {});
            if self.outstanding > 0 {
                self.shared.notifier.wait();
            }
        }
    }
}
