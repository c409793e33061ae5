//! `SyncQueue`: any `BlockDevice` as an `IoQueue`, its synchronous methods run on the I/O
//! thread pool. The device only ever sees bounce buffers of the queue's own: the request's
//! buffers (possibly guest memory) are copied through raw pointers, never lent as Rust
//! references.

use super::threaded::{BlockingIo, JobRequest, Scratch, ThreadedQueue};
use super::{Completion, IoOp, IoQueue, IoRequest, Notifier, QueueFull, QueueOptions};
use crate::{BlockDevice, BlockError};
use std::os::fd::RawFd;
use std::sync::Arc;

/// Largest bounce buffer per call; longer requests are done in pieces of this size.
const PIECE: usize = 1 << 20;

struct DeviceIo {
    device: Arc<dyn BlockDevice>,
}

impl BlockingIo for DeviceIo {
    unsafe fn run(&self, req: &JobRequest, scratch: &mut Scratch) -> Result<(), BlockError> {
        let device = &*self.device;
        match req.op {
            IoOp::Read | IoOp::Write => {
                let mut offset = req.offset;
                let mut done = 0usize;
                let total = req.len as usize;
                while done < total {
                    let n = (total - done).min(PIECE);
                    let buf = scratch.take(n);
                    if req.op == IoOp::Read {
                        device.read_at(buf, offset)?;
                        // SAFETY: the request's buffers are valid for writes (push contract)
                        // and `done + n` is within their total length.
                        unsafe { super::copy::scatter(buf, &req.iov, done) };
                    } else {
                        // SAFETY: the request's buffers are valid for reads (push contract).
                        unsafe { super::copy::gather(&req.iov, done, buf) };
                        device.write_at(buf, offset)?;
                    }
                    done += n;
                    offset += n as u64;
                }
                if req.op == IoOp::Write && req.fua {
                    device.flush()?;
                }
                Ok(())
            }
            IoOp::Flush => device.flush(),
            IoOp::Discard => device.discard(req.offset, req.len),
            IoOp::WriteZeroes => device.write_zeroes(req.offset, req.len),
        }
    }
}

/// Serves any `BlockDevice` asynchronously from the I/O thread pool.
pub struct SyncQueue {
    inner: ThreadedQueue<DeviceIo>,
}

impl SyncQueue {
    pub fn new(device: Arc<dyn BlockDevice>, opts: &QueueOptions) -> Result<Self, BlockError> {
        Ok(SyncQueue {
            inner: ThreadedQueue::new(Arc::new(DeviceIo { device }), opts.depth)?,
        })
    }

    /// A queue whose completions signal `notifier` (a clone of a parent queue's), so that a
    /// layered queue can send some requests here and wait on one eventfd for all of them.
    /// The parent clears the notifier before it drains this queue; this queue never clears
    /// it (that could swallow the wake-up of a completion the parent has yet to collect).
    pub fn with_notifier(
        device: Arc<dyn BlockDevice>,
        opts: &QueueOptions,
        notifier: Notifier,
    ) -> Self {
        SyncQueue {
            inner: ThreadedQueue::with_notifier(
                Arc::new(DeviceIo { device }),
                opts.depth,
                notifier,
            ),
        }
    }
}

impl IoQueue for SyncQueue {
    fn notifier(&self) -> RawFd {
        self.inner.notifier()
    }
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
    unsafe fn push(&mut self, req: &IoRequest<'_>) -> Result<(), QueueFull> {
        // SAFETY: forwarded.
        unsafe { self.inner.push(req) }
    }
    fn submit(&mut self) -> Result<(), BlockError> {
        self.inner.submit()
    }
    fn drain(&mut self, out: &mut dyn FnMut(Completion)) {
        self.inner.drain(out)
    }
    fn wait(&mut self) {
        self.inner.wait()
    }
}
