//! The encrypted volume's stages on its backend's pipeline.
//!
//! - A read goes into the caller's buffers (guest memory) and is decrypted there in place when
//!   it completes: with O_DIRECT that is one DMA plus one pass of decryption.
//! - A write is encrypted at admission from the caller's buffers into a pooled bounce buffer
//!   (never in place: the caller's data must not change), which is what the engine writes.
//! - Crypto runs per request, on the queue's thread, and never waits for another thread: a
//!   read is decrypted and handed out as soon as it completes, one by one, so the owner answers
//!   each read while the next is still being decrypted; the pipeline's drain gives the thread
//!   back after 64 KiB of decryption, with the notifier set again. (Sharing a batch's crypto
//!   with pool helpers made the thread wait for a helper that a busy host had descheduled:
//!   measured on 2 vCPUs, it served a half to two thirds of the same server's plain
//!   throughput, see `ARCHITECTURE.md`.) A request larger than the pool's inline threshold is
//!   still split over the pool (`CryptoPool::crypt_raw`).
//! - On an engine that runs each transfer on a pool thread (`threads`), the crypto is handed
//!   to those threads instead (`Pipeline::offload`, `VolumeCrypto` below): each request is
//!   decrypted or encrypted by the thread that transfers it, so a batch's crypto is spread as
//!   widely as its transfers, and nothing waits for a batch.
//! - What the fast path cannot do — requests not aligned to the encryption sector (read-
//!   modify-write of the edge sectors, serialised per sector), buffers whose segments split a
//!   sector, write-zeroes — runs on the volume's synchronous path on the I/O thread pool. Those
//!   are rare: clients are told the sector size as the logical block size.
//!
//! The key and IV base of a request come from the segment of the payload its offset lies in:
//! one segment today; online re-encryption adds a second (old key, new key) with a moving
//! boundary between them.

use super::{whole_sectors, CryptCore};
use crate::aio::{
    open_pipeline, Admit, Bounds, IoOp, IoQueue, Pipeline, QueueOptions, SlotRequest, Stage,
};
use crate::aio::{IoVec, Offload};
use crate::{AlignedBuf, BlockDevice, BlockError};
use std::sync::Arc;

/// The volume's pipeline: its backend's, with this volume's range check and stages in front
/// and its own synchronous methods as the synchronous path.
pub(super) fn open(core: Arc<CryptCore>, opts: &QueueOptions) -> Result<Pipeline, BlockError> {
    let mut pipeline = open_pipeline(&core.backend, opts)?;
    let offloaded = pipeline.offload(Arc::new(VolumeCrypto(core.clone())));
    // The size is read per request: an online resize changes it while the queues run.
    let sized = core.clone();
    pipeline.set_bounds(Bounds::live(
        Arc::new(move || sized.size()),
        core.read_only(),
    ));
    let capacity = pipeline.capacity();
    // The last segment runs to the end of the payload, wherever a resize puts it (the
    // bounds check above keeps requests inside).
    let segments = vec![Segment {
        start: 0,
        end: u64::MAX,
        core: core.clone(),
    }];
    pipeline.push_front(Box::new(CryptStage {
        segments,
        offloaded,
        ciphertext: (0..capacity).map(|_| None).collect(),
    }));
    pipeline.push_front(Box::new(WholeSectorDiscard {
        sector: core.sector,
    }));
    let volume: Arc<dyn BlockDevice> = core;
    pipeline.set_sync_path(volume);
    Ok(pipeline)
}

/// A range of the payload and the cipher (key, IV base) its sectors are encrypted with.
struct Segment {
    start: u64,
    end: u64,
    core: Arc<CryptCore>,
}

/// Encrypts writes at admission, decrypts reads at completion, maps payload offsets to the
/// backend's.
struct CryptStage {
    /// Ordered, covering the payload.
    segments: Vec<Segment>,
    /// The backend's engine runs the crypto on its transfer threads (`Pipeline::offload`).
    offloaded: bool,
    /// A write's ciphertext, by slot, until the write completes.
    ciphertext: Vec<Option<AlignedBuf>>,
}

impl CryptStage {
    /// The segment holding all of `len` bytes at `offset`; `None` when the range crosses a
    /// boundary (served by the synchronous path, which splits it).
    fn segment(&self, offset: u64, len: u64) -> Option<&Segment> {
        self.segments
            .iter()
            .find(|s| s.start <= offset && offset + len <= s.end)
    }
}

