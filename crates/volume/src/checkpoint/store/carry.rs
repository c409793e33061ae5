//! Checkpoints carried by a live migration: the source's store exported as each checkpoint's
//! own changed regions ([`CarriedCheckpoints`]), and a destination's store built from them
//! ([`CheckpointImport`]).
//!
//! The destination's disk is served (its I/O held at the migration's gate) before the
//! checkpoints arrive at switchover, and writing them takes a few fsyncs per checkpoint,
//! which need not hold the switchover up. So that no write escapes meanwhile, an import
//! begins before the disk serves: an interim bitmap takes every write's record (durably, as
//! any checkpoint's does) until the carried checkpoints are written; their newest then
//! absorbs the interim one in the same step as writes move to it, as a removal does, and only
//! then does the index name them.

use super::super::format::{
    valid_name, Index, IndexEntry, MAX_CHECKPOINTS, MAX_NAME, WORDS_PER_BLOCK,
};
use super::super::generation::Generation;
use super::super::intent::IntentLog;
use super::super::CheckpointError;
use super::{sync_dir, write_index, CheckpointStore, Inner};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Runs of changed regions a carried checkpoint holds at most: 1 MiB of them on the wire. A
/// checkpoint with more is carried coarser (runs closer than a gap merged: some clean regions
/// then count changed, never the reverse).
pub const MAX_CARRIED_RUNS: usize = 1 << 16;

/// The interim bitmap's generation: above any a store reaches.
const INTERIM: u64 = u64::MAX;

/// A disk's checkpoints as a migration carries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CarriedCheckpoints {
    /// Bytes of image one region stands for.
    pub granularity: u32,
    /// The image bytes the bitmaps cover.
    pub covered: u64,
    /// Oldest first.
    pub checkpoints: Vec<CarriedCheckpoint>,
}

/// One checkpoint: what changed after it was added and before the next one was (its
/// generation; what changed since it is the union of its own and every younger one's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CarriedCheckpoint {
    pub name: String,
    /// When it was added, seconds since 1970 (UTC).
    pub created: u64,
    /// `(first region, regions)`, sorted, neither empty nor touching the next.
    pub runs: Vec<(u64, u64)>,
}

impl CarriedCheckpoints {
    /// Regions the bitmaps have.
    pub fn regions(&self) -> u64 {
        self.covered.div_ceil(u64::from(self.granularity.max(1)))
    }

    /// Checks what a peer sent: a granularity the store format allows, at most
    /// [`MAX_CHECKPOINTS`] checkpoints with valid, distinct names, at most
    /// [`MAX_CARRIED_RUNS`] runs each, sorted, apart and within the covered regions.
    pub fn validate(&self) -> Result<(), String> {
        let g = self.granularity;
        if !g.is_power_of_two() || !(4096..=16 << 20).contains(&g) {
            return Err(format!(
                "granularity {g} is not a power of two from 4 KiB to 16 MiB"
            ));
        }
        if self.checkpoints.len() > MAX_CHECKPOINTS {
            return Err(format!(
                "{} checkpoints, more than {MAX_CHECKPOINTS}",
                self.checkpoints.len()
            ));
        }
        let regions = self.regions();
        for (k, c) in self.checkpoints.iter().enumerate() {
            if !valid_name(&c.name) {
                return Err(format!(
                    "checkpoint {k}'s name is not 1 to {MAX_NAME} of A-Z a-z 0-9 . _ -"
                ));
            }
            if self.checkpoints[..k].iter().any(|p| p.name == c.name) {
                return Err(format!("checkpoint {} is listed twice", c.name));
            }
            if c.runs.len() > MAX_CARRIED_RUNS {
                return Err(format!(
                    "checkpoint {} has {} runs, more than {MAX_CARRIED_RUNS}",
                    c.name,
                    c.runs.len()
                ));
            }
            let mut next_free = 0;
            for &(first, count) in &c.runs {
                let end = first.checked_add(count).filter(|&e| e <= regions);
                if count == 0 || first < next_free || end.is_none() {
                    return Err(format!(
                        "checkpoint {}: run of {count} regions at {first} is empty, out of \
                         order or past the {regions} regions",
                        c.name
                    ));
                }
                next_free = first + count + 1;
            }
        }
        Ok(())
    }
}

