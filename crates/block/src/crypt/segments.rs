//! The volume's segments: one cipher over the whole payload, or, while its volume key is
//! being replaced online (LUKS2 reencryption, forward), the new cipher below a boundary and
//! the old one above it, with the hotzone being rewritten fenced off.
//!
//! Who reads what:
//! - Each queue's `CryptStage` keeps a copy of the map and its generation, and at each request
//!   loads the generation once (a plain load): unchanged, it routes by its copy. A request
//!   wholly below the boundary takes the new cipher, one wholly at or above the fence (the
//!   hotzone's end) the old one, asynchronously; anything touching the hotzone or crossing
//!   the boundary goes to the synchronous path (this map as a `BlockDevice`), which splits it
//!   by segment under the hotzone lock.
//! - The reencryption driver publishes a new state (a new generation), then waits until no
//!   request a stage admitted under the previous generation is still in flight, then rewrites
//!   the hotzone under the hotzone lock, and publishes the moved boundary.
//!
//! The stage's in-flight count per generation is its own (one writer, plain stores); the
//! driver sees it with an asymmetric fence: a stage stores its count before it loads the
//! generation, and the driver, between publishing a generation and reading the counts, runs
//! `membarrier(2)`, which puts a full barrier in every thread of the process. So either the
//! driver sees the stage's count, or the stage sees the new generation (and routes anew); the
//! stage's path has no fence or read-modify-write of its own.
use super::drain::{Drain, DRAIN_TIMEOUT};
use super::CryptCore;
use crate::{BlockDevice, BlockError, Extent, ExtentKind};
use cryptblk_crypto::SectorCipher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockWriteGuard, Weak};

/// What a generation routes by.
#[derive(Clone)]
pub(crate) struct Routes {
    /// The cipher of the whole payload, or of the part above the boundary.
    pub old: Arc<CryptCore>,
    /// While reencrypting: the cipher below the boundary.
    pub new: Option<Arc<CryptCore>>,
    /// Bytes below it are in the new segment (asynchronous requests may use it).
    pub boundary: u64,
    /// End of the hotzone `[boundary, fence)`: requests touching it take the synchronous path.
    pub fence: u64,
}

/// A stage's requests in flight, by generation parity; only the stage's thread writes them.
#[derive(Default)]
pub(crate) struct StageCounts {
    pub(super) in_flight: [AtomicU64; 2],
}

impl StageCounts {
    /// Adds `delta` (+1 or -1) to the count of `parity`. Only the owning stage calls this,
    /// from one thread, so a load and a store suffice.
    pub(crate) fn add(&self, parity: usize, delta: i64) {
        let c = &self.in_flight[parity];
        c.store(
            c.load(Ordering::Relaxed).wrapping_add_signed(delta),
            Ordering::Relaxed,
        );
    }
}

struct State {
    generation: u64,
    routes: Routes,
}

/// The segments of one volume, shared by its queues, its synchronous path and a reencryption.
pub struct SegmentMap {
    generation: AtomicU64,
    state: Mutex<State>,
    /// Bytes below it are rewritten and committed: the synchronous path's split point (the
    /// stages' copies may lag behind it).
    committed: AtomicU64,
    /// Read by the synchronous path's requests while reencrypting, written by a hotzone's
    /// rewrite.
    hotzone: RwLock<()>,
    stages: Mutex<Vec<Weak<StageCounts>>>,
    /// The payload's size, shared with its cores (an online resize moves it).
    size: Arc<AtomicU64>,
    /// The bounded wait for requests admitted under a previous generation.
    drain: Drain,
}

