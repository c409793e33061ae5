//! The encrypted volume's stages on its backend's pipeline.
//!
//! - A read goes into the caller's buffers (guest memory) and is decrypted there in place when
//!   it completes: with O_DIRECT that is one DMA plus one pass of decryption.
//! - A write is encrypted at admission from the caller's buffers into a bounce buffer from
//!   the process's cache (`buffers`)
//!   (never in place: the caller's data must not change), which is what the engine writes.
//! - Crypto runs per request, on the queue's thread, and never waits for another thread: a
//!   read is decrypted and handed out as soon as it completes, one by one, so the owner answers
//!   each read while the next is still being decrypted; the pipeline's drain gives the thread
//!   back after 64 KiB of decryption, with the notifier set again. Only a request larger than
//!   the pool's inline threshold is split over the pool (`CryptoPool::crypt_raw`). (The
//!   designs measured against this one: docs/performance.md, "The request path".)
//! - On an engine that runs each transfer on a pool thread (`threads`), the crypto is handed
//!   to those threads instead (`Pipeline::offload`, `VolumeCrypto` below): each request is
//!   decrypted or encrypted by the thread that transfers it, so a batch's crypto is spread as
//!   widely as its transfers, and nothing waits for a batch.
//! - What the fast path cannot do — requests not aligned to the encryption sector (read-
//!   modify-write of the edge sectors, serialised per sector), buffers whose segments split a
//!   sector, write-zeroes — runs on the volume's synchronous path on the I/O thread pool. Those
//!   are rare: clients are told the sector size as the logical block size.
//!
//! The storage of a request comes from the volume's segment map (`segments.rs`): one part, or
//! during an online reencryption the parts its header describes; a request touching the
//! hotzone or crossing parts goes to the synchronous path, which splits it. Checking the map
//! costs one plain load per request. A plaintext part (a raw disk, or what an online
//! encryption has not reached yet) is passed through as it is, at its own data offset: every
//! raw disk is served through this stage, so that it can be encrypted while it serves.

use super::drain::StageCounts;
use super::encrypted::{whole_sectors, CryptCore};
use super::routes::{Routes, Storage};
use super::segments::SegmentMap;
use super::units::{BackendOffset, VolumeOffset};
use cryptblk_block::aio::{
    Admit, Bounds, IoOp, IoQueue, Pipeline, QueueOptions, SlotRequest, Stage,
};
use cryptblk_block::aio::{IoBuffers, Offload};
use cryptblk_block::buffers::{self, PooledBuf};
use cryptblk_block::open_pipeline;
use cryptblk_block::{BlockDevice, BlockError};
use std::sync::atomic::{compiler_fence, Ordering};
use std::sync::Arc;

/// The volume's pipeline: its backend's, with this volume's range check and stage in front
/// and the segment map's synchronous methods as the synchronous path.
pub(super) fn open(
    backend: &Arc<dyn BlockDevice>,
    segments: Arc<SegmentMap>,
    opts: &QueueOptions,
) -> Result<Pipeline, BlockError> {
    let mut pipeline = open_pipeline(backend, opts)?;
    let counts = Arc::new(StageCounts::default());
    segments.register(&counts);
    let (generation, routes) = segments.snapshot();
    // A volume encrypted at one data offset stays so (a key-to-key reencryption keeps the
    // offset; only an encryption brings plaintext parts, and it starts from a raw disk), so
    // the crypto can be handed to the engine's transfer threads for the queue's lifetime.
    let offloaded = match routes.uniformly_encrypted() {
        Some(base) => pipeline.offload(Arc::new(VolumeCrypto {
            base: base.clone(),
            segments: segments.clone(),
        })),
        None => false,
    };
    // The size is read per request: an online resize changes it while the queues run.
    let sized = segments.clone();
    pipeline.set_bounds(Bounds::live(
        Arc::new(move || sized.size()),
        BlockDevice::read_only(segments.as_ref()),
    ));
    let capacity = pipeline.capacity();
    pipeline.push_front(Box::new(CryptStage {
        segments: segments.clone(),
        counts,
        generation,
        routes: [routes.clone(), routes],
        offloaded,
        ciphertext: (0..capacity).map(|_| None).collect(),
        routed: vec![Routed::default(); capacity],
    }));
    let volume: Arc<dyn BlockDevice> = segments;
    pipeline.set_sync_path(volume);
    Ok(pipeline)
}

