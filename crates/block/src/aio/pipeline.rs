//! `Pipeline`: a device's queue as one slot table, an ordered list of stages and an engine.
//!
//! A request takes one slot (its caller's tag is stored there, once), passes the range check
//! and the stages in order, and reaches the engine under its slot index; the engine reports
//! (slot, result) and the stages that passed it on see it again, innermost first, before its
//! completion is handed out. Requests a check or a stage finishes at once wait in the same
//! list as those the engine finished. One eventfd serves them all.
//!
//! The bytes of reads and writes a queue holds at once are bounded (`DATA_BUDGET`): a request
//! that would go over waits in the queue, in order, until completions make room (one always
//! runs, whatever its size). Those bytes are what stages and engines may copy into buffers of
//! their own (an encrypted write's ciphertext, a misaligned transfer's bounce), so a client
//! that fills a deep queue with the largest requests (a guest chaining aliased descriptors)
//! makes the daemon hold at most the budget per queue, not queue depth x request size.
//!
//! Beyond its own bound, a queue reserves what a read or write may make the process hold (the
//! request's buffer class, `buffers::class_size`) from the process's memory budget
//! ([`MemoryBudget`], one for every queue of the daemon) before passing it on, and gives it
//! back when the request is handed out. Where the budget has no room the request waits in the
//! same list, in order; the budget grants the bytes to this queue in its turn and says so
//! through the queue's eventfd, and the next `drain` passes the request on. So a queue never
//! fails a request for memory, and never polls for it.
//!
//! A drain hands out finished requests until the stages report `WORK_PER_DRAIN` bytes of data
//! work (decryption), then gives the thread back with the notifier set again: decrypting memory
//! a device has just written runs at a few GB/s, so a burst of large reads would otherwise
//! keep the owner from taking new requests for hundreds of microseconds while the device idles.

use super::{
    Admit, Bounds, Completion, Engine, IoOp, IoQueue, IoRequest, Notifier, Offload, QueueFull,
    QueueOptions, SlotRequest, Stage,
};
use crate::budget::{BudgetShare, MemoryBudget};
use crate::BlockError;
use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

/// Bytes of stage work (decryption) one `drain` does before it hands the thread back.
const WORK_PER_DRAIN: u64 = 64 * 1024;
/// Most requests a queue holds, whatever was asked.
const MAX_DEPTH: usize = 4096;
/// Bytes of reads and writes a queue passes to its stages and engine at once (more wait in
/// the queue): 256 requests of 128 KiB, 32 of 1 MiB.
pub const DATA_BUDGET: u64 = 32 << 20;

/// A request between its push and the hand-out of its completion.
#[derive(Default)]
struct RequestSlot {
    tag: u64,
    /// The request as pushed.
    req: SlotRequest,
    /// Stages that passed it on (the first `admitted` of the list): they see it complete.
    admitted: usize,
    /// Its bytes counted against the data budget while it runs.
    charged: u64,
    /// Its bytes reserved from the memory budget while it runs.
    reserved: u64,
    busy: bool,
}

/// A device's queue.
pub struct Pipeline {
    engine: Box<dyn Engine>,
    /// The synchronous path a stage may send a request to (`Admit::Synchronous`).
    sync_path: Option<Box<dyn Engine>>,
    /// Requests on the synchronous path.
    sync_busy: usize,
    stages: Vec<Box<dyn Stage>>,
    bounds: Bounds,
    notifier: Arc<Notifier>,
    slots: Vec<RequestSlot>,
    free: Vec<usize>,
    in_flight: usize,
    /// Finished requests not handed out yet, oldest first.
    finished: VecDeque<(usize, Result<(), BlockError>)>,
    /// The request on its way through the stages (reused from request to request).
    transfer: SlotRequest,
    /// Bytes of the requests passed to the stages and not handed out yet.
    data_in_flight: u64,
    /// Requests waiting for room in the data budget or the memory budget, oldest first.
    waiting: VecDeque<usize>,
    /// This queue's share of the memory budget (none where the caller reserves the memory
    /// for its requests itself: `set_budget`).
    budget: Option<BudgetShare>,
}

impl Pipeline {
    /// A queue of `opts.depth` slots on the engine `engine` builds (given the queue's notifier
    /// and capacity), checked against `bounds`, with no stages yet.
    pub fn new(
        opts: &QueueOptions,
        bounds: Bounds,
        engine: impl FnOnce(Arc<Notifier>, usize) -> Result<Box<dyn Engine>, BlockError>,
    ) -> Result<Self, BlockError> {
        let capacity = opts.depth.clamp(1, MAX_DEPTH);
        let notifier = Arc::new(Notifier::new().map_err(|e| BlockError::io("eventfd", e))?);
        let engine = engine(notifier.clone(), capacity)?;
        Ok(Pipeline {
            engine,
            sync_path: None,
            sync_busy: 0,
            stages: Vec::new(),
            bounds,
            notifier: notifier.clone(),
            slots: (0..capacity).map(|_| RequestSlot::default()).collect(),
            free: (0..capacity).rev().collect(),
            in_flight: 0,
            finished: VecDeque::with_capacity(capacity),
            transfer: SlotRequest::default(),
            data_in_flight: 0,
            waiting: VecDeque::with_capacity(capacity),
            budget: Some(MemoryBudget::process().share(notifier)),
        })
    }

