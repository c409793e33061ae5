//! The volume's segments: which storage serves which part of the payload. A disk nothing is
//! changing has one part (encrypted with its key, or plaintext: a raw disk, served this way so
//! that it can be encrypted while it serves). While a LUKS2 reencryption runs, the parts are
//! the live segments of its header: for a new volume key, the new cipher below a boundary and
//! the old one above it; for an encryption in place, plaintext below the boundary (its first
//! bytes moved to the image's end) and ciphertext above it, one data shift higher. The hotzone
//! being rewritten is fenced off.
//!
//! Who reads what:
//! - Each queue's `CryptStage` keeps a copy of the routes and their generation, and at each
//!   request loads the generation once (a plain load): unchanged, it routes by its copy. A
//!   request wholly inside one part and clear of the fence goes to that part's storage,
//!   asynchronously; anything touching the fence or crossing parts goes to the synchronous
//!   path (this map as a `BlockDevice`), which splits it by part under the hotzone lock.
//! - The reencryption driver fences off a hotzone (a new generation), waits until no request
//!   a stage admitted under the previous generation is still in flight, rewrites the hotzone
//!   under the hotzone lock, and publishes the parts after it.
//!
//! The stage's in-flight count per generation is its own (one writer, plain stores); the
//! driver sees it with an asymmetric fence: a stage stores its count before it loads the
//! generation, and the driver, between publishing a generation and reading the counts, runs
//! `membarrier(2)`, which puts a full barrier in every thread of the process. So either the
//! driver sees the stage's count, or the stage sees the new generation (and routes anew); the
//! stage's path has no fence or read-modify-write of its own.
//!
//! Requests in flight belong to at most two generations, the current one and the one before:
//! a generation is published only once every request of the one before the previous has
//! completed (`Drain`). A stage therefore keeps the routes of both, by parity, and finds the
//! storage of a completing request in the routes it was admitted under.
use super::drain::{Drain, StageCounts, DRAIN_TIMEOUT};
use super::encrypted::CryptCore;
use super::membarrier::{membarrier, register_membarrier};
use super::routes::{Part, Routes, Storage, NO_FENCE};
use super::units::VolumeOffset;
use cryptblk_block::{BlockDevice, BlockError, Extent};
use cryptblk_crypto::SectorCipher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockWriteGuard, Weak};

/// The two ciphers of a key-to-key reencryption (forward, no data shift): the parts are the
/// new one below `boundary`, the old one above.
struct Forward {
    old: Arc<CryptCore>,
    new: Arc<CryptCore>,
    boundary: VolumeOffset,
}

struct State {
    generation: u64,
    routes: Routes,
    /// A reencryption's parts are being served (the header is in mid-reencryption).
    reencrypting: bool,
    /// Bytes of the volume in the new layout, as last installed (`follow`).
    done: u64,
    forward: Option<Forward>,
}

/// The segments of one volume, shared by its queues, its synchronous path and a reencryption.
pub struct SegmentMap {
    generation: AtomicU64,
    state: Mutex<State>,
    /// Read by the synchronous path's requests, written while a hotzone is rewritten or the
    /// parts change.
    hotzone: RwLock<()>,
    stages: Mutex<Vec<Weak<StageCounts>>>,
    /// The payload's size, shared with its parts (an online resize moves it).
    size: Arc<AtomicU64>,
    /// What clients were told the volume's block is when it opened; it stays (a guest keeps
    /// the block size it probed, whatever a reencryption changes underneath).
    logical_block_size: u32,
    read_only: bool,
    /// The bounded wait for requests admitted under a previous generation.
    drain: Drain,
}

