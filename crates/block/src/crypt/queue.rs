//! The encrypted volume's asynchronous queue: crypto composed with the backend's queue.
//!
//! - A read is submitted into the caller's buffers (guest memory) and decrypted there in
//!   place when it completes: with O_DIRECT that is one DMA plus one pass of decryption.
//! - A write is encrypted from the caller's buffers into a pooled bounce buffer (never in
//!   place: the caller's data must not change), which is then submitted.
//! - Crypto runs per request, on the queue's thread, and never waits for another thread: a
//!   write is encrypted when it is pushed, a read is decrypted and handed out as soon as it
//!   completes, one by one, so the owner answers each read while the next is still being
//!   decrypted. A drain decrypts at most `DECRYPT_PER_DRAIN` bytes and then gives the thread
//!   back (with the notifier set again), so a burst of large reads never keeps the owner from
//!   taking the guest's next requests while the device idles. (Sharing a batch's crypto with
//!   pool helpers made the thread wait for a helper that a busy host had descheduled:
//!   measured on 2 vCPUs, it served a half to two thirds of the same server's plain
//!   throughput, see `ARCHITECTURE.md`.) A request larger than the pool's inline threshold is
//!   still split over the pool (`CryptoPool::crypt_raw`). So a queue's crypto costs one core
//!   at most; a guest spreads its I/O over queues (num-queues) as it does over vCPUs.
//! - On an engine that runs each transfer on a pool thread (`threads`), the crypto is handed
//!   to those threads instead (`IoQueue::offload`, `super::offload`): each request is
//!   decrypted or encrypted by the thread that transfers it, right before or after, so a
//!   batch's crypto is spread as widely as its transfers, and nothing waits for a batch.
//! - What the fast path cannot do — requests not aligned to the encryption sector (read-
//!   modify-write of the edge sectors, serialised per sector), buffers whose segments split a
//!   sector, write-zeroes — runs on the volume's synchronous path on the I/O thread pool
//!   (`SyncQueue`), signalling the same eventfd. Those are rare: clients are told the sector
//!   size as the logical block size.

use super::CryptCore;
use crate::aio::{
    open_queue, Completion, IoOp, IoQueue, IoRequest, IoVec, Notifier, QueueFull, QueueOptions,
    SyncQueue,
};
use crate::device::check_range;
use crate::{AlignedBuf, BlockDevice, BlockError};
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::Arc;

/// A request on its way through the backend's queue.
#[derive(Default)]
struct Slot {
    tag: u64,
    op: Option<IoOp>,
    /// Payload offset (for the IVs).
    offset: u64,
    len: u64,
    fua: bool,
    /// A read's buffers (decrypted in place when it completes), a write's plaintext.
    iov: Vec<IoVec>,
    /// A write's ciphertext: its buffer, and the one segment the backend writes.
    bounce: Option<AlignedBuf>,
    ciphertext: Vec<IoVec>,
}

pub(crate) struct CryptQueue {
    core: Arc<CryptCore>,
    inner: Box<dyn IoQueue>,
    fallback: SyncQueue,
    /// The backend's queue runs the crypto itself (`IoQueue::offload`).
    offloaded: bool,
    /// Signals the shared eventfd for requests finished at push or submit.
    signal: Notifier,
    slots: Vec<Slot>,
    free: Vec<u32>,
    ready: Vec<Completion>,
    capacity: usize,
    in_flight: usize,
    /// Requests the backend finished that `drain` has not handed out yet, oldest first.
    completed: VecDeque<(u32, Result<(), BlockError>)>,
}

/// Bytes of reads one `drain` decrypts before it hands the thread back to its owner (leaving
/// the rest for the next call, with the notifier set again): decrypting memory a device has
/// just written runs at a few GB/s, so a burst of large reads would otherwise keep the owner
/// from taking new requests for hundreds of microseconds while the device idles.
const DECRYPT_PER_DRAIN: u64 = 64 * 1024;

impl CryptQueue {
    pub(crate) fn open(core: Arc<CryptCore>, opts: &QueueOptions) -> Result<Self, BlockError> {
        let mut inner = open_queue(&core.backend, opts)?;
        let offloaded = inner.offload(Arc::new(super::offload::VolumeCrypto(core.clone())));
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
            offloaded,
            signal,
            slots: (0..capacity).map(|_| Slot::default()).collect(),
            free: (0..capacity as u32).rev().collect(),
            ready: Vec::new(),
            capacity,
            in_flight: 0,
            completed: VecDeque::new(),
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

    /// Gives a slot back (its bounce buffer to the pool).
    fn release(&mut self, index: u32) {
        let slot = &mut self.slots[index as usize];
        slot.op = None;
        slot.iov.clear();
        if let Some(buf) = slot.bounce.take() {
            self.core.bounce.put_back(buf);
        }
        self.free.push(index);
    }
}

impl CryptQueue {
    /// The bytes to decrypt for a finished request: `Some` for a read that succeeded and
    /// that the backend's threads did not decrypt already.
    fn bytes_to_decrypt(&self, index: u32, result: &Result<(), BlockError>) -> Option<u64> {
        let slot = self.slots.get(index as usize)?;
        (slot.op == Some(IoOp::Read) && result.is_ok() && !self.offloaded).then_some(slot.len)
    }

