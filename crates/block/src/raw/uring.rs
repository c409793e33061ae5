//! The `io_uring` aio engine for raw files: one ring per queue (so per frontend thread),
//! requests of a batch sent with one `io_uring_enter`, the file's descriptors registered with
//! the ring, completions signalled on an eventfd registered with it.
//!
//! Buffers the device can use as they are (direct-I/O aligned, or any buffer without
//! O_DIRECT) go to the kernel as the request's own iovecs; misaligned memory goes through an
//! aligned bounce buffer of the slot's. A short transfer is continued from where it stopped
//! (a read past the end of the file reads zeros, as the synchronous path does).

use super::direct::Route;
use super::Files;
use crate::aio::{copy, Engine, IoBuffers, IoOp, IoVec, Notifier, Scratch, SlotRequest};
use crate::{AlignedBuf, BlockError};
use io_uring::{opcode, squeue, types, IoUring};
use rustix::fs::OFlags;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, OnceLock};

/// Index of the buffered descriptor among the ring's registered files.
const BUFFERED: u32 = 0;
/// Index of the O_DIRECT descriptor (registered only when the file has one).
const DIRECT: u32 = 1;
/// Zeros written per request where the filesystem cannot zero a range (tmpfs).
const ZERO_CHUNK: usize = 1 << 20;

fn zero_chunk() -> &'static AlignedBuf {
    static ZEROS: OnceLock<AlignedBuf> = OnceLock::new();
    ZEROS.get_or_init(|| AlignedBuf::zeroed(ZERO_CHUNK))
}

/// What a slot's transfer needs while the kernel runs it.
#[derive(Default)]
struct UringTransfer {
    op: Option<IoOp>,
    offset: u64,
    len: u64,
    fua: bool,
    file: u32,
    /// The request's buffers (reads, writes), holding their memory until the slot is released.
    buffers: IoBuffers,
    /// What the current submission transfers: `iov` after `done` bytes, or the bounce.
    work: Vec<IoVec>,
    /// Bytes transferred so far.
    done: u64,
    bounce: Scratch,
    bounced: bool,
    /// WriteZeroes fell back to writing zeros.
    writing_zeros: bool,
}

pub(super) struct UringEngine {
    ring: IoUring,
    /// The buffered descriptor registered with the ring (not the locked one).
    _buffered: std::fs::File,
    files: Arc<Files>,
    /// The pipeline's, registered with the ring.
    _notifier: Arc<Notifier>,
    /// By the pipeline's slot index.
    transfers: Vec<UringTransfer>,
    /// SQEs queued since the last `submit`.
    unsubmitted: usize,
    /// SQEs queued whose CQE has not been taken off the ring: the kernel may be using their
    /// buffers. What `Drop` waits for.
    in_kernel: usize,
    /// Completion entries copied out of the ring before they are handled.
    cqes: Vec<(u64, i32)>,
}

impl UringEngine {
    pub(super) fn new(
        files: Arc<Files>,
        capacity: usize,
        notifier: Arc<Notifier>,
    ) -> Result<Self, BlockError> {
        let entries = u32::try_from(capacity.next_power_of_two()).unwrap_or(4096);
        let ring = IoUring::builder()
            .build(entries)
            .map_err(|e| BlockError::io("io_uring_setup", e))?;
        // The ring gets descriptions of the file of its own. Registered files live as long as
        // the ring, whose teardown the kernel finishes in a worker after the process is gone:
        // were the image's locked description among them, a daemon killed with SIGKILL would
        // keep its image locked for a while after it died, and its restart would fail.
        let buffered = reopen(&files.buffered)
            .map_err(|e| BlockError::io("reopen for io_uring", e).with_path(&files.path))?;
        let mut fds: Vec<RawFd> = vec![buffered.as_raw_fd()];
        if let Some(direct) = &files.direct {
            fds.push(direct.as_raw_fd());
        }
        ring.submitter()
            .register_files(&fds)
            .map_err(|e| BlockError::io("io_uring register files", e))?;
        ring.submitter()
            .register_eventfd(notifier.as_raw_fd())
            .map_err(|e| BlockError::io("io_uring register eventfd", e))?;
        Ok(UringEngine {
            ring,
            _buffered: buffered,
            files,
            _notifier: notifier,
            transfers: (0..capacity).map(|_| UringTransfer::default()).collect(),
            unsubmitted: 0,
            in_kernel: 0,
            cqes: Vec::with_capacity(capacity),
        })
    }