/// Where a request in flight was sent: the part of the routes of its generation parity.
#[derive(Clone, Copy, Default)]
struct Routed {
    part: u8,
    parity: u8,
}

/// Encrypts writes at admission, decrypts reads at completion, maps volume offsets to the
/// backend's (a transfer enters with the volume's offset and leaves with the backend's).
struct CryptStage {
    segments: Arc<SegmentMap>,
    /// This queue's requests in flight by generation parity, for the reencryption driver.
    counts: Arc<StageCounts>,
    /// The generation `routes[generation & 1]` is a copy of.
    generation: u64,
    /// The routes of the current generation and of the one before it, by parity: a request
    /// completes with the storage it was admitted to (see `segments.rs`).
    routes: [Routes; 2],
    /// The backend's engine runs the crypto on its transfer threads (`Pipeline::offload`).
    offloaded: bool,
    /// A write's ciphertext, by slot, until the write completes.
    ciphertext: Vec<Option<PooledBuf>>,
    routed: Vec<Routed>,
}

impl CryptStage {
    /// Counts a request in under the current generation (refreshing the copy of the routes
    /// when it changed): the count is stored before the generation is loaded, which is what
    /// the driver's `membarrier` pairs with.
    fn count_in(&mut self) -> usize {
        loop {
            let parity = (self.generation & 1) as usize;
            self.counts.add(parity, 1);
            compiler_fence(Ordering::SeqCst);
            if self.segments.generation() == self.generation {
                return parity;
            }
            self.counts.add(parity, -1);
            let (generation, routes) = self.segments.snapshot();
            self.generation = generation;
            self.routes[(generation & 1) as usize] = routes;
        }
    }
}

/// Whether a read or write can take the fast path: whole sectors, and no sector split
/// between two buffers.
fn sector_aligned(at: VolumeOffset, req: &SlotRequest, sector: u64) -> bool {
    at.is_multiple_of(sector)
        && req
            .buffers
            .iov()
            .iter()
            .all(|v| (v.len() as u64).is_multiple_of(sector))
}

impl Stage for CryptStage {
    fn admit(&mut self, slot: usize, _caller: &SlotRequest, transfer: &mut SlotRequest) -> Admit {
        if transfer.op == IoOp::Flush {
            return Admit::Pass;
        }
        let parity = self.count_in();
        let routes = &self.routes[parity];
        let at = VolumeOffset::new(transfer.offset);
        // Each way out returns at once (a request not passed on is counted out again): the
        // plaintext pass-through, every raw disk's path, then moves no `Admit` around.
        let Some(part) = routes.route(at, transfer.len) else {
            self.counts.add(parity, -1);
            return Admit::Synchronous;
        };
        self.routed[slot] = Routed {
            part: part as u8,
            parity: parity as u8,
        };
        match &routes.parts[part].storage {
            Storage::Plain(plain) if !self.offloaded => {
                transfer.offset = plain.place.backend(at).bytes();
                Admit::Pass
            }
            // Offloaded crypto would transform it: never on such a queue (see `open`), but
            // the synchronous path is right whatever the engine does.
            Storage::Plain(_) => {
                self.counts.add(parity, -1);
                Admit::Synchronous
            }
            Storage::Encrypted(core) => {
                let admit = admit_encrypted(
                    core,
                    &mut self.ciphertext[slot],
                    self.offloaded,
                    at,
                    transfer,
                );
                if !matches!(admit, Admit::Pass) {
                    self.counts.add(parity, -1);
                }
                admit
            }
        }
    }

    fn complete(
        &mut self,
        slot: usize,
        caller: &SlotRequest,
        result: &mut Result<(), BlockError>,
    ) -> u64 {
        if caller.op == IoOp::Flush {
            return 0;
        }
        let routed = self.routed[slot];
        let work = match &self.routes[routed.parity as usize].parts[routed.part as usize].storage {
            Storage::Plain(_) => 0,
            Storage::Encrypted(core) => complete_encrypted(
                core,
                &mut self.ciphertext[slot],
                self.offloaded,
                caller,
                result,
            ),
        };
        // Counted out only now: the driver may rewrite this range once the count is zero.
        self.counts.add(routed.parity as usize, -1);
        work
    }

    fn abandon(&mut self, slot: usize, caller: &SlotRequest) {
        if caller.op != IoOp::Flush {
            self.counts.add(self.routed[slot].parity as usize, -1);
        }
    }
}

