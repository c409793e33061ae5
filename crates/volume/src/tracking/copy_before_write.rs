//! Copy-before-write: what keeps a backup export a point-in-time view while the disk is
//! written. Before a write, discard or write-zeroes changes a 4 KiB region of the image file
//! for the first time since the backup started, the region's old bytes (ciphertext or header)
//! are copied to a scratch file of bounded size; the export reads them from there
//! ([`BackupView`](super::BackupView)).
//!
//! Order, so that a read racing a write is served correctly: the writer copies the old bytes
//! to the scratch, *then* marks the region copied, *then* writes the image. The export reads
//! the image, *then* looks at the mark: unset, the image bytes it read were the old ones
//! (the write starts only after the mark is set); set, it reads the scratch, written before
//! the mark.
//!
//! A full scratch (or a scratch that cannot be written) fails the backup, never the guest:
//! the write goes on without a copy and the export answers every read from then on with an
//! I/O error naming the reason.
//!
//! An incremental backup reads only the regions changed since the checkpoint it starts from
//! ([`CopyBeforeWrite::limit_to`]), so only those are copied, as QEMU's copy-before-write
//! filter copies only its `bitmap`'s: a VM writing where nothing changed since FROM pays
//! nothing for the backup but an atomic mark, once per region. The other regions are served
//! as long as they were not changed; once changed, reading them fails (their bytes would be
//! today's, not the backup's moment's), as QEMU's snapshot-access refuses what it did not
//! copy.
//!
//! A client that has stored a range says so with a TRIM on the export
//! ([`CopyBeforeWrite::release`], as a discard on QEMU's snapshot-access): from then on a
//! write there is not copied, the range's copies leave the scratch (their slots are used
//! again), and reading it fails. A full backup of a disk the VM writes all over then copies
//! only what is ahead of the client, and a scratch of a fraction of the disk is enough.

use cryptblk_block::{BlockDevice, BlockError, BlockErrorKind};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};

use super::DirtyBitmap;

/// What is copied at once: 4 KiB, the block a VM writes most. A VM writing all over its disk
/// during a backup makes nearly every write the first to its region, and then waits for a
/// copy of the region before its own write: a 4 KiB copy costs it half what a 64 KiB one
/// (QEMU's cluster, and the checkpoints' granularity) does (`scripts/bench-backup-export.sh`,
/// docs/backup.md). The price is a bit per 4 KiB of image while a backup runs (32 MiB per
/// TiB, allocated and zeroed when it starts).
pub const COPY_REGION: u64 = 4096;

/// What a release frees at once: the whole 1 MiB granules inside the released range (and a
/// last one cut by the image's end). Coarse, so what the backup forgets costs 128 KiB per TiB
/// of image however much of it the client releases; a client that releases its stored prefix
/// piece by piece starts each piece at a granule's start.
pub const RELEASE_GRANULE: u64 = 1 << 20;

/// A backup's copy-before-write state: the scratch file, which regions it holds and where.
///
/// Memory: one bit per 4 KiB of image (32 MiB per TiB) to say a region was copied (checked
/// without a lock on every write), one per 1 MiB to say it was released, and a map entry per
/// scratch slot used (at most `scratch_size / 4 KiB`), plus a 4 KiB buffer per copy under way
/// at once.
///
/// No lock is held across I/O: a region being copied is claimed in the map, and a second
/// writer of it waits for that copy (its write must not land before the old bytes are safe).
pub struct CopyBeforeWrite {
    /// The image file's bytes, as the backup serves them.
    source: std::sync::Arc<dyn BlockDevice>,
    scratch: File,
    path: PathBuf,
    /// The image's size when the backup started (it cannot change during one).
    size: u64,
    /// How many regions the scratch holds.
    slots: u64,
    /// Regions a write may change without a copy: copied to the scratch, or outside the
    /// backup and marked changed.
    copied: DirtyBitmap,
    /// Where the image is outside the backup (see [`CopyBeforeWrite::limit_to`]; at the
    /// granularity it was given) and why, once limited.
    outside: OnceLock<(DirtyBitmap, String)>,
    /// Granules the client has stored and released ([`CopyBeforeWrite::release`]).
    released: DirtyBitmap,
    /// Regions held in the scratch.
    copies: AtomicU64,
    map: Mutex<CopyMap>,
    /// Signalled when a copy under way ends.
    copy_ended: Condvar,
    failed: AtomicBool,
    reason: OnceLock<String>,
}