    /// Queues the slot's next SQE (its first one, or the continuation of a short transfer).
    fn queue_sqe(&mut self, index: usize) {
        let slot = &mut self.transfers[index];
        let Some(op) = slot.op else { return };
        let file = types::Fixed(slot.file);
        let at = slot.offset + slot.done;
        let entry = match op {
            IoOp::Read | IoOp::Write => {
                let list = if slot.bounced {
                    // The bounce holds the whole transfer; continue inside it.
                    let b = slot.work[0];
                    let skip = slot.done as usize;
                    slot.work.truncate(1);
                    slot.work
                        .push(IoVec::from_raw(b.base().wrapping_add(skip), b.len() - skip));
                    &slot.work[1..]
                } else {
                    copy::advance(slot.buffers.iov(), slot.done as usize, &mut slot.work);
                    &slot.work[..]
                };
                let count = list.len() as u32;
                let ptr = IoVec::as_iovec_ptr(list);
                let flags = if op == IoOp::Write && slot.fua {
                    libc::RWF_DSYNC
                } else {
                    0
                };
                if op == IoOp::Read {
                    opcode::Readv::new(file, ptr, count).offset(at).build()
                } else {
                    opcode::Writev::new(file, ptr, count)
                        .offset(at)
                        .rw_flags(flags)
                        .build()
                }
            }
            IoOp::Flush => opcode::Fsync::new(file)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            IoOp::Discard => opcode::Fallocate::new(file, slot.len)
                .offset(slot.offset)
                .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
            IoOp::WriteZeroes if slot.writing_zeros => {
                let n = (slot.len - slot.done).min(ZERO_CHUNK as u64) as u32;
                opcode::Write::new(file, zero_chunk().as_ptr(), n)
                    .offset(at)
                    .build()
            }
            IoOp::WriteZeroes => opcode::Fallocate::new(file, slot.len)
                .offset(slot.offset)
                .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
                .build(),
        };
        let entry: squeue::Entry = entry.user_data(index as u64);
        // SAFETY: the SQE points at the slot's iovec list (kept until its completion is
        // reaped), at the request's buffers (the slot's `IoBuffers` keep them valid until
        // then), or at the static zero chunk. The
        // ring has room: requests in flight never exceed its size, and each has one SQE at a
        // time.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        debug_assert!(pushed.is_ok(), "submission queue overflow");
        self.unsubmitted += 1;
        self.in_kernel += 1;
    }

    fn enter(&mut self, wait_for: usize) -> Result<(), BlockError> {
        loop {
            let result = if wait_for > 0 {
                self.ring.submit_and_wait(wait_for)
            } else {
                self.ring.submit()
            };
            match result {
                Ok(_) => {
                    self.unsubmitted = 0;
                    return Ok(());
                }
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                    ) =>
                {
                    std::thread::yield_now();
                }
                Err(e) => return Err(BlockError::io("io_uring_enter", e)),
            }
        }
    }

    /// Handles one completion entry; returns the request's result once it is finished, or
    /// `None` when it continues (a continuation SQE was queued) or the entry is stray.
    fn complete_entry(&mut self, index: usize, res: i32) -> Option<Result<(), BlockError>> {
        let files = &*self.files;
        let slot = &mut self.transfers[index];
        let op = slot.op?;
        let failed = |errno: i32, slot: &UringTransfer| {
            let e = std::io::Error::from_raw_os_error(errno);
            Err(files.err(op.name(), e, slot.offset + slot.done))
        };
        let result = match op {
            IoOp::Read | IoOp::Write => {
                if res < 0 {
                    Some(failed(-res, slot))
                } else if res == 0 && slot.done < slot.len {
                    if op == IoOp::Write {
                        Some(failed(libc::EIO, slot))
                    } else {
                        // Past the end of the file (it shrank under us): the rest reads as
                        // zeros, as it does on the synchronous path.
                        if slot.bounced {
                            slot.bounce.take(slot.len as usize)[slot.done as usize..].fill(0);
                        } else {
                            copy::zero_fill(&slot.buffers, slot.done as usize);
                        }
                        slot.done = slot.len;
                        Some(Ok(()))
                    }
                } else {
                    slot.done += res as u64;
                    (slot.done >= slot.len).then_some(Ok(()))
                }
            }
            IoOp::WriteZeroes if !slot.writing_zeros && res == -libc::EOPNOTSUPP => {
                // tmpfs and others cannot zero a range in place: write zeros instead.
                slot.writing_zeros = true;
                slot.done = 0;
                slot.file = if files.direct.is_some() {
                    DIRECT
                } else {
                    BUFFERED
                };
                None
            }
            IoOp::WriteZeroes if slot.writing_zeros => {
                if res <= 0 {
                    Some(failed(if res < 0 { -res } else { libc::EIO }, slot))
                } else {
                    slot.done += res as u64;
                    (slot.done >= slot.len).then_some(Ok(()))
                }
            }
            _ if res < 0 => Some(failed(-res, slot)),
            _ => Some(Ok(())),
        };
        match result {
            None => {
                self.queue_sqe(index);
                None
            }
            Some(Ok(())) if op == IoOp::Read && slot.bounced => {
                copy::scatter(slot.bounce.take(slot.len as usize), &slot.buffers, 0);
                Some(Ok(()))
            }
            done => done,
        }
    }

    fn release(&mut self, index: usize) {
        let slot = &mut self.transfers[index];
        slot.op = None;
        slot.buffers.clear();
        slot.work.clear();
        slot.bounce.release();
    }
}