    /// Encrypts a pushed write from the caller's buffers into its slot's bounce buffer (which
    /// holds the whole request); the slot's `ciphertext` is then the one segment to write.
    fn encrypt_slot(&mut self, index: u32) -> Result<(), BlockError> {
        let slot = &mut self.slots[index as usize];
        let Some(bounce) = slot.bounce.as_mut() else {
            return Err(BlockError::new(
                crate::BlockErrorKind::Io,
                "write without a bounce buffer",
            ));
        };
        // SAFETY: the segments are the write being pushed (readable for the whole call, per
        // `push`'s contract); the bounce buffer holds the whole request and is the slot's own
        // allocation, disjoint from them.
        unsafe {
            self.core
                .encrypt_iov(slot.offset, &slot.iov, bounce.as_mut_ptr())
        }?;
        slot.ciphertext.clear();
        slot.ciphertext
            .push(IoVec::from_raw(bounce.as_mut_ptr(), slot.len as usize));
        Ok(())
    }

    /// Hands a finished request out (its slot back to the free list).
    fn hand_out(
        &mut self,
        index: u32,
        result: Result<(), BlockError>,
        out: &mut dyn FnMut(Completion),
    ) {
        let Some(slot) = self.slots.get(index as usize) else {
            return;
        };
        if slot.op.is_none() {
            return;
        }
        let tag = slot.tag;
        self.release(index);
        self.in_flight -= 1;
        out(Completion { tag, result });
    }
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
        let inner_req = match req.op {
            IoOp::Read | IoOp::Write if !self.sector_aligned(req) => {
                // SAFETY: forwarded.
                return unsafe { self.push_fallback(req) };
            }
            IoOp::WriteZeroes => {
                // SAFETY: forwarded (no buffers).
                return unsafe { self.push_fallback(req) };
            }
            IoOp::Read => Some(IoRequest::read(data_offset + req.offset, req.iov, 0)),
            // Encrypted by the backend's thread that writes it.
            IoOp::Write if self.offloaded => Some(IoRequest::write(
                data_offset + req.offset,
                req.iov,
                req.fua,
                0,
            )),
            // Encrypted into the slot's bounce buffer below.
            IoOp::Write => None,
            IoOp::Flush => Some(IoRequest::flush(0)),
            IoOp::Discard => {
                // Only whole sectors: discarding a partial one would destroy its neighbours.
                let ss = core.sector;
                let start = req.offset.div_ceil(ss) * ss;
                let end = (req.offset + req.len) / ss * ss;
                if end <= start {
                    self.finish_now(req.tag, Ok(()));
                    return Ok(());
                }
                Some(IoRequest::range(
                    IoOp::Discard,
                    data_offset + start,
                    end - start,
                    0,
                ))
            }
        };
        let Some(index) = self.free.pop() else {
            return Err(QueueFull(self.in_flight));
        };
        let bounce = (req.op == IoOp::Write && inner_req.is_none())
            .then(|| core.bounce.take_owned(req.len as usize));
        let slot = &mut self.slots[index as usize];
        slot.tag = req.tag;
        slot.op = Some(req.op);
        slot.offset = req.offset;
        slot.len = req.len;
        slot.fua = req.fua;
        slot.iov.clear();
        slot.iov.extend_from_slice(req.iov);
        slot.bounce = bounce;
        if inner_req.is_none() {
            if let Err(e) = self.encrypt_slot(index) {
                self.release(index);
                self.finish_now(req.tag, Err(e));
                return Ok(());
            }
        }
        let tag = u64::from(index);
        let inner_req = match inner_req {
            Some(inner_req) => IoRequest { tag, ..inner_req },
            None => IoRequest::write(
                data_offset + req.offset,
                &self.slots[index as usize].ciphertext,
                req.fua,
                tag,
            ),
        };
        // SAFETY: reads go into the caller's buffers, offloaded writes come from them: valid
        // as this function was promised; other writes come from the slot's bounce buffer,
        // kept until the completion is drained.
        match unsafe { self.inner.push(&inner_req) } {
            Ok(()) => {
                self.in_flight += 1;
                Ok(())
            }
            Err(full) => {
                self.release(index);
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
        let completed = &mut self.completed;
        self.inner.drain(&mut |c| {
            if let Ok(index) = u32::try_from(c.tag) {
                completed.push_back((index, c.result));
            }
        });
        // Each read is decrypted in place (unless the backend's threads did it) and handed
        // out at once, so the owner answers it while later ones are still being decrypted;
        // after `DECRYPT_PER_DRAIN` bytes the owner gets the thread back to take the guest's
        // new requests, and comes back for the rest. Nothing here waits for a helper.
        let mut decrypted = 0u64;
        while decrypted < DECRYPT_PER_DRAIN {
            let Some((index, mut result)) = self.completed.pop_front() else {
                break;
            };
            if let Some(len) = self.bytes_to_decrypt(index, &result) {
                decrypted += len;
                let slot = &self.slots[index as usize];
                // SAFETY: a completed read's buffers, valid until its completion is handed
                // out just below (`push`'s contract).
                if let Err(e) = unsafe { self.core.decrypt_iov(slot.offset, &slot.iov) } {
                    result = Err(e);
                }
            }
            self.hand_out(index, result, out);
        }
        if !self.completed.is_empty() {
            self.signal.notify();
        }
        let in_flight = &mut self.in_flight;
        self.fallback.drain(&mut |c| {
            *in_flight -= 1;
            out(c);
        });
        for c in self.ready.drain(..) {
            self.in_flight -= 1;
            out(c);
        }
    }

    fn wait(&mut self) {
        if !self.ready.is_empty() || !self.completed.is_empty() {
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