/// The set regions of `g`, as runs, coarsened to at most [`MAX_CARRIED_RUNS`].
fn runs_of(g: &Generation, regions: u64) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let words = regions.div_ceil(64) as usize;
    let mut k = 0;
    while k < words {
        // A bitmap block never set: nothing to read (most of a large, quiet disk).
        if !g.wanted.block_in_use(k / WORDS_PER_BLOCK) {
            k = (k / WORDS_PER_BLOCK + 1) * WORDS_PER_BLOCK;
            continue;
        }
        let mut w = g.wanted.word(k);
        if k + 1 == words && !regions.is_multiple_of(64) {
            w &= (1u64 << (regions % 64)) - 1;
        }
        while w != 0 {
            let bit = u64::from(w.trailing_zeros());
            let ones = u64::from((w >> bit).trailing_ones());
            let first = k as u64 * 64 + bit;
            match runs.last_mut() {
                Some((f, n)) if *f + *n == first => *n += ones,
                _ => runs.push((first, ones)),
            }
            w = if bit + ones >= 64 {
                0
            } else {
                w & !(((1u64 << ones) - 1) << bit)
            };
        }
        k += 1;
    }
    coarsen(runs, MAX_CARRIED_RUNS)
}

/// Merges runs closer than a gap (doubled until they fit) so that at most `max` remain.
fn coarsen(mut runs: Vec<(u64, u64)>, max: usize) -> Vec<(u64, u64)> {
    let mut gap = 1u64;
    while runs.len() > max {
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
        for (first, count) in runs {
            match merged.last_mut() {
                Some((f, n)) if first.saturating_sub(*f + *n) <= gap => *n = first + count - *f,
                _ => merged.push((first, count)),
            }
        }
        runs = merged;
        gap = gap.saturating_mul(2);
    }
    runs
}

impl CheckpointStore {
    /// The checkpoints as a migration carries them: names, order, and each one's own changed
    /// regions (what is about to be written is included: every bit wanted, durable or not).
    pub fn export(&self) -> CarriedCheckpoints {
        let inner = self.lock();
        let granularity = inner.index.granularity;
        let covered = inner.index.covered;
        let regions = covered.div_ceil(u64::from(granularity));
        CarriedCheckpoints {
            granularity,
            covered,
            checkpoints: inner
                .index
                .entries
                .iter()
                .zip(&inner.generations)
                .map(|(e, g)| CarriedCheckpoint {
                    name: e.name.clone(),
                    created: e.created,
                    runs: runs_of(g, regions),
                })
                .collect(),
        }
    }
}

/// A store being received: from [`begin`](Self::begin) on, writes are recorded in an interim
/// bitmap; [`finish`](Self::finish) writes the carried checkpoints and moves the record to
/// them, or [`abandon`](Self::abandon) drops it all (the disk then has no checkpoints).
pub struct CheckpointImport {
    dir: PathBuf,
    log: Arc<IntentLog>,
    interim: Arc<Generation>,
}

impl std::fmt::Debug for CheckpointImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointImport")
            .field("dir", &self.dir)
            .finish()
    }
}

impl CheckpointImport {
    /// Starts receiving a store into `dir` (which must not exist: move an old one aside
    /// first) for an image of `covered` bytes whose writes pass `log`. Call it before the
    /// disk serves.
    pub fn begin(
        dir: &Path,
        covered: u64,
        log: Arc<IntentLog>,
    ) -> Result<CheckpointImport, CheckpointError> {
        std::fs::create_dir(dir).map_err(|e| CheckpointError::io("creating", dir, e))?;
        let interim = Generation::create(dir, INTERIM, super::GRANULARITY, covered)
            .and_then(|g| sync_dir(dir).map(|()| Arc::new(g)));
        let interim = match interim {
            Ok(g) => g,
            Err(e) => {
                let _ = std::fs::remove_dir_all(dir);
                return Err(e);
            }
        };
        log.switch(Some(interim.clone()), || Ok(()))?;
        Ok(CheckpointImport {
            dir: dir.to_path_buf(),
            log,
            interim,
        })
    }