    /// Reserves this queue's requests from `budget` instead of the process's; `None` where
    /// the caller reserves what its requests make the process hold itself (an NBD connection
    /// holds each payload from its arrival to its reply, longer than the request runs here).
    /// Only with nothing in flight; false, and nothing changes, otherwise.
    pub fn set_budget(&mut self, budget: Option<&MemoryBudget>) -> bool {
        if self.in_flight > 0 {
            return false;
        }
        self.budget = budget.map(|b| b.share(self.notifier.clone()));
        true
    }

    /// Asks the engine to run `work` on every read and write from now on, on the thread that
    /// transfers it, before its completion is reported (see [`Offload`]). False, and nothing
    /// changes, where the engine cannot (its transfers complete in the kernel) or requests are
    /// in flight: the stage then does the work itself.
    pub fn offload(&mut self, work: Arc<dyn Offload>) -> bool {
        self.in_flight == 0 && self.engine.offload(work)
    }

    /// Replaces the range check (a layer over this pipeline's device checks its own range).
    pub fn set_bounds(&mut self, bounds: Bounds) {
        self.bounds = bounds;
    }

    /// Puts `stage` in front of the stages already there.
    pub fn push_front(&mut self, stage: Box<dyn Stage>) {
        self.stages.insert(0, stage);
    }

    /// Gives the stages a synchronous path (`Admit::Synchronous`): the engine `engine` builds,
    /// given the queue's notifier and capacity (as for [`Pipeline::new`]).
    pub fn set_sync_engine(
        &mut self,
        engine: impl FnOnce(Arc<Notifier>, usize) -> Box<dyn Engine>,
    ) {
        self.sync_path = Some(engine(self.notifier.clone(), self.slots.len()));
    }

    /// Passes a request through the stages to an engine; `Some` when it finished on the way.
    fn admit(&mut self, index: usize) -> Option<Result<(), BlockError>> {
        let done = self.pass_on(index);
        // The engine holds its own copy: the memory goes with the request, not with the
        // pipeline's reused transfer.
        self.transfer.release_buffers();
        done
    }

    fn pass_on(&mut self, index: usize) -> Option<Result<(), BlockError>> {
        let slot = &mut self.slots[index];
        let transfer = &mut self.transfer;
        transfer.copy_from(&slot.req);
        for (k, stage) in self.stages.iter_mut().enumerate() {
            match stage.admit(index, &slot.req, transfer) {
                Admit::Pass => {}
                Admit::Finish(result) => {
                    slot.admitted = k;
                    return Some(result);
                }
                Admit::Synchronous => {
                    slot.admitted = k;
                    let Some(sync) = self.sync_path.as_mut() else {
                        return Some(Err(BlockError::unsupported(format!(
                            "{} on this device's synchronous path, which it has not",
                            slot.req.op.name()
                        ))));
                    };
                    let done = sync.start(index, transfer);
                    if done.is_none() {
                        self.sync_busy += 1;
                    }
                    return done;
                }
            }
        }
        slot.admitted = self.stages.len();
        self.engine.start(index, transfer)
    }

    /// Whether a request of `bytes` fits the data budget now (always, with nothing running).
    fn has_room(&self, bytes: u64) -> bool {
        self.data_in_flight == 0 || self.data_in_flight + bytes <= DATA_BUDGET
    }

    /// Reserves what the request at `index` may make the process hold, now or with the
    /// grant the queue waited for; false when it must wait (the share then waits for it).
    fn reserve(&mut self, index: usize, bytes: u64) -> bool {
        let Some(share) = self.budget.as_mut() else {
            return true;
        };
        if bytes == 0 {
            return true;
        }
        let charge = share.charge_for(crate::buffers::class_size(bytes as usize) as u64);
        // A grant the queue waited for is this request's: it is the oldest waiting.
        match share.try_reserve(charge) {
            Some(reserved) => {
                self.slots[index].reserved = reserved;
                true
            }
            None => false,
        }
    }

    /// Charges the request to the budget and passes it on; one finished on the way waits in
    /// the finished list.
    fn start(&mut self, index: usize, bytes: u64) {
        self.slots[index].charged = bytes;
        self.data_in_flight += bytes;
        if let Some(result) = self.admit(index) {
            self.finished.push_back((index, result));
            self.notifier.notify();
        }
    }

    /// Passes on the waiting requests the budget has room for now, oldest first, and sends
    /// them to the device (their owner pushed them long ago and will not submit again).
    fn start_waiting(&mut self) {
        let mut started = false;
        while let Some(&index) = self.waiting.front() {
            let bytes = {
                let req = &self.slots[index].req;
                data_bytes(req.op, req.len)
            };
            if !self.has_room(bytes) || !self.reserve(index, bytes) {
                break;
            }
            self.waiting.pop_front();
            self.start(index, bytes);
            started = true;
        }
        if started {
            if let Err(e) = IoQueue::submit(self) {
                tracing::warn!("submitting requests that waited for the data budget: {e}");
            }
        }
    }