impl SegmentMap {
    pub(crate) fn new(core: Arc<CryptCore>) -> Arc<SegmentMap> {
        let size = core.size.clone();
        Arc::new(SegmentMap {
            generation: AtomicU64::new(0),
            state: Mutex::new(State {
                generation: 0,
                routes: Routes {
                    old: core,
                    new: None,
                    boundary: 0,
                    fence: 0,
                },
            }),
            committed: AtomicU64::new(0),
            hotzone: RwLock::new(()),
            stages: Mutex::new(Vec::new()),
            size,
            drain: Drain::new(DRAIN_TIMEOUT),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The generation as a stage checks it at each request.
    #[inline]
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// A stage's copy of the routes and its generation.
    pub(crate) fn snapshot(&self) -> (u64, Routes) {
        let s = self.lock();
        (s.generation, s.routes.clone())
    }

    /// Registers a stage's counts (before it takes its first snapshot).
    pub(crate) fn register(&self, counts: &Arc<StageCounts>) {
        let mut stages = self.stages.lock().unwrap_or_else(PoisonError::into_inner);
        stages.retain(|w| w.strong_count() > 0);
        stages.push(Arc::downgrade(counts));
    }

    /// Whether a reencryption's two segments are in place.
    pub fn is_split(&self) -> bool {
        self.lock().routes.new.is_some()
    }

    /// The payload size.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Bytes of the payload in the new segment.
    pub fn committed(&self) -> u64 {
        self.committed.load(Ordering::Acquire)
    }

    /// Puts the new cipher below `done` bytes (already rewritten) and the old one above. Its
    /// sectors must divide `done` and the payload offset stays the same (no data shift).
    pub fn split(&self, new_cipher: Arc<dyn SectorCipher>, done: u64) -> Result<(), BlockError> {
        register_membarrier()?;
        let old = self.lock().routes.old.clone();
        let new = old.with_cipher(new_cipher)?;
        // The new core shares the payload's size: it must be whole sectors of the new cipher.
        let size = old.size.load(Ordering::Acquire);
        if !size.is_multiple_of(new.sector) || !done.is_multiple_of(new.sector.max(old.sector)) {
            return Err(BlockError::unsupported(format!(
                "a reencryption boundary at {done} with {}-byte sectors over a {size}-byte payload",
                new.sector
            )));
        }
        let _rewrite = self.hotzone_write();
        self.committed.store(done, Ordering::Release);
        self.publish(|r| {
            r.new = Some(new);
            r.boundary = done;
            r.fence = done;
        })
    }

    /// Fences off `[committed, fence)` for rewriting: once this returns `Ok`, no asynchronous
    /// request touches it, and new ones go to the synchronous path. An error (requests still
    /// in flight after `DRAIN_TIMEOUT`) means the hotzone must not be rewritten yet; the
    /// fence may stay (requests touching it take the synchronous path, which is always right),
    /// and a later call waits for the stragglers first.
    pub fn announce(&self, fence: u64) -> Result<(), BlockError> {
        let done = self.committed();
        self.publish(|r| {
            r.boundary = done;
            r.fence = fence.max(done);
        })
    }

    /// Excludes the synchronous path while a hotzone is rewritten.
    pub fn hotzone_write(&self) -> RwLockWriteGuard<'_, ()> {
        self.hotzone.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records (under the hotzone lock) that bytes below `done` are in the new segment, and
    /// tells the stages.
    /// An error means requests admitted before are still in flight after `DRAIN_TIMEOUT` (the
    /// boundary has moved all the same; the next publication waits for them first), or that
    /// earlier stragglers kept the boundary from being published (the synchronous path,
    /// which splits at `committed`, is right either way).
    pub fn advance(
        &self,
        _rewrite: &RwLockWriteGuard<'_, ()>,
        done: u64,
    ) -> Result<(), BlockError> {
        self.committed.store(done, Ordering::Release);
        self.publish(|r| {
            r.boundary = done;
            r.fence = done;
        })
    }

    /// The whole payload is in the new segment: it becomes the only one, and the old cipher
    /// (its key) is dropped once the last queue has seen the change. An error: stragglers
    /// kept the single segment from being published (the volume keeps routing by the
    /// boundary, now the payload's end), or are still in flight after it.
    pub fn finish(&self) -> Result<(), BlockError> {
        let _rewrite = self.hotzone_write();
        self.drain.settle_pending(&self.live_stages())?;
        self.committed.store(0, Ordering::Release);
        self.publish(|r| {
            if let Some(new) = r.new.take() {
                r.old = new;
            }
            r.boundary = 0;
            r.fence = 0;
        })
    }

    fn live_stages(&self) -> Vec<Arc<StageCounts>> {
        self.stages
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// Installs a new generation, then waits until every request admitted under the previous
    /// one has completed (at most `DRAIN_TIMEOUT`; stragglers an earlier wait gave up on must
    /// complete first, before anything changes).
    fn publish(&self, change: impl FnOnce(&mut Routes)) -> Result<(), BlockError> {
        self.drain.settle_pending(&self.live_stages())?;
        let previous = {
            let mut s = self.lock();
            change(&mut s.routes);
            let previous = s.generation;
            s.generation += 1;
            self.generation.store(s.generation, Ordering::Release);
            previous
        };
        membarrier();
        let parity = (previous & 1) as usize;
        self.drain.previous(&self.live_stages(), parity)
    }

    /// The routes and split point for a synchronous request, or `None` when there is one
    /// segment (`committed` is then meaningless).
    fn current(&self) -> (Arc<CryptCore>, Option<(Arc<CryptCore>, u64)>) {
        let s = self.lock();
        let old = s.routes.old.clone();
        let new = s.routes.new.clone();
        drop(s);
        (old, new.map(|n| (n, self.committed())))
    }

    /// Runs `op` on each segment's part of `len` bytes at `offset`: (core, offset, start
    /// index into the request, length).
    fn split_request(
        &self,
        offset: u64,
        len: u64,
        mut op: impl FnMut(&CryptCore, u64, usize, usize) -> Result<(), BlockError>,
    ) -> Result<(), BlockError> {
        // Always under the lock (a plain read lock, uncontended between hotzones): a request
        // that skipped it could race with a reencryption starting.
        let _hotzone = self.hotzone.read().unwrap_or_else(PoisonError::into_inner);
        let (old, new) = self.current();
        let Some((new, at)) = new else {
            return op(&old, offset, 0, len as usize);
        };
        let end = offset + len;
        if offset < at {
            let n = end.min(at) - offset;
            op(&new, offset, 0, n as usize)?;
        }
        if end > at {
            let from = offset.max(at);
            op(&old, from, (from - offset) as usize, (end - from) as usize)?;
        }
        Ok(())
    }

    /// The cipher an offloaded transfer of `len` payload bytes at `offset` was routed to
    /// (see `CryptStage`: wholly below the boundary, or wholly above the hotzone).
    pub(crate) fn core_for(&self, offset: u64, len: u64) -> Arc<CryptCore> {
        let (old, new) = self.current();
        match new {
            Some((new, at)) if offset + len <= at => new,
            _ => old,
        }
    }
}

impl BlockDevice for SegmentMap {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn logical_block_size(&self) -> u32 {
        self.lock().routes.old.logical_block_size()
    }

    fn read_only(&self) -> bool {
        self.lock().routes.old.read_only()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        crate::device::check_range("read", offset, buf.len() as u64, BlockDevice::size(self))?;
        self.split_request(offset, buf.len() as u64, |core, at, from, n| {
            core.read_at(&mut buf[from..from + n], at)
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        crate::device::check_range("write", offset, buf.len() as u64, BlockDevice::size(self))?;
        self.split_request(offset, buf.len() as u64, |core, at, from, n| {
            core.write_at(&buf[from..from + n], at)
        })
    }

    fn flush(&self) -> Result<(), BlockError> {
        self.lock().routes.old.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        crate::device::check_range("discard", offset, len, BlockDevice::size(self))?;
        self.split_request(offset, len, |core, at, _, n| core.discard(at, n as u64))
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        crate::device::check_range("block_status", offset, 0, BlockDevice::size(self))?;
        Ok(Extent {
            len: len.min(BlockDevice::size(self) - offset),
            kind: ExtentKind::Data,
        })
    }
}

const MEMBARRIER_CMD_GLOBAL: libc::c_int = 1;
const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

fn membarrier_call(cmd: libc::c_int) -> bool {
    // SAFETY: membarrier(2) takes two integers and touches no memory of ours.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0, 0) == 0 }
}

/// Registers the process for expedited barriers (needed once, before the first).
fn register_membarrier() -> Result<(), BlockError> {
    if membarrier_call(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) {
        return Ok(());
    }
    // The global barrier needs no registration (slower: it waits for an RCU grace period).
    if membarrier_call(MEMBARRIER_CMD_GLOBAL) {
        return Ok(());
    }
    Err(BlockError::unsupported(
        "membarrier(2), which online reencryption needs to fence the queues, is not available (Linux 4.14 or later, not filtered by seccomp)",
    ))
}

/// A full memory barrier in every thread of the process.
fn membarrier() {
    if !membarrier_call(MEMBARRIER_CMD_PRIVATE_EXPEDITED) && !membarrier_call(MEMBARRIER_CMD_GLOBAL)
    {
        // Only reached when no reencryption could have started (`register_membarrier`).
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}