    /// Writes `carried` as the store's bitmaps, moves the record to the newest, which takes
    /// every region the interim bitmap holds first, and only then writes the index that names
    /// them. The disk may serve meanwhile (every write is recorded, in one bitmap or the
    /// other). `None` when nothing was carried: the directory is removed. On an error,
    /// [`abandon`](Self::abandon) it (the disk then has no checkpoints).
    pub fn finish(
        &self,
        carried: &CarriedCheckpoints,
    ) -> Result<Option<CheckpointStore>, CheckpointError> {
        let refused = |why: String| {
            CheckpointError::Refused(format!("the checkpoints the source sent: {why}"))
        };
        carried.validate().map_err(refused)?;
        // The interim bitmap's regions are absorbed word for word: the same granularity.
        if carried.granularity != super::GRANULARITY {
            return Err(refused(format!(
                "{}-byte regions; this side keeps {}-byte ones",
                carried.granularity,
                super::GRANULARITY
            )));
        }
        if carried.covered > self.interim_covered() {
            return Err(refused(format!(
                "they cover {} bytes, more than this {}-byte image",
                carried.covered,
                self.interim_covered()
            )));
        }
        if carried.checkpoints.is_empty() {
            self.clear()?;
            return Ok(None);
        }
        let g = u64::from(carried.granularity);
        let mut generations = Vec::with_capacity(carried.checkpoints.len());
        let mut entries = Vec::with_capacity(carried.checkpoints.len());
        for (k, c) in carried.checkpoints.iter().enumerate() {
            let id = k as u64 + 1;
            let generation =
                Generation::create(&self.dir, id, carried.granularity, carried.covered)?;
            let mut blocks = Vec::new();
            for &(first, count) in &c.runs {
                blocks.extend(generation.want(first * g, count * g));
            }
            blocks.sort_unstable();
            blocks.dedup();
            generation.flush_blocks(&blocks)?;
            generations.push(Arc::new(generation));
            entries.push(IndexEntry {
                name: c.name.clone(),
                generation: id,
                created: c.created,
            });
        }
        sync_dir(&self.dir)?;
        // Writes move to the newest carried bitmap, which has the interim one's regions
        // (durably) first; only then does the index name the carried ones. So a crash before
        // the index leaves no store (the next backup full), never one missing a write.
        let newest = generations.last().cloned().expect("not empty");
        let interim = self.interim.clone();
        self.log
            .switch(Some(newest.clone()), || newest.absorb(&interim))?;
        let index = Index {
            granularity: carried.granularity,
            covered: carried.covered,
            next_generation: entries.len() as u64 + 1,
            entries,
        };
        write_index(&self.dir, &index)?;
        // Nothing records in it any more; a leftover file is ignored (no index names it).
        let _ = self.interim.remove_file();
        Ok(Some(CheckpointStore {
            dir: self.dir.clone(),
            log: self.log.clone(),
            inner: Mutex::new(Inner { index, generations }),
        }))
    }

    /// Drops the interim bitmap and the directory: the disk has no checkpoints (the next
    /// backup must be full).
    pub fn abandon(self) -> Result<(), CheckpointError> {
        self.clear()
    }

    fn clear(&self) -> Result<(), CheckpointError> {
        self.log.switch(None, || Ok(()))?;
        std::fs::remove_dir_all(&self.dir)
            .map_err(|e| CheckpointError::io("removing", &self.dir, e))
    }

    fn interim_covered(&self) -> u64 {
        self.interim.covered()
    }
}

#[cfg(test)]
mod tests;
