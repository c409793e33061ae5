//! Asynchronous I/O: the request interface every frontend uses to keep many requests of one
//! device in flight without a thread per request.
//!
//! A frontend thread (a vhost-user queue thread, an NBD connection, the convert pipeline)
//! opens an [`IoQueue`] on its device with [`open_queue`](crate::open_queue), pushes requests whose buffers are
//! [`IoBuffers`] (guest memory or owned buffers as a scatter-gather list of [`IoVec`]s checked
//! against the memory's owner, which the value keeps alive; never a Rust reference to guest
//! memory), sends them with one [`IoQueue::submit`] per batch, and collects completions
//! with [`IoQueue::drain`] when the queue's eventfd ([`IoQueue::notifier`]) becomes readable,
//! from the event loop it already waits in. Nobody polls: a thread with nothing to do sleeps.
//!
//! Every queue is a [`Pipeline`]: one slot table, the range check, an ordered list of
//! [`Stage`]s (the volume's crypto, discard rounding, the migration's fence and dirty log) and
//! an [`Engine`]: io_uring (`raw::uring`) or a pool of threads doing positioned vectored I/O
//! (`raw::threads`) for a raw file, librbd for an RBD image, and for any other `BlockDevice`
//! (qcow2, a migration's incoming disk, test devices) its synchronous methods on the thread
//! pool through bounce buffers ([`Pipeline::synchronous`]). So every device fits the same
//! event loop, and a layer adds a stage instead of a queue.

pub(crate) mod copy;
mod engine;
mod io_buffers;
mod offload;
mod pipeline;
mod stage;
pub(crate) mod thread_pool;
pub(crate) mod threaded;

pub use crate::notifier::Notifier;
pub(crate) use engine::Scratch;
pub use engine::{Engine, SlotRequest};
pub use io_buffers::{BufferError, IoBuffers, MemoryOwner, OwnedBuffer};
pub use offload::Offload;
pub use pipeline::{Pipeline, DATA_BUDGET};
pub use stage::{Admit, Bounds, Stage};
pub use thread_pool::io_thread_count;

use crate::BlockError;
use std::os::fd::BorrowedFd;
use std::sync::Arc;

/// One piece of a request's buffer: `len` bytes at `base`, laid out as the kernel's `iovec` so
/// that a list of them goes to `preadv`/io_uring as it is.
///
/// Making one is safe: it grants nothing. Requests carry them inside [`IoBuffers`], which is
/// where the memory is vouched for.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct IoVec(libc::iovec);

// SAFETY: an IoVec is an address and a length; it grants nothing by itself. The `IoBuffers`
// holding it keeps the memory valid, whichever thread uses it.
unsafe impl Send for IoVec {}
// SAFETY: as for Send: shared references only read the address and length.
unsafe impl Sync for IoVec {}

impl IoVec {
    /// `len` bytes at `base`.
    pub fn from_raw(base: *mut u8, len: usize) -> Self {
        IoVec(libc::iovec {
            iov_base: base.cast(),
            iov_len: len,
        })
    }

    /// The bytes of `buf` (an owned buffer of the caller's).
    pub fn from_slice(buf: &mut [u8]) -> Self {
        IoVec::from_raw(buf.as_mut_ptr(), buf.len())
    }

    pub fn base(&self) -> *mut u8 {
        self.0.iov_base.cast()
    }

    pub fn len(&self) -> usize {
        self.0.iov_len
    }

    pub fn is_empty(&self) -> bool {
        self.0.iov_len == 0
    }

    pub(crate) fn as_iovec_ptr(list: &[IoVec]) -> *const libc::iovec {
        list.as_ptr().cast()
    }
}

impl std::fmt::Debug for IoVec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IoVec({:p}+{})", self.base(), self.len())
    }
}

/// Total length of a scatter-gather list.
pub fn iov_len(iov: &[IoVec]) -> u64 {
    iov.iter().map(|v| v.len() as u64).sum()
}

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoOp {
    /// Fill the buffers from `offset`.
    Read,
    /// Write the buffers at `offset`.
    Write,
    /// Make every write completed before this request was pushed durable.
    Flush,
    /// Deallocate `len` bytes at `offset` (see `BlockDevice::discard`).
    Discard,
    /// Make `len` bytes at `offset` read as zeros.
    WriteZeroes,
}

impl IoOp {
    pub fn name(self) -> &'static str {
        match self {
            IoOp::Read => "read",
            IoOp::Write => "write",
            IoOp::Flush => "flush",
            IoOp::Discard => "discard",
            IoOp::WriteZeroes => "write zeroes",
        }
    }

    /// Changes the device's contents.
    pub fn modifies(self) -> bool {
        matches!(self, IoOp::Write | IoOp::Discard | IoOp::WriteZeroes)
    }
}

/// One request as pushed into a queue.
#[derive(Debug, Clone, Copy)]
pub struct IoRequest<'a> {
    pub op: IoOp,
    /// Byte offset on the device (ignored by `Flush`).
    pub offset: u64,
    /// Bytes to discard or zero; for `Read`/`Write` the buffers' total length.
    pub len: u64,
    /// The buffers of a `Read` or `Write`; empty otherwise.
    pub buffers: &'a IoBuffers,
    /// `Write`: complete only once the data is durable (NBD's FUA, a guest without a write
    /// cache).
    pub fua: bool,
    /// The caller's name for the request, handed back with its completion.
    pub tag: u64,
}

