//! The encrypted volume's asynchronous queue: crypto composed with the backend's queue.
//!
//! - A read is submitted into the caller's buffers (guest memory) and decrypted there in
//!   place when it completes: with O_DIRECT that is one DMA plus one pass of decryption.
//! - A write is encrypted from the caller's buffers into a pooled bounce buffer (never in
//!   place: the caller's data must not change), which is then submitted.
//! - Crypto runs per batch, spread over the crypto pool (`CryptoPool::crypt_raw_batch`): the
//!   writes pushed since the last submit are encrypted together at `submit`, the reads that
//!   completed together are decrypted together in `drain`. So a queue of 64 KiB requests uses
//!   every core even though one thread drives it, while a lone 4 KiB request stays on it.
//! - On an engine that runs each transfer on a pool thread (`threads`), the crypto is handed
//!   to those threads instead (`IoQueue::offload`, `super::offload`): each request is
//!   decrypted or encrypted by the thread that transfers it, right before or after, so a
//!   batch's crypto is spread as widely as its transfers, and nothing waits for a batch.
//! - What the fast path cannot do — requests not aligned to the encryption sector (read-
//!   modify-write of the edge sectors, serialised per sector), buffers whose segments split a
//!   sector, write-zeroes — runs on the volume's synchronous path on the I/O thread pool
//!   (`SyncQueue`), signalling the same eventfd. Those are rare: clients are told the sector
//!   size as the logical block size.