/// `admit` of a request routed to an encrypted part, at volume offset `at`. Not inlined: a
/// plaintext part's requests (every raw disk's) then pass through the stage without this
/// path's register pressure.
#[inline(never)]
fn admit_encrypted(
    core: &CryptCore,
    ciphertext: &mut Option<PooledBuf>,
    offloaded: bool,
    mut at: VolumeOffset,
    transfer: &mut SlotRequest,
) -> Admit {
    match transfer.op {
        IoOp::Read | IoOp::Write if !sector_aligned(at, transfer, core.sector()) => {
            return Admit::Synchronous
        }
        IoOp::WriteZeroes => return Admit::Synchronous,
        IoOp::Write if !offloaded => {
            let len = transfer.len as usize;
            let mut bounce = buffers::take(len);
            if let Err(e) = core.encrypt_iov(at, &transfer.buffers, &mut bounce) {
                return Admit::Finish(Err(e));
            }
            // SAFETY: the ciphertext buffer is kept in the slot's `ciphertext` (and not
            // referenced) until this stage sees the write complete or abandoned.
            unsafe { transfer.set_buffer(bounce.as_mut_ptr(), len) };
            *ciphertext = Some(bounce);
        }
        // Only whole encryption sectors are discarded: discarding a partial one would destroy
        // its neighbours. A discard holding no whole sector finishes at once.
        IoOp::Discard => match whole_sectors(at, transfer.len, core.sector()) {
            Some((start, len)) => {
                at = start;
                transfer.len = len;
            }
            None => return Admit::Finish(Ok(())),
        },
        IoOp::Flush | IoOp::Read | IoOp::Write => {}
    }
    transfer.offset = core.backend_offset(at).bytes();
    Admit::Pass
}

/// `complete` of a request an encrypted part served: its ciphertext buffer back to the cache,
/// a read decrypted in place (unless the engine's threads did it). Returns the bytes of
/// crypto done.
#[inline(never)]
fn complete_encrypted(
    core: &CryptCore,
    ciphertext: &mut Option<PooledBuf>,
    offloaded: bool,
    caller: &SlotRequest,
    result: &mut Result<(), BlockError>,
) -> u64 {
    // Back to the cache.
    drop(ciphertext.take());
    // The stages in front of this one do not move reads: the caller's offset is the volume
    // offset this stage saw.
    if caller.op != IoOp::Read || result.is_err() || offloaded {
        return 0;
    }
    if let Err(e) = core.decrypt_iov(VolumeOffset::new(caller.offset), &caller.buffers) {
        *result = Err(e);
    }
    caller.len
}

/// The volume's crypto as work for the `threads` engine's transfer threads (`Offload`): each
/// request is decrypted or encrypted by the thread that reads or writes it, in the backend's
/// offsets, with the cipher the crypt stage routed it to. Only on a volume encrypted at one
/// data offset (`Routes::uniformly_encrypted`).
struct VolumeCrypto {
    base: Arc<CryptCore>,
    segments: Arc<SegmentMap>,
}

impl VolumeCrypto {
    /// The volume offset and cipher of a transfer at backend offset `offset`: the cipher the
    /// volume was opened with until a reencryption changes the map.
    fn core(&self, offset: u64, len: u64) -> Result<(VolumeOffset, Arc<CryptCore>), BlockError> {
        let not_in_one_part = || {
            BlockError::unsupported(format!(
                "{len} bytes at backend offset {offset} on the offloaded crypto path are not in one encrypted part"
            ))
        };
        // Every part lies at the base's data offset (`Routes::uniformly_encrypted`).
        let at = self
            .base
            .layout
            .placement()
            .volume(BackendOffset::new(offset))
            .ok_or_else(not_in_one_part)?;
        if self.segments.generation() == 0 {
            return Ok((at, self.base.clone()));
        }
        let core = self
            .segments
            .core_for(at, len)
            .ok_or_else(not_in_one_part)?;
        Ok((at, core))
    }
}

impl Offload for VolumeCrypto {
    fn after_read(&self, offset: u64, buffers: &IoBuffers) -> Result<(), BlockError> {
        let (at, core) = self.core(offset, buffers.len())?;
        // The crypt stage only passes whole sectors.
        core.decrypt_iov(at, buffers)
    }

    fn before_write(
        &self,
        offset: u64,
        buffers: &IoBuffers,
        out: &mut [u8],
    ) -> Result<(), BlockError> {
        let (at, core) = self.core(offset, buffers.len())?;
        core.encrypt_iov(at, buffers, out)
    }
}