/// Whether a read or write can take the fast path: whole sectors, and no sector split
/// between two buffers.
fn sector_aligned(req: &SlotRequest, sector: u64) -> bool {
    req.offset.is_multiple_of(sector)
        && req
            .iov
            .iter()
            .all(|v| (v.len() as u64).is_multiple_of(sector))
}

impl Stage for CryptStage {
    unsafe fn admit(
        &mut self,
        slot: usize,
        _caller: &SlotRequest,
        transfer: &mut SlotRequest,
    ) -> Admit {
        let Some(segment) = self.segment(transfer.offset, transfer.len) else {
            return Admit::Synchronous;
        };
        let core = segment.core.clone();
        match transfer.op {
            IoOp::Read | IoOp::Write if !sector_aligned(transfer, core.sector) => {
                return Admit::Synchronous
            }
            IoOp::WriteZeroes => return Admit::Synchronous,
            IoOp::Write if !self.offloaded => {
                let len = transfer.len as usize;
                let mut bounce = core.bounce.take_owned(len);
                // SAFETY: the segments are the write being pushed (readable for the call, per
                // this function's contract); the bounce buffer holds the whole request and is
                // our own allocation, disjoint from them.
                let encrypted = unsafe {
                    core.encrypt_iov(transfer.offset, &transfer.iov, bounce.as_mut_ptr())
                };
                if let Err(e) = encrypted {
                    core.bounce.put_back(bounce);
                    return Admit::Finish(Err(e));
                }
                transfer.set_buffer(bounce.as_mut_ptr(), len);
                self.ciphertext[slot] = Some(bounce);
            }
            IoOp::Flush => return Admit::Pass,
            IoOp::Read | IoOp::Write | IoOp::Discard => {}
        }
        transfer.offset += core.layout.data_offset;
        Admit::Pass
    }

    unsafe fn complete(
        &mut self,
        slot: usize,
        caller: &SlotRequest,
        result: &mut Result<(), BlockError>,
    ) -> u64 {
        let ciphertext = self.ciphertext[slot].take();
        let Some(segment) = self.segment(caller.offset, caller.len) else {
            return 0;
        };
        if let Some(buf) = ciphertext {
            segment.core.bounce.put_back(buf);
        }
        // The stages in front of this one do not move reads: the caller's offset is the
        // payload offset this stage saw.
        if caller.op != IoOp::Read || result.is_err() || self.offloaded {
            return 0;
        }
        // SAFETY: a completed read's buffers, valid until its completion is handed out
        // (this function's contract).
        if let Err(e) = unsafe { segment.core.decrypt_iov(caller.offset, &caller.iov) } {
            *result = Err(e);
        }
        caller.len
    }
}

/// Only whole encryption sectors are discarded: discarding a partial one would destroy its
/// neighbours. A discard holding no whole sector finishes at once.
struct WholeSectorDiscard {
    sector: u64,
}

impl Stage for WholeSectorDiscard {
    unsafe fn admit(
        &mut self,
        _slot: usize,
        _caller: &SlotRequest,
        transfer: &mut SlotRequest,
    ) -> Admit {
        if transfer.op != IoOp::Discard {
            return Admit::Pass;
        }
        match whole_sectors(transfer.offset, transfer.len, self.sector) {
            Some((offset, len)) => {
                transfer.offset = offset;
                transfer.len = len;
                Admit::Pass
            }
            None => Admit::Finish(Ok(())),
        }
    }
}

/// The volume's crypto as work for the `threads` engine's transfer threads (`Offload`): each
/// request is decrypted or encrypted by the thread that reads or writes it, in the backend's
/// offsets.
struct VolumeCrypto(Arc<CryptCore>);

impl Offload for VolumeCrypto {
    unsafe fn after_read(&self, offset: u64, iov: &[IoVec]) -> Result<(), BlockError> {
        let core = &self.0;
        // SAFETY: forwarded (the segments are readable and writable, this function's
        // contract); the crypt stage only passes whole sectors.
        unsafe { core.decrypt_iov(offset - core.layout.data_offset, iov) }
    }

    unsafe fn before_write(
        &self,
        offset: u64,
        iov: &[IoVec],
        out: *mut u8,
    ) -> Result<(), BlockError> {
        let core = &self.0;
        // SAFETY: forwarded: `out` holds the whole request, disjoint from the segments.
        unsafe { core.encrypt_iov(offset - core.layout.data_offset, iov, out) }
    }
}
