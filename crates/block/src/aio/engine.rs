//! The bottom of a queue: the engine that carries requests to the device (io_uring, the I/O
//! threads, librbd, a synchronous device on the I/O threads).
//!
//! An engine knows requests by the pipeline's slot index only: the pipeline owns the one slot
//! table of a queue (the caller's tag, the free list, the count in flight, the notifier), and an
//! engine keeps nothing but what a transfer needs while it runs (its iovec list, a bounce
//! buffer for misaligned direct I/O, how far a short transfer got).

use super::{IoBuffers, IoOp, IoRequest, Offload};
use crate::BlockError;
use std::sync::Arc;

/// A request as a slot holds it: the caller's request with its buffers copied (the memory's
/// owner and the list), so that it outlives the caller's borrow and keeps the memory alive. Stages read the caller's copy and rewrite the copy that goes on
/// to the engine (offsets, buffers).
#[derive(Debug, Clone)]
pub struct SlotRequest {
    pub op: IoOp,
    pub offset: u64,
    pub len: u64,
    /// The buffers of a `Read` or `Write`; empty otherwise.
    pub buffers: IoBuffers,
    pub fua: bool,
}

impl Default for SlotRequest {
    fn default() -> Self {
        SlotRequest {
            op: IoOp::Flush,
            offset: 0,
            len: 0,
            buffers: IoBuffers::new(),
            fua: false,
        }
    }
}

impl SlotRequest {
    /// Takes `req` (reusing this one's list, so a slot in steady state allocates nothing).
    pub fn set(&mut self, req: &IoRequest<'_>) {
        self.op = req.op;
        self.offset = req.offset;
        self.len = req.len;
        self.fua = req.fua;
        self.buffers.copy_from(req.buffers);
    }

    /// Becomes a copy of `other` (reusing this one's list).
    pub fn copy_from(&mut self, other: &SlotRequest) {
        self.op = other.op;
        self.offset = other.offset;
        self.len = other.len;
        self.fua = other.fua;
        self.buffers.copy_from(&other.buffers);
    }

    /// Makes the buffers one segment of `len` bytes at `base` (a stage's bounce buffer).
    ///
    /// # Safety
    /// As [`IoBuffers::add_raw`]: the memory stays valid, and unreferenced, until the stage
    /// that set it sees the request complete (or abandoned).
    pub unsafe fn set_buffer(&mut self, base: *mut u8, len: usize) {
        self.buffers.clear();
        // SAFETY: forwarded from this function's contract.
        unsafe { self.buffers.add_raw(base, len) };
        self.len = len as u64;
    }

    /// Lets go of the buffers (and their memory), keeping the list's storage.
    pub fn release_buffers(&mut self) {
        self.buffers.clear();
    }
}

/// A bounce buffer a slot (or job) holds while its request runs, from the process's cache
/// (`buffers`): given back when the request is done, so an idle queue holds none.
#[derive(Default)]
pub(crate) struct Scratch {
    pub buf: Option<crate::PooledBuf>,
}

impl Scratch {
    /// A buffer of at least `len` bytes (contents unspecified).
    pub fn take(&mut self, len: usize) -> &mut [u8] {
        if self.buf.as_ref().is_none_or(|b| b.len() < len) {
            self.buf = Some(crate::buffers::take(len));
        }
        match self.buf.as_deref_mut() {
            Some(buf) => &mut buf[..len],
            None => &mut [],
        }
    }

    /// Gives the buffer back to the cache (the request is done).
    pub fn release(&mut self) {
        self.buf = None;
    }
}

/// What carries a pipeline's requests to the device. Built with the pipeline's notifier, which
/// it signals (never clears) whenever `reap` has something new to report.
pub trait Engine: Send {
    /// Starts `req` for slot `slot` (below the pipeline's capacity, not in use by another
    /// request); nothing need reach the device before `submit`. Returns the result at once
    /// where the engine finishes the request without the device (a no-op), else `None`, and
    /// the slot is reported by a later `reap`. The engine keeps a copy of `req.buffers` until
    /// it reports the slot (or is dropped, which waits for the device to let go).
    fn start(&mut self, slot: usize, req: &SlotRequest) -> Option<Result<(), BlockError>>;

    /// Sends every request started since the last call.
    fn submit(&mut self) -> Result<(), BlockError>;

    /// Reports every finished request, without blocking.
    fn reap(&mut self, out: &mut dyn FnMut(usize, Result<(), BlockError>));

    /// Blocks until `reap` has something to report (or nothing is started). May return early.
    fn wait(&mut self);

    /// Runs `work` on every read and write from now on, on the thread that transfers it (see
    /// [`Offload`]). False, and nothing changes, where the engine cannot.
    fn offload(&mut self, work: Arc<dyn Offload>) -> bool {
        let _ = work;
        false
    }
}
