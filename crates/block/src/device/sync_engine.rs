//! Any `BlockDevice`'s synchronous methods as the blocking half of an engine
//! ([`Pipeline::synchronous`](crate::aio::Pipeline::synchronous), a stage's synchronous path). The
//! device only ever sees bounce buffers of the engine's own: the request's buffers (possibly
//! guest memory) are copied through raw pointers, never lent as Rust references.

use crate::aio::threaded::{BlockingIo, ThreadedEngine};
use crate::aio::{copy, Engine, IoOp, Notifier, Scratch, SlotRequest};
use crate::{BlockDevice, BlockError};
use std::sync::Arc;

/// Largest bounce buffer per call; longer requests are done in pieces of this size.
const PIECE: usize = 1 << 20;

/// An engine running `device`'s synchronous methods on the I/O thread pool.
pub(crate) fn engine(
    device: Arc<dyn BlockDevice>,
    capacity: usize,
    notifier: Arc<Notifier>,
) -> Box<dyn Engine> {
    Box::new(ThreadedEngine::new(DeviceIo { device }, capacity, notifier))
}

struct DeviceIo {
    device: Arc<dyn BlockDevice>,
}

impl BlockingIo for DeviceIo {
    fn run(&self, req: &SlotRequest, scratch: &mut Scratch) -> Result<(), BlockError> {
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
                        copy::scatter(buf, &req.buffers, done);
                    } else {
                        copy::gather(&req.buffers, done, buf);
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
