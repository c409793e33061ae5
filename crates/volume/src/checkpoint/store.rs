//! [`CheckpointStore`]: a disk's checkpoints, as a directory beside its image
//! (`<image>.cryptblk-checkpoints/`: an `index` and one bitmap file per checkpoint, see
//! `format.rs`).
//!
//! The bitmap of checkpoint C is what changed since C was added: the union of C's generation
//! and every later one. Only the newest generation is written to (through the [`IntentLog`]);
//! adding a checkpoint starts a new, empty one; removing one folds its generation into the
//! one before it (what changed since it also changed since that one), or drops it when it is
//! the oldest. Every step is ordered so a crash at any point leaves a superset: a new bitmap
//! is durable before the index names it, a merged one before the index forgets its source.

use super::format::{valid_name, Index, IndexEntry, MAX_CHECKPOINTS, MAX_NAME};
use super::generation::Generation;
use super::intent::IntentLog;
use super::CheckpointError;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

mod carry;
pub use carry::{CarriedCheckpoint, CarriedCheckpoints, CheckpointImport, MAX_CARRIED_RUNS};

/// Bytes of image one bit stands for. 64 KiB: QEMU's default dirty-bitmap granularity (so
/// `qemu-img`/`nbdinfo` users see the extents they are used to), one durable flush per 64 KiB
/// of newly written disk, and 2 MiB of memory per TiB of disk per checkpoint; an incremental
/// copies at most 64 KiB per changed region.
pub const GRANULARITY: u32 = 64 * 1024;

/// What `checkpoint-list` shows of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    pub name: String,
    /// When it was added, seconds since 1970 (UTC).
    pub created: u64,
    /// Bytes of the image marked changed since it was added (whole regions; the header
    /// counted by the caller is not included).
    pub dirty_bytes: u64,
}

/// A disk's checkpoints: their index and bitmaps, and the write-intent log their newest one
/// is recorded through.
pub struct CheckpointStore {
    dir: PathBuf,
    log: Arc<IntentLog>,
    inner: Mutex<Inner>,
}

struct Inner {
    index: Index,
    /// The bitmaps of `index.entries`, in the same order.
    generations: Vec<Arc<Generation>>,
}

impl std::fmt::Debug for CheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointStore")
            .field("dir", &self.dir)
            .finish()
    }
}

/// The directory the checkpoints of the image at `image` are kept in.
pub fn store_dir(image: &Path) -> PathBuf {
    let mut name = image.as_os_str().to_owned();
    name.push(".cryptblk-checkpoints");
    PathBuf::from(name)
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| CheckpointError::io("syncing", dir, e))
}