impl SegmentMap {
    pub(crate) fn new(storage: Storage, size: Arc<AtomicU64>) -> Arc<SegmentMap> {
        let logical_block_size = storage.device().logical_block_size();
        let read_only = storage.device().read_only();
        Arc::new(SegmentMap {
            generation: AtomicU64::new(0),
            state: Mutex::new(State {
                generation: 0,
                routes: Routes::single(storage),
                reencrypting: false,
                done: 0,
                forward: None,
            }),
            hotzone: RwLock::new(()),
            stages: Mutex::new(Vec::new()),
            size,
            logical_block_size,
            read_only,
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

    /// Whether a reencryption's parts are being served (the header is in mid-reencryption).
    pub fn is_split(&self) -> bool {
        self.lock().reencrypting
    }

    /// The payload size.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// The payload's size as shared with its parts.
    pub(crate) fn size_cell(&self) -> &Arc<AtomicU64> {
        &self.size
    }

    /// Bytes of the payload in the new layout while a reencryption's parts are served: below
    /// the boundary of a key-to-key one, encrypted for an encryption in place.
    pub fn committed(&self) -> u64 {
        let s = self.lock();
        s.forward.as_ref().map_or(s.done, |f| f.boundary.bytes())
    }

    /// The current parts (for the device's own checks).
    pub(crate) fn routes(&self) -> Routes {
        self.lock().routes.clone()
    }

    /// Whether every byte of the volume is plaintext (a raw disk no encryption has reached).
    pub fn is_plaintext(&self) -> bool {
        self.lock()
            .routes
            .parts
            .iter()
            .all(|p| matches!(p.storage, Storage::Plain(_)))
    }

    /// The backend offset of volume offset 0 when every part lies at the same one (always,
    /// but during an encryption in place, whose data moves): what a migration, which copies
    /// the image file by offset, needs.
    pub fn single_data_offset(&self) -> Option<u64> {
        let s = self.lock();
        let first = s.routes.parts.first()?.storage.placement();
        s.routes
            .parts
            .iter()
            .all(|p| p.storage.placement() == first)
            .then_some(first.data_offset().bytes())
    }

    /// The cipher of the volume's last encrypted part: the one it is opened with, the new one
    /// once a reencryption finished, none while it is all plaintext.
    pub fn cipher(&self) -> Option<Arc<dyn SectorCipher>> {
        self.lock()
            .routes
            .parts
            .iter()
            .rev()
            .find_map(|p| match &p.storage {
                Storage::Encrypted(core) => Some(core.cipher.clone()),
                Storage::Plain(_) => None,
            })
    }

    /// Puts the new cipher below `done` bytes (already rewritten) and the old one above, for a
    /// key-to-key reencryption. The volume must be encrypted with one key; its sectors must
    /// divide `done`, and the payload offset stays the same (no data shift).
    pub fn split(&self, new_cipher: Arc<dyn SectorCipher>, done: u64) -> Result<(), BlockError> {
        register_membarrier()?;
        let old =
            {
                let s = self.lock();
                match &*s.routes.parts {
                    [Part {
                        storage: Storage::Encrypted(core),
                        ..
                    }] => core.clone(),
                    _ => return Err(BlockError::unsupported(
                        "a key-to-key reencryption of a volume that is not encrypted with one key",
                    )),
                }
            };
        let new = old.with_cipher(new_cipher)?;
        // The new core shares the payload's size: it must be whole sectors of the new cipher.
        let size = self.size();
        if !size.is_multiple_of(new.sector())
            || !done.is_multiple_of(new.sector().max(old.sector()))
        {
            return Err(BlockError::unsupported(format!(
                "a reencryption boundary at {done} with {}-byte sectors over a {size}-byte payload",
                new.sector()
            )));
        }
        let _rewrite = self.hotzone_write();
        let boundary = VolumeOffset::new(done);
        let routes = Routes::forward(&new, &old, boundary);
        self.publish(|s| {
            s.forward = Some(Forward { old, new, boundary });
            s.reencrypting = true;
            s.routes = routes;
        })
    }

    /// Fences off `[committed, fence)` of a key-to-key reencryption for rewriting (see
    /// `fence`).
    pub fn announce(&self, fence: u64) -> Result<(), BlockError> {
        let done = self.committed();
        self.fence(done, fence.max(done))
    }

    /// Fences off `[start, end)` for rewriting: once this returns `Ok`, no asynchronous
    /// request touches it, and new ones go to the synchronous path. An error (requests still
    /// in flight after `DRAIN_TIMEOUT`) means the range must not be rewritten yet; the fence
    /// may stay (requests touching it take the synchronous path, which is always right), and
    /// a later call waits for the stragglers first.
    pub fn fence(&self, start: u64, end: u64) -> Result<(), BlockError> {
        register_membarrier()?;
        self.publish(|s| s.routes.fence = (VolumeOffset::new(start), VolumeOffset::new(end)))
    }

    /// Excludes the synchronous path while a hotzone is rewritten or the parts change.
    pub fn hotzone_write(&self) -> RwLockWriteGuard<'_, ()> {
        self.hotzone.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records (under the hotzone lock) that bytes below `done` are in the new segment of a
    /// key-to-key reencryption, and tells the stages.
    /// An error means requests admitted before are still in flight after `DRAIN_TIMEOUT` (the
    /// boundary has moved all the same; the next publication waits for them first), or that
    /// earlier stragglers kept the boundary from being published (the synchronous path,
    /// which splits by the map's own parts, is right either way: see `publish`).
    pub fn advance(
        &self,
        _rewrite: &RwLockWriteGuard<'_, ()>,
        done: u64,
    ) -> Result<(), BlockError> {
        let mut s = self.lock();
        let Some(f) = s.forward.as_mut() else {
            return Err(BlockError::unsupported(
                "moving the boundary of a volume that is not being re-encrypted",
            ));
        };
        f.boundary = VolumeOffset::new(done);
        let routes = Routes::forward(&f.new, &f.old, f.boundary);
        drop(s);
        self.publish(|s| s.routes = routes)
    }

    /// The whole payload is in the new segment of a key-to-key reencryption: it becomes the
    /// only one, and the old cipher (its key) is dropped once the last queue has seen the
    /// change. An error: stragglers kept the single segment from being published (the volume
    /// keeps routing by the boundary, now the payload's end), or are still in flight after it.
    pub fn finish(&self) -> Result<(), BlockError> {
        let _rewrite = self.hotzone_write();
        self.drain.settle_pending(&self.live_stages())?;
        let new = self.lock().forward.as_ref().map(|f| f.new.clone());
        self.publish(|s| {
            if let Some(new) = new {
                s.routes = Routes::single(Storage::Encrypted(new));
            }
            s.forward = None;
            s.reencrypting = false;
            s.routes.fence = NO_FENCE;
        })
    }

    /// Serves `parts` from now on (under the hotzone lock, so that no synchronous request
    /// runs meanwhile), with no fence; `reencrypting` says whether they are a reencryption's.
    pub(crate) fn install(
        &self,
        _rewrite: &RwLockWriteGuard<'_, ()>,
        parts: Vec<Part>,
        reencrypting: bool,
        done: u64,
    ) -> Result<(), BlockError> {
        if parts.first().map(|p| p.start) != Some(VolumeOffset::new(0))
            || parts.windows(2).any(|w| w[0].start > w[1].start)
            || parts.len() > usize::from(u8::MAX)
        {
            return Err(BlockError::unsupported(
                "a volume layout whose parts do not start at 0 in order (at most 255)",
            ));
        }
        register_membarrier()?;
        self.publish(|s| {
            s.routes = Routes {
                parts: parts.into(),
                fence: NO_FENCE,
            };
            s.reencrypting = reencrypting;
            s.done = done;
            s.forward = None;
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
    /// complete first, before anything changes). The synchronous path reads the routes
    /// installed here at once: they are only changed while no synchronous request runs (under
    /// the hotzone lock) or to add a fence, which the synchronous path does not look at.
    fn publish(&self, change: impl FnOnce(&mut State)) -> Result<(), BlockError> {
        self.drain.settle_pending(&self.live_stages())?;
        let previous = {
            let mut s = self.lock();
            change(&mut s);
            let previous = s.generation;
            s.generation += 1;
            self.generation.store(s.generation, Ordering::Release);
            previous
        };
        membarrier();
        let parity = (previous & 1) as usize;
        self.drain.previous(&self.live_stages(), parity)
    }

    /// Runs `op` on each part's share of `len` bytes at `offset`: (storage, volume offset,
    /// start index into the request, length).
    fn split_request(
        &self,
        offset: u64,
        len: u64,
        mut op: impl FnMut(&dyn BlockDevice, VolumeOffset, usize, usize) -> Result<(), BlockError>,
    ) -> Result<(), BlockError> {
        // Always under the lock (a plain read lock, uncontended between hotzones): a request
        // that skipped it could race with a hotzone being rewritten.
        let _hotzone = self.hotzone.read().unwrap_or_else(PoisonError::into_inner);
        let routes = self.routes();
        let size = self.size();
        let offset = VolumeOffset::new(offset);
        let end = offset + len;
        for (i, part) in routes.parts.iter().enumerate() {
            let from = offset.max(part.start);
            let to = end.min(routes.end_of(i, size));
            if from < to {
                op(
                    part.storage.device(),
                    from,
                    (from - offset) as usize,
                    (to - from) as usize,
                )?;
            }
        }
        Ok(())
    }

    /// The encrypted storage an offloaded transfer of `len` payload bytes at `offset` was
    /// routed to (see `CryptStage`: the offload runs only on a uniformly encrypted volume).
    pub(crate) fn core_for(&self, offset: VolumeOffset, len: u64) -> Option<Arc<CryptCore>> {
        let routes = self.routes();
        // A transfer never touches a fence (it went to the synchronous path): ignore it.
        let unfenced = Routes {
            fence: NO_FENCE,
            ..routes
        };
        let i = unfenced.route(offset, len)?;
        match &unfenced.parts[i].storage {
            Storage::Encrypted(core) => Some(core.clone()),
            Storage::Plain(_) => None,
        }
    }
}

impl BlockDevice for SegmentMap {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn logical_block_size(&self) -> u32 {
        self.logical_block_size
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        cryptblk_block::check_range("read", offset, buf.len() as u64, BlockDevice::size(self))?;
        self.split_request(offset, buf.len() as u64, |dev, at, from, n| {
            dev.read_at(&mut buf[from..from + n], at.bytes())
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        cryptblk_block::check_range("write", offset, buf.len() as u64, BlockDevice::size(self))?;
        self.split_request(offset, buf.len() as u64, |dev, at, from, n| {
            dev.write_at(&buf[from..from + n], at.bytes())
        })
    }

    fn flush(&self) -> Result<(), BlockError> {
        let routes = self.routes();
        routes.parts[0].storage.backend().flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        cryptblk_block::check_range("discard", offset, len, BlockDevice::size(self))?;
        self.split_request(offset, len, |dev, at, _, n| {
            dev.discard(at.bytes(), n as u64)
        })
    }

    /// Plaintext parts zero their backend's range; encrypted ones write encrypted zeros.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        cryptblk_block::check_range("write zeroes", offset, len, BlockDevice::size(self))?;
        self.split_request(offset, len, |dev, at, _, n| {
            dev.write_zeroes(at.bytes(), n as u64)
        })
    }

    /// The first part's answer (an encrypted part's is always data; a plaintext part's is its
    /// backend's allocation), clipped to that part.
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        cryptblk_block::check_range("block_status", offset, 0, BlockDevice::size(self))?;
        let routes = self.routes();
        let size = BlockDevice::size(self);
        let len = len.min(size - offset);
        let at = VolumeOffset::new(offset);
        let i = routes
            .parts
            .partition_point(|p| p.start <= at)
            .saturating_sub(1);
        let in_part = len.min(routes.end_of(i, size).checked_since(at).unwrap_or(0));
        routes.parts[i]
            .storage
            .device()
            .block_status(offset, in_part)
    }
}
