//! The `threads` aio engine for raw files: each request is one positioned vectored system call
//! (`preadv2`/`pwritev2`, `fdatasync`, `fallocate`) on an I/O pool thread, straight from and
//! into the request's buffers when they meet the direct-I/O alignment.

use super::direct::Route;
use super::Files;
use crate::aio::threaded::{BlockingIo, ThreadedEngine};
use crate::aio::{copy, Engine, IoOp, IoVec, Notifier, Scratch, SlotRequest};
use crate::BlockError;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;

/// The engine of a raw file's pipeline on the I/O threads.
pub(super) fn engine(
    files: Arc<Files>,
    capacity: usize,
    notifier: Arc<Notifier>,
) -> Box<dyn Engine> {
    Box::new(ThreadedEngine::new(RawIo { files }, capacity, notifier))
}

struct RawIo {
    files: Arc<Files>,
}

impl BlockingIo for RawIo {
    fn run(&self, req: &SlotRequest, scratch: &mut Scratch) -> Result<(), BlockError> {
        let f = &*self.files;
        match req.op {
            IoOp::Read | IoOp::Write => {
                let route = f.route_iov(req.buffers.iov(), req.offset);
                let fd = f.fd_for(route);
                let flags = if req.op == IoOp::Write && req.fua {
                    libc::RWF_DSYNC
                } else {
                    0
                };
                let result = if route == Route::Bounce {
                    let buf = scratch.take(req.len as usize);
                    let one = [IoVec::from_slice(buf)];
                    if req.op == IoOp::Write {
                        copy::gather(&req.buffers, 0, buf);
                    }
                    // SAFETY: `one` is our own bounce buffer.
                    let r = unsafe { transfer(fd, req.op, &one, req.offset, flags) };
                    if let (Ok(n), IoOp::Read) = (&r, req.op) {
                        buf[*n..].fill(0);
                        copy::scatter(buf, &req.buffers, 0);
                    }
                    r
                } else {
                    // SAFETY: the request's `IoBuffers` keep its memory valid for the call.
                    let r = unsafe { transfer(fd, req.op, req.buffers.iov(), req.offset, flags) };
                    if let (Ok(n), IoOp::Read) = (&r, req.op) {
                        copy::zero_fill(&req.buffers, *n);
                    }
                    r
                };
                result
                    .map(drop)
                    .map_err(|e| f.err(req.op.name(), e, req.offset))
            }
            IoOp::Flush => f.flush(),
            IoOp::Discard => f.punch_hole(req.offset, req.len),
            IoOp::WriteZeroes => f.write_zeroes(req.offset, req.len),
        }
    }
}

/// Reads or writes the whole list at `offset` with `preadv2`/`pwritev2`, continuing after
/// short transfers. Returns the bytes transferred: short only for a read that reached the end
/// of the file (it shrank under us), whose rest the caller fills with zeros, as
/// `RawFile::read_at` does.
///
/// # Safety
/// The list's buffers are valid for the transfer's direction.
unsafe fn transfer(
    fd: &File,
    op: IoOp,
    iov: &[IoVec],
    offset: u64,
    flags: libc::c_int,
) -> std::io::Result<usize> {
    let total = crate::aio::iov_len(iov) as usize;
    let mut done = 0usize;
    let mut rest = Vec::new();
    while done < total {
        let list = if done == 0 {
            iov
        } else {
            copy::advance(iov, done, &mut rest);
            &rest
        };
        let count = libc::c_int::try_from(list.len())
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        let at = i64::try_from(offset + done as u64)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        let ptr = IoVec::as_iovec_ptr(list);
        // SAFETY: `ptr` points at `count` iovecs describing memory the caller vouched for;
        // the descriptor is open for the duration of the call.
        let n = unsafe {
            if op == IoOp::Read {
                libc::preadv2(fd.as_raw_fd(), ptr, count, at, flags)
            } else {
                libc::pwritev2(fd.as_raw_fd(), ptr, count, at, flags)
            }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            if op == IoOp::Read {
                return Ok(done);
            }
            return Err(std::io::Error::from(std::io::ErrorKind::WriteZero));
        }
        done += n as usize;
    }
    Ok(done)
}