impl Engine for UringEngine {
    fn start(&mut self, index: usize, req: &SlotRequest) -> Option<Result<(), BlockError>> {
        let f = &*self.files;
        let no_op = match req.op {
            IoOp::Flush => !f.writable || f.cache.ignore_flush(),
            IoOp::Read | IoOp::Write | IoOp::Discard | IoOp::WriteZeroes => req.len == 0,
        };
        if no_op {
            return Some(Ok(()));
        }
        let route = match req.op {
            IoOp::Read | IoOp::Write => f.route_iov(req.buffers.iov(), req.offset),
            _ => Route::Buffered,
        };
        let has_direct = f.direct.is_some();
        let slot = &mut self.transfers[index];
        slot.op = Some(req.op);
        slot.offset = req.offset;
        slot.len = req.len;
        slot.fua = req.fua;
        slot.done = 0;
        slot.writing_zeros = false;
        slot.bounced = route == Route::Bounce;
        slot.file = match route {
            Route::Direct | Route::Bounce if has_direct => DIRECT,
            _ => BUFFERED,
        };
        slot.buffers.copy_from(&req.buffers);
        slot.work.clear();
        if slot.bounced {
            let bounce = slot.bounce.take(req.len as usize);
            if req.op == IoOp::Write {
                copy::gather(&req.buffers, 0, bounce);
            }
            slot.work.push(IoVec::from_slice(bounce));
        }
        self.queue_sqe(index);
        None
    }

    fn submit(&mut self) -> Result<(), BlockError> {
        if self.unsubmitted == 0 {
            return Ok(());
        }
        self.enter(0)
    }

    fn reap(&mut self, out: &mut dyn FnMut(usize, Result<(), BlockError>)) {
        self.cqes.clear();
        self.cqes
            .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        self.in_kernel -= self.cqes.len();
        let mut cqes = std::mem::take(&mut self.cqes);
        for &(index, res) in &cqes {
            let Some(index) = usize::try_from(index)
                .ok()
                .filter(|&i| i < self.transfers.len())
            else {
                continue;
            };
            if let Some(result) = self.complete_entry(index, res) {
                self.release(index);
                out(index, result);
            }
        }
        cqes.clear();
        self.cqes = cqes;
        if self.unsubmitted > 0 {
            if let Err(e) = self.enter(0) {
                // The continuations stay queued in the ring; the next submit sends them.
                tracing::error!("resubmitting short transfers: {e}");
            }
        }
    }

    fn wait(&mut self) {
        if self.in_kernel == 0 || !self.ring.completion().is_empty() {
            return;
        }
        if let Err(e) = self.enter(1) {
            tracing::error!("waiting for I/O completions: {e}");
            // Do not spin at full speed on a broken ring.
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

impl Drop for UringEngine {
    /// The kernel may still read or write the buffers of requests in flight (and this
    /// queue's own iovec lists and bounce buffers): wait until it has let go of every one.
    /// Their completions are not handed out.
    fn drop(&mut self) {
        while self.in_kernel > 0 {
            if self.enter(1).is_err() {
                break;
            }
            let n = self.ring.completion().count();
            self.in_kernel -= n;
        }
        // The ring's own teardown runs later in a kernel worker and only then lets go of the
        // registered files; the image's lock lives as long as they do. Unregistering drops
        // them now, so the image is free for its next user when the queue is gone.
        let _ = self.ring.submitter().unregister_files();
    }
}

/// A new open file description of the file behind `file` (same access mode and flags), not
/// sharing its locks.
fn reopen(file: &std::fs::File) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let flags = rustix::fs::fcntl_getfl(file)?;
    let writable = flags & OFlags::ACCMODE == OFlags::RDWR;
    std::fs::OpenOptions::new()
        .read(true)
        .write(writable)
        .custom_flags((flags & OFlags::DSYNC).bits() as i32)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
}
