//! The encrypted volume's asynchronous queue: crypto composed with the backend's queue.
//!
//! - A read is submitted into the caller's buffers (guest memory) and decrypted there in
//!   place when it completes: with O_DIRECT that is one DMA plus one pass of decryption.
//! - A write is encrypted from the caller's buffers into a pooled bounce buffer (never in
//!   place: the caller's data must not change), which is then submitted.
//! - Large runs are split across the crypto pool (`CryptoPool::crypt_raw`).
//! - What the fast path cannot do — requests not aligned to the encryption sector (read-
//!   modify-write of the edge sectors, serialised per sector), buffers whose segments split a
//!   sector, write-zeroes — runs on the volume's synchronous path on the I/O thread pool
//!   (`SyncQueue`), signalling the same eventfd. Those are rare: clients are told the sector
//!   size as the logical block size.

use super::{crypto_error, CryptCore};
use crate::aio::{
    iov_len, open_queue, Completion, IoOp, IoQueue, IoRequest, IoVec, Notifier, QueueFull,
    QueueOptions, SyncQueue,
};
use crate::device::check_range;
use crate::{AlignedBuf, BlockDevice, BlockError};
use cryptblk_crypto::Direction;
use std::os::fd::RawFd;
use std::sync::Arc;

/// A request on its way through the backend's queue.
#[derive(Default)]
struct Slot {
    tag: u64,
    op: Option<IoOp>,
    /// Payload offset of a read (for its IVs).
    offset: u64,
    /// A read's buffers, decrypted in place when it completes.
    iov: Vec<IoVec>,
    /// A write's ciphertext.
    bounce: Option<AlignedBuf>,
}

pub(crate) struct CryptQueue {
    core: Arc<CryptCore>,
    inner: Box<dyn IoQueue>,
    fallback: SyncQueue,
    /// Signals the shared eventfd for requests finished at push.
    signal: Notifier,
    slots: Vec<Slot>,
    free: Vec<u32>,
    ready: Vec<Completion>,
    capacity: usize,
    in_flight: usize,
}

impl CryptQueue {
    pub(crate) fn open(core: Arc<CryptCore>, opts: &QueueOptions) -> Result<Self, BlockError> {
        let inner = open_queue(&core.backend, opts)?;
        let signal =
            Notifier::dup_of(inner.notifier()).map_err(|e| BlockError::io("dup eventfd", e))?;
        let fallback_signal = signal
            .try_clone()
            .map_err(|e| BlockError::io("dup eventfd", e))?;
        let volume: Arc<dyn BlockDevice> = core.clone();
        let fallback = SyncQueue::with_notifier(volume, opts, fallback_signal);
        let capacity = inner.capacity();
        Ok(CryptQueue {
            core,
            inner,
            fallback,
            signal,
            slots: (0..capacity).map(|_| Slot::default()).collect(),
            free: (0..capacity as u32).rev().collect(),
            ready: Vec::new(),
            capacity,
            in_flight: 0,
        })
    }

    fn finish_now(&mut self, tag: u64, result: Result<(), BlockError>) {
        self.in_flight += 1;
        self.ready.push(Completion { tag, result });
        self.signal.notify();
    }

    /// Whether a read or write can take the fast path: whole sectors, and no sector split
    /// between two buffers.
    fn sector_aligned(&self, req: &IoRequest<'_>) -> bool {
        let ss = self.core.sector;
        req.offset.is_multiple_of(ss) && req.iov.iter().all(|v| (v.len() as u64).is_multiple_of(ss))
    }

    /// Encrypts the request's buffers into `bounce`.
    ///
    /// # Safety
    /// The buffers are readable for their lengths.
    unsafe fn encrypt_into(
        &self,
        offset: u64,
        iov: &[IoVec],
        bounce: &mut AlignedBuf,
    ) -> Result<(), BlockError> {
        let core = &*self.core;
        let mut pos = 0usize;
        for v in iov {
            let off = offset + pos as u64;
            // SAFETY: the segment is readable (caller), the bounce range `pos..pos + len` is
            // ours and inside it (the bounce holds the whole request), and they are disjoint.
            unsafe {
                core.pool.crypt_raw(
                    &core.cipher,
                    Direction::Encrypt,
                    core.iv_sector(off),
                    v.base(),
                    bounce.as_mut_ptr().add(pos),
                    v.len(),
                )
            }
            .map_err(|e| crypto_error(Direction::Encrypt, off, e))?;
            pos += v.len();
        }
        Ok(())
    }

    /// Hands a request to the synchronous path.
    ///
    /// # Safety
    /// As `IoQueue::push`.
    unsafe fn push_fallback(&mut self, req: &IoRequest<'_>) -> Result<(), QueueFull> {
        // SAFETY: forwarded.
        unsafe { self.fallback.push(req) }?;
        self.in_flight += 1;
        Ok(())
    }
}

/// Decrypts a completed read in place.
///
/// # Safety
/// The buffers are readable and writable for their lengths.
unsafe fn decrypt_in_place(core: &CryptCore, offset: u64, iov: &[IoVec]) -> Result<(), BlockError> {
    let mut pos = 0u64;
    for v in iov {
        let off = offset + pos;
        // SAFETY: in place on a segment the caller vouched for.
        unsafe {
            core.pool.crypt_raw(
                &core.cipher,
                Direction::Decrypt,
                core.iv_sector(off),
                v.base(),
                v.base(),
                v.len(),
            )
        }
        .map_err(|e| crypto_error(Direction::Decrypt, off, e))?;
        pos += v.len() as u64;
    }
    Ok(())
}