    /// Collects what the engines finished (the synchronous path's only while it has requests:
    /// every queue has one, and most never use it).
    fn reap(&mut self) {
        let finished = &mut self.finished;
        self.engine
            .reap(&mut |slot, result| finished.push_back((slot, result)));
        let busy = self.sync_busy > 0;
        if let Some(sync) = self.sync_path.as_mut().filter(|_| busy) {
            let mut back = 0;
            sync.reap(&mut |slot, result| {
                back += 1;
                finished.push_back((slot, result));
            });
            self.sync_busy -= back;
        }
    }
}

impl IoQueue for Pipeline {
    fn notifier(&self) -> BorrowedFd<'_> {
        self.notifier.as_fd()
    }

    fn capacity(&self) -> usize {
        self.slots.len()
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn push(&mut self, req: &IoRequest<'_>) -> Result<(), QueueFull> {
        let Some(index) = self.free.pop() else {
            return Err(QueueFull(self.in_flight));
        };
        self.in_flight += 1;
        let slot = &mut self.slots[index];
        slot.tag = req.tag;
        slot.req.set(req);
        slot.admitted = 0;
        slot.busy = true;
        slot.charged = 0;
        slot.reserved = 0;
        if let Err(e) = self.bounds.check(req) {
            self.finished.push_back((index, Err(e)));
            self.notifier.notify();
            return Ok(());
        }
        let bytes = data_bytes(req.op, req.len);
        if !self.waiting.is_empty() || !self.has_room(bytes) || !self.reserve(index, bytes) {
            self.waiting.push_back(index);
            return Ok(());
        }
        self.start(index, bytes);
        Ok(())
    }

    fn submit(&mut self) -> Result<(), BlockError> {
        let busy = self.sync_busy > 0;
        if let Some(sync) = self.sync_path.as_mut().filter(|_| busy) {
            sync.submit()?;
        }
        self.engine.submit()
    }

    fn drain(&mut self, out: &mut dyn FnMut(Completion)) {
        self.notifier.clear();
        self.reap();
        let mut work = 0u64;
        while work < WORK_PER_DRAIN {
            let Some((index, mut result)) = self.finished.pop_front() else {
                break;
            };
            let slot = &mut self.slots[index];
            for stage in self.stages[..slot.admitted].iter_mut().rev() {
                work += stage.complete(index, &slot.req, &mut result);
            }
            slot.busy = false;
            // The memory goes back to its owner with the completion (a memory table swapped
            // meanwhile is unmapped now, not when the slot is reused).
            slot.req.release_buffers();
            self.data_in_flight -= std::mem::take(&mut slot.charged);
            let reserved = std::mem::take(&mut slot.reserved);
            if let Some(share) = self.budget.as_mut().filter(|_| reserved > 0) {
                share.release(reserved);
            }
            self.free.push(index);
            self.in_flight -= 1;
            out(Completion {
                tag: slot.tag,
                result,
            });
        }
        if !self.waiting.is_empty() {
            self.start_waiting();
        }
        if self.in_flight == 0 {
            // Idle: what the share reserved ahead for requests that may not come goes back.
            if let Some(share) = self.budget.as_mut() {
                share.return_credit();
            }
        }
        if !self.finished.is_empty() {
            self.notifier.notify();
        }
    }

    fn wait(&mut self) {
        if !self.finished.is_empty() || self.in_flight == 0 {
            return;
        }
        if self.sync_busy > 0 || !self.waiting.is_empty() {
            // Both engines and the memory budget signal the one eventfd: wait on it rather
            // than on either engine (which may hold nothing while requests wait for memory).
            self.notifier.wait();
        } else {
            self.engine.wait();
        }
    }
}

impl Drop for Pipeline {
    /// The engines wait for the device to let go of every buffer as they drop; then the
    /// requests never collected, which still count for the stages that passed them on (a
    /// fence, the dirty log), are let go there.
    fn drop(&mut self) {
        self.engine = Box::new(Stopped);
        self.sync_path = None;
        for (index, slot) in self.slots.iter().enumerate().filter(|(_, s)| s.busy) {
            for stage in self.stages[..slot.admitted].iter_mut().rev() {
                stage.abandon(index, &slot.req);
            }
        }
    }
}

/// The bytes a request counts against the data budget: its buffers' (reads and writes).
fn data_bytes(op: IoOp, len: u64) -> u64 {
    match op {
        IoOp::Read | IoOp::Write => len,
        _ => 0,
    }
}

/// What is left of a dropped pipeline's engine.
struct Stopped;

impl Engine for Stopped {
    fn start(&mut self, _: usize, _: &SlotRequest) -> Option<Result<(), BlockError>> {
        Some(Err(BlockError::new(
            crate::BlockErrorKind::Io,
            "the queue is closed",
        )))
    }
    fn submit(&mut self) -> Result<(), BlockError> {
        Ok(())
    }
    fn reap(&mut self, _: &mut dyn FnMut(usize, Result<(), BlockError>)) {}
    fn wait(&mut self) {}
}