impl CheckpointStore {
    /// Opens the store in `dir` for an image of `covered` bytes and records the newest
    /// checkpoint's writes through `log`. `None` when there is no store and `create` is false.
    /// Damaged bitmaps are loaded as dirty (and reported in the returned warnings); a damaged
    /// index is an error (the checkpoints cannot be known: the next backup must be full).
    pub fn open(
        dir: &Path,
        covered: u64,
        log: Arc<IntentLog>,
        create: bool,
    ) -> Result<Option<(CheckpointStore, Vec<String>)>, CheckpointError> {
        let index_path = dir.join("index");
        let bytes = match std::fs::read(&index_path) {
            Ok(bytes) => Some(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(CheckpointError::io("reading", &index_path, e)),
        };
        let mut warnings = Vec::new();
        let (index, generations) = match bytes {
            None if !create => return Ok(None),
            None => {
                std::fs::create_dir_all(dir)
                    .map_err(|e| CheckpointError::io("creating", dir, e))?;
                let index = Index {
                    granularity: GRANULARITY,
                    covered,
                    next_generation: 1,
                    entries: Vec::new(),
                };
                write_index(dir, &index)?;
                (index, Vec::new())
            }
            Some(bytes) => {
                let mut index = Index::decode(&bytes).map_err(|e| CheckpointError::Damaged {
                    path: index_path.clone(),
                    why: e.0,
                })?;
                let mut generations = Vec::with_capacity(index.entries.len());
                for entry in &index.entries {
                    let (generation, damage) =
                        Generation::load(dir, entry.generation, index.granularity, covered)?;
                    if let Some(why) = damage {
                        warnings.push(format!(
                            "checkpoint {}: {why}; its regions are counted changed",
                            entry.name
                        ));
                    }
                    generations.push(Arc::new(generation));
                }
                if index.covered != covered {
                    index.covered = covered;
                    write_index(dir, &index)?;
                }
                (index, generations)
            }
        };
        log.switch(generations.last().cloned(), || Ok(()))?;
        Ok(Some((
            CheckpointStore {
                dir: dir.to_path_buf(),
                log,
                inner: Mutex::new(Inner { index, generations }),
            },
            warnings,
        )))
    }

    /// The write-intent log the newest checkpoint is recorded through.
    pub fn log(&self) -> &Arc<IntentLog> {
        &self.log
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn granularity(&self) -> u32 {
        self.lock().index.granularity
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds checkpoint `name` at `created` (seconds since 1970): from now on what is written
    /// is recorded as changed since it.
    pub fn add(&self, name: &str, created: u64) -> Result<(), CheckpointError> {
        if !valid_name(name) {
            return Err(CheckpointError::Refused(format!(
                "{name:?} is not a checkpoint name: use 1 to {MAX_NAME} of A-Z a-z 0-9 . _ - \
                 (not starting with .)"
            )));
        }
        let mut inner = self.lock();
        if inner.index.entries.iter().any(|e| e.name == name) {
            return Err(CheckpointError::Refused(format!(
                "the disk already has a checkpoint {name}: remove it first or choose another name"
            )));
        }
        if inner.index.entries.len() >= MAX_CHECKPOINTS {
            return Err(CheckpointError::Refused(format!(
                "the disk has {MAX_CHECKPOINTS} checkpoints, the most it keeps: remove one first"
            )));
        }
        let id = inner.index.next_generation;
        let generation = Arc::new(Generation::create(
            &self.dir,
            id,
            inner.index.granularity,
            inner.index.covered,
        )?);
        sync_dir(&self.dir)?;
        let mut index = inner.index.clone();
        index.next_generation = id + 1;
        index.entries.push(IndexEntry {
            name: name.to_string(),
            generation: id,
            created,
        });
        if let Err(e) = write_index(&self.dir, &index) {
            let _ = generation.remove_file();
            return Err(e);
        }
        inner.index = index;
        inner.generations.push(generation.clone());
        self.log.switch(Some(generation), || Ok(()))
    }

    /// Removes checkpoint `name`; what changed since it is kept for the checkpoint before it.
    pub fn remove(&self, name: &str) -> Result<(), CheckpointError> {
        let mut inner = self.lock();
        let Some(k) = inner.index.entries.iter().position(|e| e.name == name) else {
            return Err(CheckpointError::NotFound(name.to_string()));
        };
        let retired = inner.generations[k].clone();
        let older = k.checked_sub(1).map(|o| inner.generations[o].clone());
        let newest = k + 1 == inner.generations.len();
        let merge = || match &older {
            Some(older) => older.absorb(&retired),
            None => Ok(()),
        };
        if newest {
            // Writes move to the older bitmap in the same step as it takes the retired one's
            // bits, so none falls between.
            self.log.switch(older.clone(), merge)?;
        } else {
            merge()?;
        }
        let mut index = inner.index.clone();
        index.entries.remove(k);
        write_index(&self.dir, &index)?;
        inner.index = index;
        inner.generations.remove(k);
        retired.remove_file()?;
        sync_dir(&self.dir)
    }

    /// The checkpoints, oldest first.
    pub fn list(&self) -> Vec<CheckpointInfo> {
        let inner = self.lock();
        inner
            .index
            .entries
            .iter()
            .enumerate()
            .map(|(k, e)| CheckpointInfo {
                name: e.name.clone(),
                created: e.created,
                dirty_bytes: Self::dirty_bytes_of(&inner, k, 0, inner.index.covered),
            })
            .collect()
    }

    /// Whether the disk has checkpoint `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.lock().index.entries.iter().any(|e| e.name == name)
    }

    /// The image byte ranges changed since checkpoint `name`, `(offset, length)`, sorted and
    /// disjoint, from the region holding `from` on, at most `limit` of them, for an image of
    /// `size` bytes now. Bytes below `header` (the LUKS header, which changes outside the
    /// log) are always reported changed, and so are bytes past what the bitmaps cover (the
    /// image grew since the store was opened: writes there were not recorded).
    pub fn dirty_runs(
        &self,
        name: &str,
        from: u64,
        limit: usize,
        header: u64,
        size: u64,
    ) -> Result<Vec<(u64, u64)>, CheckpointError> {
        let inner = self.lock();
        let k = Self::position(&inner, name)?;
        let mut runs = Vec::new();
        Self::for_each_run(&inner, k, from, header, size, |offset, len| {
            if runs.len() == limit {
                return false;
            }
            runs.push((offset, len));
            true
        });
        Ok(runs)
    }

    /// Bytes of the image changed since checkpoint `name`, counted as by `dirty_runs`.
    pub fn dirty_bytes(&self, name: &str, header: u64, size: u64) -> Result<u64, CheckpointError> {
        let inner = self.lock();
        let k = Self::position(&inner, name)?;
        Ok(Self::dirty_bytes_of(&inner, k, header, size))
    }

    fn position(inner: &Inner, name: &str) -> Result<usize, CheckpointError> {
        inner
            .index
            .entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(|| CheckpointError::NotFound(name.to_string()))
    }

    fn dirty_bytes_of(inner: &Inner, k: usize, header: u64, size: u64) -> u64 {
        let mut bytes = 0;
        Self::for_each_run(inner, k, 0, header, size, |_, len| {
            bytes += len;
            true
        });
        bytes
    }

    /// Calls `each` with every changed range of checkpoint `k` from the region holding
    /// `from` on, in order, while it returns true.
    fn for_each_run(
        inner: &Inner,
        k: usize,
        from: u64,
        header: u64,
        size: u64,
        mut each: impl FnMut(u64, u64) -> bool,
    ) {
        let granularity = u64::from(inner.index.granularity);
        let covered = inner.index.covered;
        let gens = &inner.generations[k..];
        let regions = size.div_ceil(granularity);
        let header_regions = header.min(size).div_ceil(granularity);
        // From the region holding the old end on, a grown image's writes were not recorded.
        let untracked = if size > covered {
            covered / granularity
        } else {
            regions
        };
        // Word `w` of the union of the generations, with the regions always changed.
        let word = |w: u64| {
            let below_header = header_regions.saturating_sub(w * 64).min(64);
            let from_untracked = (w * 64 + 64).saturating_sub(untracked).min(64);
            let always = low_mask(below_header) | !low_mask(64 - from_untracked);
            gens.iter()
                .fold(always, |acc, g| acc | g.wanted.word(w as usize))
        };
        let mut push = |first: u64, end: u64| {
            let offset = first * granularity;
            each(offset, (end * granularity).min(size) - offset)
        };
        let mut r = from / granularity;
        let mut run: Option<u64> = None;
        while r < regions {
            let avail = (64 - r % 64).min(regions - r);
            let bits = (word(r / 64) >> (r % 64)) & low_mask(avail);
            match run {
                None if bits == 0 => r += avail,
                None => {
                    r += u64::from(bits.trailing_zeros());
                    run = Some(r);
                }
                Some(first) => {
                    let ones = u64::from(bits.trailing_ones()).min(avail);
                    r += ones;
                    if ones < avail {
                        run = None;
                        if !push(first, r) {
                            return;
                        }
                    }
                }
            }
        }
        if let Some(first) = run {
            push(first, regions);
        }
    }
}

fn low_mask(n: u64) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1 << n) - 1
    }
}

/// Replaces the index: a temporary file, fsynced, renamed over it, the directory fsynced.
fn write_index(dir: &Path, index: &Index) -> Result<(), CheckpointError> {
    let tmp = dir.join("index.tmp");
    let path = dir.join("index");
    File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(&index.encode())?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| CheckpointError::io("writing", &path, e))?;
    sync_dir(dir)
}

#[cfg(test)]
mod tests;