impl IoQueue for CryptQueue {
    fn notifier(&self) -> RawFd {
        self.inner.notifier()
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
        let core = &*self.core;
        if req.op.modifies() && core.read_only() {
            self.finish_now(
                req.tag,
                Err(BlockError::read_only(req.op.name()).at(req.offset)),
            );
            return Ok(());
        }
        if req.op != IoOp::Flush {
            if let Err(e) = check_range(req.op.name(), req.offset, req.len, core.size) {
                self.finish_now(req.tag, Err(e));
                return Ok(());
            }
        }
        let data_offset = core.layout.data_offset;
        let inner_req;
        let mut bounce = None;
        match req.op {
            IoOp::Read | IoOp::Write if !self.sector_aligned(req) => {
                // SAFETY: forwarded.
                return unsafe { self.push_fallback(req) };
            }
            IoOp::WriteZeroes => {
                // SAFETY: forwarded (no buffers).
                return unsafe { self.push_fallback(req) };
            }
            IoOp::Read => inner_req = IoRequest::read(data_offset + req.offset, req.iov, 0),
            IoOp::Write => {
                let mut buf = core.bounce.take_owned(req.len as usize);
                // SAFETY: the request's buffers are readable (this function's contract).
                if let Err(e) = unsafe { self.encrypt_into(req.offset, req.iov, &mut buf) } {
                    self.core.bounce.put_back(buf);
                    self.finish_now(req.tag, Err(e));
                    return Ok(());
                }
                bounce = Some(buf);
                inner_req = IoRequest::write(data_offset + req.offset, &[], req.fua, 0);
            }
            IoOp::Flush => inner_req = IoRequest::flush(0),
            IoOp::Discard => {
                // Only whole sectors: discarding a partial one would destroy its neighbours.
                let ss = core.sector;
                let start = req.offset.div_ceil(ss) * ss;
                let end = (req.offset + req.len) / ss * ss;
                if end <= start {
                    self.finish_now(req.tag, Ok(()));
                    return Ok(());
                }
                inner_req = IoRequest::range(IoOp::Discard, data_offset + start, end - start, 0);
            }
        }
        let Some(index) = self.free.pop() else {
            if let Some(buf) = bounce {
                self.core.bounce.put_back(buf);
            }
            return Err(QueueFull(self.in_flight));
        };
        let slot = &mut self.slots[index as usize];
        slot.tag = req.tag;
        slot.op = Some(req.op);
        slot.offset = req.offset;
        slot.iov.clear();
        if req.op == IoOp::Read {
            slot.iov.extend_from_slice(req.iov);
        }
        slot.bounce = bounce;
        let one;
        let mut inner_req = IoRequest {
            tag: u64::from(index),
            ..inner_req
        };
        if let Some(buf) = slot.bounce.as_mut() {
            one = [IoVec::from_raw(buf.as_mut_ptr(), req.len as usize)];
            inner_req.iov = &one;
            inner_req.len = iov_len(&one);
        }
        // SAFETY: reads go into the caller's buffers, valid as this function was promised;
        // writes come from the slot's bounce buffer, kept until the completion is drained.
        match unsafe { self.inner.push(&inner_req) } {
            Ok(()) => {
                self.in_flight += 1;
                Ok(())
            }
            Err(full) => {
                let slot = &mut self.slots[index as usize];
                slot.op = None;
                if let Some(buf) = slot.bounce.take() {
                    self.core.bounce.put_back(buf);
                }
                self.free.push(index);
                Err(full)
            }
        }
    }

    fn submit(&mut self) -> Result<(), BlockError> {
        self.fallback.submit()?;
        self.inner.submit()
    }

    fn drain(&mut self, out: &mut dyn FnMut(Completion)) {
        self.signal.clear();
        let CryptQueue {
            core,
            inner,
            fallback,
            slots,
            free,
            ready,
            in_flight,
            ..
        } = self;
        inner.drain(&mut |c| {
            let Ok(index) = u32::try_from(c.tag) else {
                return;
            };
            let Some(slot) = slots.get_mut(index as usize) else {
                return;
            };
            let Some(op) = slot.op.take() else { return };
            let mut result = c.result;
            if op == IoOp::Read && result.is_ok() {
                // SAFETY: the read's buffers are valid until its completion is handed out,
                // which happens just below.
                result = unsafe { decrypt_in_place(core, slot.offset, &slot.iov) };
            }
            if let Some(buf) = slot.bounce.take() {
                core.bounce.put_back(buf);
            }
            slot.iov.clear();
            free.push(index);
            *in_flight -= 1;
            out(Completion {
                tag: slot.tag,
                result,
            });
        });
        fallback.drain(&mut |c| {
            *in_flight -= 1;
            out(c);
        });
        for c in ready.drain(..) {
            *in_flight -= 1;
            out(c);
        }
    }

    fn wait(&mut self) {
        if !self.ready.is_empty() {
            return;
        }
        if self.fallback.in_flight() > 0 {
            // Both queues signal the same eventfd; wait on it rather than on either queue.
            let mut pfd = libc::pollfd {
                fd: self.inner.notifier(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, length 1.
            unsafe { libc::poll(&mut pfd, 1, -1) };
        } else {
            self.inner.wait();
        }
    }
}