use super::{crypto_error, CryptCore};
use crate::aio::{
    open_queue, Completion, IoOp, IoQueue, IoRequest, IoVec, Notifier, QueueFull, QueueOptions,
    SyncQueue,
};
use crate::device::check_range;
use crate::{AlignedBuf, BlockDevice, BlockError};
use cryptblk_crypto::{CryptoError, Direction, RawRun};
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
    /// A read's buffers (decrypted in place when it completes), a write's plaintext (until
    /// it is encrypted at submit).
    iov: Vec<IoVec>,
    /// A write's ciphertext.
    bounce: Option<AlignedBuf>,
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
    /// Writes pushed since the last submit, to encrypt together.
    to_encrypt: Vec<u32>,
    /// Scratch lists for a batch of crypto (kept: no allocation per batch).
    runs: Vec<RawRun>,
    run_slot: Vec<u32>,
    results: Vec<Result<(), CryptoError>>,
    /// The first crypto error of each slot in the current batch.
    slot_errors: Vec<Option<CryptoError>>,
    completed: Vec<(u32, Result<(), BlockError>)>,
}

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
            to_encrypt: Vec::new(),
            runs: Vec::new(),
            run_slot: Vec::new(),
            results: Vec::new(),
            slot_errors: (0..capacity).map(|_| None).collect(),
            completed: Vec::new(),
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

    /// Moves the batch's crypto errors to their slots (`slot_errors`).
    fn collect_errors(&mut self) {
        for (&slot, result) in self.run_slot.iter().zip(self.results.drain(..)) {
            if let (Err(e), Some(err)) = (result, self.slot_errors.get_mut(slot as usize)) {
                err.get_or_insert(e);
            }
        }
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

    /// Encrypts every write pushed since the last submit, as one batch over the crypto pool,
    /// and passes them to the backend's queue.
    fn encrypt_pending(&mut self) {
        if self.to_encrypt.is_empty() {
            return;
        }
        let core = self.core.clone();
        self.runs.clear();
        self.run_slot.clear();
        for &index in &self.to_encrypt {
            let slot = &mut self.slots[index as usize];
            let Some(bounce) = slot.bounce.as_mut() else {
                continue;
            };
            let mut pos = 0usize;
            for v in &slot.iov {
                self.runs.push(RawRun {
                    first_sector: core.iv_sector(slot.offset + pos as u64),
                    src: v.base(),
                    dst: bounce.as_mut_ptr().wrapping_add(pos),
                    len: v.len(),
                });
                self.run_slot.push(index);
                pos += v.len();
            }
        }
        // SAFETY: each run reads a segment of a pushed write (readable until its completion
        // is handed out, per `push`'s contract) and writes the slot's own bounce buffer, at
        // the segment's position inside the request (the bounce holds the whole request);
        // bounce buffers of different slots are different allocations.
        unsafe {
            core.pool.crypt_raw_batch(
                &core.cipher,
                Direction::Encrypt,
                &self.runs,
                &mut self.results,
            )
        };
        self.collect_errors();
        let to_encrypt = std::mem::take(&mut self.to_encrypt);
        for &index in &to_encrypt {
            let failed = self.slot_errors[index as usize].take();
            let slot = &self.slots[index as usize];
            if let Some(e) = failed {
                let tag = slot.tag;
                let off = slot.offset;
                self.release(index);
                self.in_flight -= 1;
                self.finish_now(tag, Err(crypto_error(Direction::Encrypt, off, e)));
                continue;
            }
            let one = slot
                .bounce
                .as_ref()
                .map(|b| [IoVec::from_raw(b.as_ptr().cast_mut(), slot.len as usize)]);
            let Some(one) = one else { continue };
            let req = IoRequest::write(
                core.layout.data_offset + slot.offset,
                &one,
                slot.fua,
                u64::from(index),
            );
            // SAFETY: the ciphertext lives in the slot's bounce buffer until the completion
            // is drained. The backend queue has room: it is as deep as this one.
            if unsafe { self.inner.push(&req) }.is_err() {
                let tag = slot.tag;
                self.release(index);
                self.in_flight -= 1;
                self.finish_now(
                    tag,
                    Err(BlockError::new(
                        crate::BlockErrorKind::Io,
                        "the backend's I/O queue is full",
                    )),
                );
            }
        }
        self.to_encrypt = to_encrypt;
        self.to_encrypt.clear();
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
            // Encrypted (with the others of the batch) and passed on at submit.
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
        let Some(inner_req) = inner_req else {
            self.to_encrypt.push(index);
            self.in_flight += 1;
            return Ok(());
        };
        let inner_req = IoRequest {
            tag: u64::from(index),
            ..inner_req
        };
        // SAFETY: reads go into the caller's buffers, offloaded writes come from them: valid
        // as this function was promised.
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
        self.encrypt_pending();
        self.fallback.submit()?;
        self.inner.submit()
    }

    fn drain(&mut self, out: &mut dyn FnMut(Completion)) {
        self.signal.clear();
        let mut completed = std::mem::take(&mut self.completed);
        completed.clear();
        self.inner.drain(&mut |c| {
            if let Ok(index) = u32::try_from(c.tag) {
                completed.push((index, c.result));
            }
        });
        // Every read that completed is decrypted in place, as one batch over the pool (unless
        // the backend's threads did it).
        let core = self.core.clone();
        self.runs.clear();
        self.run_slot.clear();
        for (index, result) in completed.iter().filter(|_| !self.offloaded) {
            let Some(slot) = self.slots.get(*index as usize) else {
                continue;
            };
            if slot.op != Some(IoOp::Read) || result.is_err() {
                continue;
            }
            let mut pos = 0u64;
            for v in &slot.iov {
                self.runs.push(RawRun {
                    first_sector: core.iv_sector(slot.offset + pos),
                    src: v.base(),
                    dst: v.base(),
                    len: v.len(),
                });
                self.run_slot.push(*index);
                pos += v.len() as u64;
            }
        }
        if !self.runs.is_empty() {
            // SAFETY: each run is a segment of a completed read, in place: the buffers are
            // valid until its completion is handed out, just below.
            unsafe {
                core.pool.crypt_raw_batch(
                    &core.cipher,
                    Direction::Decrypt,
                    &self.runs,
                    &mut self.results,
                )
            };
            self.collect_errors();
        }
        for (index, mut result) in completed.drain(..) {
            let Some(slot) = self.slots.get(index as usize) else {
                continue;
            };
            if slot.op.is_none() {
                continue;
            }
            if let Some(e) = self.slot_errors[index as usize].take() {
                if result.is_ok() {
                    result = Err(crypto_error(Direction::Decrypt, slot.offset, e));
                }
            }
            let tag = slot.tag;
            self.release(index);
            self.in_flight -= 1;
            out(Completion { tag, result });
        }
        self.completed = completed;
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