struct CopyMap {
    /// Region -> (slot, whether its copy is complete).
    slot_of: HashMap<u64, (u64, bool)>,
    /// Slots handed out (a failed copy's slot is not reused).
    next_slot: u64,
    /// Slots handed out whose regions were released since: used again first.
    free_slots: Vec<u64>,
    /// Copy buffers not in use.
    buffers: Vec<Vec<u8>>,
}

impl std::fmt::Debug for CopyBeforeWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyBeforeWrite")
            .field("scratch", &self.path)
            .field("slots", &self.slots)
            .field("copied", &self.copied.count())
            .field("failed", &self.failure())
            .finish()
    }
}

impl CopyBeforeWrite {
    /// Creates the scratch file at `path` (replacing a leftover of a crashed backup), able to
    /// hold `scratch_size` bytes of copied regions (rounded down to 4 KiB, at least one).
    pub fn create(
        source: std::sync::Arc<dyn BlockDevice>,
        path: &Path,
        scratch_size: u64,
    ) -> Result<Self, BlockError> {
        let slots = scratch_size / COPY_REGION;
        if slots == 0 {
            return Err(BlockError::new(
                BlockErrorKind::Unsupported,
                format!(
                    "a backup scratch of {scratch_size} bytes holds no {COPY_REGION}-byte \
                     region: give at least {COPY_REGION} bytes"
                ),
            ));
        }
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(BlockError::io("removing a leftover backup scratch", e).with_path(path))
            }
        }
        let scratch = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| BlockError::io("creating the backup scratch", e).with_path(path))?;
        let size = source.size();
        let bitmap = |granularity| {
            DirtyBitmap::new(size, granularity)
                .map_err(|e| BlockError::new(BlockErrorKind::Unsupported, e.0))
        };
        let (copied, released) = (bitmap(COPY_REGION)?, bitmap(RELEASE_GRANULE)?);
        Ok(CopyBeforeWrite {
            source,
            scratch,
            path: path.to_path_buf(),
            size,
            slots,
            copied,
            outside: OnceLock::new(),
            released,
            copies: AtomicU64::new(0),
            map: Mutex::new(CopyMap {
                slot_of: HashMap::new(),
                next_slot: 0,
                free_slots: Vec::new(),
                buffers: Vec::new(),
            }),
            copy_ended: Condvar::new(),
            failed: AtomicBool::new(false),
            reason: OnceLock::new(),
        })
    }

    /// The image's size the backup serves.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The scratch's capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.slots * COPY_REGION
    }

    /// Bytes of old image data held in the scratch.
    pub fn used(&self) -> u64 {
        self.copies.load(Ordering::SeqCst) * COPY_REGION
    }

    /// Limits the backup to the regions set in `inside` (a bitmap of the image at a multiple
    /// of [`COPY_REGION`], e.g. what changed since the checkpoint an incremental starts from): from now on a change elsewhere is not copied, and reading a region
    /// changed so fails with an error saying `why`. Once per backup; a second call is ignored.
    /// Regions copied before it stay in the scratch and are served from there.
    pub fn limit_to(&self, inside: &DirtyBitmap, why: String) -> Result<(), BlockError> {
        if !inside.granularity().is_multiple_of(COPY_REGION) || inside.size() < self.size {
            return Err(BlockError::new(
                BlockErrorKind::Unsupported,
                format!(
                    "a backup's regions must be given in multiples of {COPY_REGION} bytes \
                     over its whole image ({} bytes)",
                    self.size
                ),
            ));
        }
        let outside = DirtyBitmap::new(self.size, inside.granularity())
            .map_err(|e| BlockError::new(BlockErrorKind::Unsupported, e.0))?;
        let mut block = 0;
        while let Some((first, count)) = inside.next_run(block, false) {
            let (offset, len) = outside.block_range(first, count);
            outside.set_range(offset, len);
            block = first + count;
        }
        // A second limit is ignored (the first one's regions may be marked changed already).
        let _ = self.outside.set((outside, why));
        Ok(())
    }

    /// The client has stored `len` bytes at `offset` and needs them no more (an NBD TRIM on
    /// the export): the whole [`RELEASE_GRANULE`]s inside the range (and a last one cut by
    /// the image's end) are released. A write there is not copied from now on, their copies
    /// leave the scratch (its slots are used again), and reading them fails with an error
    /// that says so.
    pub fn release(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        cryptblk_block::check_range("release", offset, len, self.size)?;
        let end = offset + len;
        let first = offset.div_ceil(RELEASE_GRANULE);
        let end_granule = if end == self.size {
            end.div_ceil(RELEASE_GRANULE)
        } else {
            end / RELEASE_GRANULE
        };
        if first >= end_granule {
            return Ok(());
        }
        let start = first * RELEASE_GRANULE;
        let span = ((end_granule - first) * RELEASE_GRANULE).min(self.size - start);
        // From here on a write there copies nothing (a copy under way ends in `copy`), and a
        // read there fails.
        self.released.set_range(start, span);
        let regions = start / COPY_REGION..(start + span).div_ceil(COPY_REGION);
        let mut map = self.lock();
        let CopyMap {
            slot_of,
            free_slots,
            ..
        } = &mut *map;
        // Whichever is shorter, the range or the map: a client's TRIM costs at most one pass
        // over the scratch's slots, however many it sends.
        let freed_slots: Vec<(u64, u64)> = if regions.end - regions.start < slot_of.len() as u64 {
            regions
                .filter_map(|region| match slot_of.get(&region) {
                    Some(&(slot, true)) => Some((region, slot)),
                    _ => None,
                })
                .collect()
        } else {
            slot_of
                .iter()
                .filter(|&(region, &(_, complete))| complete && regions.contains(region))
                .map(|(&region, &(slot, _))| (region, slot))
                .collect()
        };
        for &(region, slot) in &freed_slots {
            slot_of.remove(&region);
            free_slots.push(slot);
        }
        self.copies
            .fetch_sub(freed_slots.len() as u64, Ordering::SeqCst);
        Ok(())
    }

    fn is_released(&self, region: u64) -> bool {
        self.released.is_set(region * COPY_REGION / RELEASE_GRANULE)
    }

    /// Scratch slots holding a region (never more than the scratch has).
    pub fn slots_used(&self) -> u64 {
        self.lock().slot_of.len() as u64
    }

    pub fn scratch_path(&self) -> &Path {
        &self.path
    }

    /// Why the backup failed, once it did.
    pub fn failure(&self) -> Option<&str> {
        if self.failed.load(Ordering::SeqCst) {
            Some(self.reason.get().map_or("failed", String::as_str))
        } else {
            None
        }
    }

    /// Whether a change of `len` image bytes at `offset` needs no copy (copied already,
    /// released, or the backup failed): the fast path, a few atomic loads.
    fn needs_no_copy(&self, offset: u64, len: u64) -> bool {
        self.failed.load(Ordering::SeqCst)
            || self.copied.all_set(offset, len)
            || self.released.all_set(offset, len)
    }

    /// Whether a change of `len` image bytes at `offset` must wait for copies (`copy`). The
    /// regions it touches outside the backup are marked changed on the way, before the
    /// change is made, so a read of one that sees no mark read the old bytes.
    pub(crate) fn needs_copy(&self, offset: u64, len: u64) -> bool {
        if len == 0 || offset >= self.size || self.needs_no_copy(offset, len) {
            return false;
        }
        let Some((outside, _)) = self.outside.get() else {
            return true;
        };
        let end = offset.saturating_add(len).min(self.size);
        let mut inside = false;
        for region in offset / COPY_REGION..=(end - 1) / COPY_REGION {
            if outside.is_set(region * COPY_REGION / outside.granularity()) {
                self.copied.set_range(region * COPY_REGION, 1);
            } else if !self.copied.is_set(region) && !self.is_released(region) {
                inside = true;
            }
        }
        inside
    }

    fn fail(&self, why: String) {
        if self.reason.set(why.clone()).is_ok() {
            tracing::error!("{why}");
        }
        self.failed.store(true, Ordering::SeqCst);
    }

    /// Copies the regions `len` image bytes at `offset` touch that are not copied yet to the
    /// scratch, before the caller changes them. Never fails the caller: when a copy cannot be
    /// made, the backup fails instead.
    pub(crate) fn copy(&self, offset: u64, len: u64) {
        if len == 0 || offset >= self.size {
            return;
        }
        let end = offset.saturating_add(len).min(self.size);
        let (first, last) = (offset / COPY_REGION, (end - 1) / COPY_REGION);
        for region in first..=last {
            if !self.needs_copy(region * COPY_REGION, 1) {
                continue;
            }
            let mut map = self.lock();
            let slot = loop {
                // Another writer may have copied it (or failed the backup) meanwhile.
                if self.needs_no_copy(region * COPY_REGION, 1) {
                    break None;
                }
                match map.slot_of.get(&region) {
                    // Its copy is under way: the write waits for the old bytes to be safe.
                    Some(&(_, false)) => {
                        map = self
                            .copy_ended
                            .wait(map)
                            .unwrap_or_else(PoisonError::into_inner);
                    }
                    _ => break Some(map.free_slots.pop().unwrap_or(map.next_slot)),
                }
            };
            let Some(slot) = slot else { continue };
            if slot >= self.slots {
                drop(map);
                self.fail(format!(
                    "the backup scratch {} is full ({} bytes of regions the disk changed \
                     during the backup were copied): the backup failed; end it with \
                     backup-end --failed and start it again with a larger --scratch-size",
                    self.path.display(),
                    self.capacity()
                ));
                return;
            }
            if slot == map.next_slot {
                map.next_slot += 1;
            }
            map.slot_of.insert(region, (slot, false));
            let mut buffer = map
                .buffers
                .pop()
                .unwrap_or_else(|| vec![0; COPY_REGION as usize]);
            drop(map);
            let start = region * COPY_REGION;
            let n = COPY_REGION.min(self.size - start) as usize;
            let copied = self
                .source
                .read_at(&mut buffer[..n], start)
                .map_err(|e| format!("reading the image at {start}: {e}"))
                .and_then(|()| {
                    self.scratch
                        .write_all_at(&buffer[..n], slot * COPY_REGION)
                        .map_err(|e| format!("writing {}: {e}", self.path.display()))
                });
            let mut map = self.lock();
            map.buffers.push(buffer);
            match copied {
                // Released while it was copied: nobody will read it.
                Ok(()) if self.is_released(region) => {
                    map.slot_of.remove(&region);
                    map.free_slots.push(slot);
                }
                Ok(()) => {
                    map.slot_of.insert(region, (slot, true));
                    self.copies.fetch_add(1, Ordering::SeqCst);
                    // Only now: a reader that sees the mark finds the old bytes in the scratch.
                    self.copied.set_range(start, 1);
                }
                Err(why) => {
                    map.slot_of.remove(&region);
                    self.fail(format!(
                        "copying old data to the backup scratch failed ({why}): the backup \
                         failed; end it with backup-end --failed"
                    ));
                }
            }
            drop(map);
            self.copy_ended.notify_all();
            if self.failure().is_some() {
                return;
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, CopyMap> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The backup's view of `buf.len()` image bytes at `offset`, as they were when it started.
    pub(crate) fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.check("read")?;
        cryptblk_block::check_range("read", offset, buf.len() as u64, self.size)?;
        // The whole range in one read; then, for each region, the mark: a region marked now
        // may have been overwritten since the image was read, and its old bytes are in the
        // scratch.
        self.source.read_at(buf, offset)?;
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset + done as u64;
            let region = at / COPY_REGION;
            let in_region = (at % COPY_REGION) as usize;
            let n = (COPY_REGION as usize - in_region).min(buf.len() - done);
            let chunk = &mut buf[done..done + n];
            // Released: a write there since was not copied, so the image cannot say.
            if self.is_released(region) {
                return Err(BlockError::new(
                    BlockErrorKind::Io,
                    "the backup's client released these bytes (an NBD TRIM: it had \
                     stored them), so the export no longer keeps them: read a range \
                     before releasing it",
                )
                .with_op("read")
                .at(at));
            }
            if self.copied.is_set(region) {
                let slot = self.lock().slot_of.get(&region).map(|&(slot, _)| slot);
                let Some(slot) = slot else {
                    if let Some((_, why)) = self.outside.get() {
                        return Err(BlockError::new(
                            BlockErrorKind::Io,
                            format!("the disk changed here since the backup started: {why}"),
                        )
                        .with_op("read")
                        .at(at));
                    }
                    return Err(BlockError::new(
                        BlockErrorKind::Io,
                        "a region marked copied has no place in the backup scratch",
                    ));
                };
                self.scratch
                    .read_exact_at(chunk, slot * COPY_REGION + in_region as u64)
                    .map_err(|e| {
                        BlockError::io("reading the backup scratch", e).with_path(&self.path)
                    })?;
            }
            done += n;
        }
        // A failure seen only now may have let a write through uncopied while this read.
        self.check("read")
    }

    /// Whether the backup's view of the region holding `offset` comes from the scratch.
    pub(crate) fn is_copied(&self, offset: u64) -> bool {
        self.copied.is_set(offset / COPY_REGION)
    }

    fn check(&self, op: &'static str) -> Result<(), BlockError> {
        match self.failure() {
            None => Ok(()),
            Some(why) => Err(BlockError::new(BlockErrorKind::Io, why.to_string()).with_op(op)),
        }
    }
}

impl Drop for CopyBeforeWrite {
    /// The scratch goes with the backup, unless the name is a later backup's scratch by now.
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        let ours = match (self.scratch.metadata(), std::fs::metadata(&self.path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        };
        if ours {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!("removing the backup scratch {}: {e}", self.path.display());
            }
        }
    }
}