impl<'a> IoRequest<'a> {
    pub fn read(offset: u64, buffers: &'a IoBuffers, tag: u64) -> Self {
        IoRequest {
            op: IoOp::Read,
            offset,
            len: buffers.len(),
            buffers,
            fua: false,
            tag,
        }
    }

    pub fn write(offset: u64, buffers: &'a IoBuffers, fua: bool, tag: u64) -> Self {
        IoRequest {
            op: IoOp::Write,
            offset,
            len: buffers.len(),
            buffers,
            fua,
            tag,
        }
    }

    pub fn flush(tag: u64) -> Self {
        IoRequest {
            op: IoOp::Flush,
            offset: 0,
            len: 0,
            buffers: &io_buffers::NO_BUFFERS,
            fua: false,
            tag,
        }
    }

    /// `Discard` or `WriteZeroes` of a range.
    pub fn range(op: IoOp, offset: u64, len: u64, tag: u64) -> Self {
        IoRequest {
            op,
            offset,
            len,
            buffers: &io_buffers::NO_BUFFERS,
            fua: false,
            tag,
        }
    }
}

/// A finished request.
#[derive(Debug)]
pub struct Completion {
    pub tag: u64,
    pub result: Result<(), BlockError>,
}

/// The queue already holds `capacity()` requests: drain completions first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("I/O queue full ({0} requests in flight)")]
pub struct QueueFull(pub usize);

/// How to open a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueOptions {
    /// Requests in flight at most (a virtqueue's size, an NBD connection's window).
    pub depth: usize,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions { depth: 128 }
    }
}

/// A device's asynchronous request queue, owned by one thread at a time (it may move between
/// threads, and `drain`/`wait` may run on another thread than `push` if the owner serialises
/// the calls, e.g. with a mutex).
pub trait IoQueue: Send {
    /// An eventfd that becomes readable when `drain` has something to hand out. Wait for it
    /// with poll/epoll; `drain` clears it.
    fn notifier(&self) -> BorrowedFd<'_>;

    /// Most requests in flight at once.
    fn capacity(&self) -> usize;

    /// Requests pushed and not yet handed out by `drain`.
    fn in_flight(&self) -> usize;

    /// Queues a request; nothing reaches the device before `submit`. A request the device
    /// refuses (out of range, read-only, unsupported) is accepted and completes with the
    /// error. The queue keeps a copy of `req.buffers` (and so their memory) until the
    /// request's completion has been handed out by `drain` (or the queue is dropped, which
    /// waits for the kernel to let go of them).
    fn push(&mut self, req: &IoRequest<'_>) -> Result<(), QueueFull>;

    /// Sends every request pushed since the last call to the device (one system call for the
    /// batch where the engine allows).
    fn submit(&mut self) -> Result<(), BlockError>;

    /// Hands every finished request to `out`, without blocking, and clears the notifier
    /// first (so a completion arriving meanwhile leaves it set). A queue layered over others
    /// that share its eventfd clears it once, before draining them all.
    fn drain(&mut self, out: &mut dyn FnMut(Completion));

    /// Blocks until `drain` has something to hand out (or nothing is in flight).
    fn wait(&mut self);
}

/// Runs one request to its end on a queue of its own: for callers (tests, one-off tools) that
/// want the asynchronous path with synchronous ergonomics.
pub fn run_one(queue: &mut dyn IoQueue, req: &IoRequest<'_>) -> Result<(), BlockError> {
    queue
        .push(req)
        .map_err(|e| BlockError::new(crate::BlockErrorKind::Io, e.to_string()))?;
    queue.submit()?;
    let mut result = None;
    while result.is_none() {
        queue.drain(&mut |c| {
            if c.tag == req.tag {
                result = Some(c.result);
            }
        });
        if result.is_none() {
            queue.wait();
        }
    }
    result.unwrap_or(Ok(()))
}

/// Reads `buf.len()` bytes at `offset` through `queue` (one request under tag `u64::MAX`, via a
/// buffer of its own): for tests and one-off tools.
pub fn read_at(queue: &mut dyn IoQueue, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
    let mut owned = Arc::new(OwnedBuffer::zeroed(buf.len()));
    let mut buffers = IoBuffers::whole(owned.clone(), buf.len()).map_err(buffer_error)?;
    let result = run_one(queue, &IoRequest::read(offset, &buffers, u64::MAX));
    buffers.clear();
    if let Some(owned) = Arc::get_mut(&mut owned) {
        buf.copy_from_slice(&owned.bytes_mut()[..buf.len()]);
    }
    result
}

/// Writes `data` at `offset` through `queue`, as [`read_at`].
pub fn write_at(queue: &mut dyn IoQueue, offset: u64, data: &[u8]) -> Result<(), BlockError> {
    let owned = Arc::new(OwnedBuffer::from_bytes(data));
    let buffers = IoBuffers::whole(owned, data.len()).map_err(buffer_error)?;
    run_one(queue, &IoRequest::write(offset, &buffers, false, u64::MAX))
}

fn buffer_error(e: BufferError) -> BlockError {
    BlockError::new(crate::BlockErrorKind::Io, e.to_string())
}
