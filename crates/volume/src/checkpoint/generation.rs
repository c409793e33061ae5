//! One checkpoint's bitmap: what was written since it was added and before the next one was,
//! in memory (atomic words any I/O thread sets) and in its file (`format.rs`).
//!
//! Two sets of bits: `wanted`, set by a write about to be recorded, and `durable`, set only
//! once the block holding the bit is on stable storage. A write passes when `durable` covers
//! it; `wanted` is what the flusher writes out and what queries read (a superset: a bit
//! wanted but not yet durable belongs to a write not yet submitted).

use super::format::{
    block_offset, blocks_for, decode_block, encode_block, BitmapHeader, BLOCK, REGIONS_PER_BLOCK,
    WORDS_PER_BLOCK,
};
use super::CheckpointError;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Regions as atomic words; bit `r % 64` of word `r / 64` is region `r`. The words of a bitmap
/// block (`WORDS_PER_BLOCK`, 2 GiB of image at 64 KiB) are allocated when one of them is first
/// set: a clean block costs a pointer, so a host's idle disks hold almost nothing for their
/// checkpoints (allocated whole, a 1 TiB disk's two sets took 4 MiB per checkpoint: 800 MiB
/// for 200 such disks).
pub(crate) struct RegionBits {
    blocks: Box<[OnceLock<Box<[AtomicU64]>>]>,
    regions: u64,
}

impl RegionBits {
    fn new(regions: u64) -> RegionBits {
        RegionBits {
            blocks: (0..blocks_for(regions)).map(|_| OnceLock::new()).collect(),
            regions,
        }
    }

    /// The block holding word `k`, allocated (zeroed) if it was not.
    fn block_for_set(&self, k: usize) -> &[AtomicU64] {
        self.blocks[k / WORDS_PER_BLOCK]
            .get_or_init(|| (0..WORDS_PER_BLOCK).map(|_| AtomicU64::new(0)).collect())
    }

    /// Sets regions `first..end`.
    fn set(&self, first: u64, end: u64) {
        let mut r = first;
        while r < end {
            let bit = r % 64;
            let n = (64 - bit).min(end - r);
            let k = (r / 64) as usize;
            self.block_for_set(k)[k % WORDS_PER_BLOCK]
                .fetch_or(low_mask(n) << bit, Ordering::AcqRel);
            r += n;
        }
    }

    fn all_set(&self, first: u64, end: u64) -> bool {
        let mut r = first;
        while r < end {
            let bit = r % 64;
            let n = (64 - bit).min(end - r);
            let mask = low_mask(n) << bit;
            if self.word((r / 64) as usize) & mask != mask {
                return false;
            }
            r += n;
        }
        true
    }

    /// Words in the bitmap (whole blocks).
    pub(crate) fn word_count(&self) -> usize {
        self.blocks.len() * WORDS_PER_BLOCK
    }

    /// Word `k` (0 past the end, and in a block never set).
    pub(crate) fn word(&self, k: usize) -> u64 {
        self.blocks
            .get(k / WORDS_PER_BLOCK)
            .and_then(OnceLock::get)
            .map_or(0, |words| {
                words[k % WORDS_PER_BLOCK].load(Ordering::Acquire)
            })
    }

    /// Whether bitmap block `b` (words `b * WORDS_PER_BLOCK ..`) may have a bit set: false
    /// for a block never set, whose words all read 0.
    pub(crate) fn block_in_use(&self, b: usize) -> bool {
        self.blocks.get(b).is_some_and(|w| w.get().is_some())
    }

    fn or_word(&self, k: usize, v: u64) {
        if v != 0 {
            self.block_for_set(k)[k % WORDS_PER_BLOCK].fetch_or(v, Ordering::AcqRel);
        }
    }

    /// Bitmap blocks with memory of their own.
    #[cfg(test)]
    pub(crate) fn allocated_blocks(&self) -> usize {
        self.blocks.iter().filter(|b| b.get().is_some()).count()
    }
}

/// The offset of the first byte of data (not a hole) at or after `at`: `u64::MAX` when there is
/// none, `at` itself when the file system cannot tell (every block is then read).
fn data_at_or_after(file: &File, at: u64) -> u64 {
    match rustix::fs::seek(file, rustix::fs::SeekFrom::Data(at)) {
        Ok(offset) => offset,
        Err(rustix::io::Errno::NXIO) => u64::MAX,
        Err(_) => at,
    }
}

fn low_mask(n: u64) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1 << n) - 1
    }
}

/// A checkpoint's bitmap and its file.
pub(crate) struct Generation {
    pub(crate) id: u64,
    file: File,
    path: PathBuf,
    shift: u32,
    covered: u64,
    pub(crate) wanted: RegionBits,
    pub(crate) durable: RegionBits,
}

impl Generation {
    fn path_in(dir: &Path, id: u64) -> PathBuf {
        dir.join(format!("{id:016x}.bitmap"))
    }

    /// A new, empty bitmap covering `covered` bytes, written whole and fsynced (the caller
    /// fsyncs the directory).
    pub(crate) fn create(
        dir: &Path,
        id: u64,
        granularity: u32,
        covered: u64,
    ) -> Result<Generation, CheckpointError> {
        let path = Self::path_in(dir, id);
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| CheckpointError::io("creating", &path, e))?;
        let generation = Generation::empty(file, path, id, granularity, covered);
        generation.write_header()?;
        Ok(generation)
    }

    fn empty(file: File, path: PathBuf, id: u64, granularity: u32, covered: u64) -> Generation {
        let regions = covered.div_ceil(u64::from(granularity));
        Generation {
            id,
            file,
            path,
            shift: granularity.trailing_zeros(),
            covered,
            wanted: RegionBits::new(regions),
            durable: RegionBits::new(regions),
        }
    }

    /// Loads generation `id` covering `covered` bytes. What cannot be trusted reads as dirty:
    /// a missing or damaged file all of it, a block that does not verify all its regions;
    /// regions past what the file covered (the image grew) are dirty. Such a file is written
    /// again whole. Returns whether it had to.
    pub(crate) fn load(
        dir: &Path,
        id: u64,
        granularity: u32,
        covered: u64,
    ) -> Result<(Generation, Option<String>), CheckpointError> {
        let path = Self::path_in(dir, id);
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| CheckpointError::io("opening", &path, e))?;
        let generation = Generation::empty(file, path, id, granularity, covered);
        let regions = generation.wanted.regions;
        let mut head = [0u8; BLOCK];
        let header = match generation.file.read_exact_at(&mut head, 0) {
            Ok(()) => BitmapHeader::decode(&head).map_err(|e| e.0),
            Err(e) => Err(format!("reading its header: {e}")),
        };
        let mut damage = None;
        let file_regions = match header {
            Ok(h) if h.generation == id && h.granularity == granularity => {
                h.covered.div_ceil(u64::from(granularity))
            }
            Ok(_) => {
                damage = Some("its header names another generation or granularity".to_string());
                0
            }
            Err(e) => {
                damage = Some(e);
                0
            }
        };
        if file_regions < regions && damage.is_none() {
            damage = Some("the image grew since it was written".into());
        }
        let file_len = generation.file.metadata().map_or(0, |m| m.len());
        let mut block = [0u8; BLOCK];
        let mut next_data = 0;
        for b in 0..blocks_for(regions) {
            let first = b * REGIONS_PER_BLOCK;
            let end = ((b + 1) * REGIONS_PER_BLOCK).min(regions);
            let at = block_offset(b);
            if next_data < at {
                next_data = data_at_or_after(&generation.file, at);
            }
            // A hole inside the file is a block never written: zeroes, without reading them.
            let hole = next_data >= at + BLOCK as u64 && at + BLOCK as u64 <= file_len;
            let readable = first < file_regions
                && (hole || generation.file.read_exact_at(&mut block, at).is_ok());
            if hole {
                block.fill(0);
            }
            match decode_block(&block, id, b).filter(|_| readable) {
                Some(words) => {
                    for (k, w) in words.iter().enumerate() {
                        generation
                            .wanted
                            .or_word(b as usize * WORDS_PER_BLOCK + k, *w);
                    }
                    // Past what the file covered: dirty (the image grew).
                    if end > file_regions {
                        generation.wanted.set(file_regions.max(first), end);
                    }
                }
                None => {
                    if damage.is_none() {
                        damage = Some(format!("bitmap block {b} does not verify"));
                    }
                    generation.wanted.set(first, end);
                }
            }
        }
        for k in 0..generation.wanted.word_count() {
            generation.durable.or_word(k, generation.wanted.word(k));
        }
        if damage.is_some() {
            generation.write_all()?;
        }
        Ok((generation, damage))
    }

    /// Regions of `len` image bytes at `offset` (rounded outwards, clipped to the covered
    /// size): `first..end`.
    fn regions(&self, offset: u64, len: u64) -> Option<(u64, u64)> {
        if len == 0 || offset >= self.covered {
            return None;
        }
        let end = offset.saturating_add(len).min(self.covered);
        Some((offset >> self.shift, ((end - 1) >> self.shift) + 1))
    }

    /// The image bytes it covers.
    pub(crate) fn covered(&self) -> u64 {
        self.covered
    }

    pub(crate) fn is_durable(&self, offset: u64, len: u64) -> bool {
        self.regions(offset, len)
            .is_none_or(|(first, end)| self.durable.all_set(first, end))
    }

    /// Sets the wanted bits of the range; returns the bitmap blocks that hold them.
    pub(crate) fn want(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        match self.regions(offset, len) {
            Some((first, end)) => {
                self.wanted.set(first, end);
                first / REGIONS_PER_BLOCK..(end - 1) / REGIONS_PER_BLOCK + 1
            }
            None => 0..0,
        }
    }

    /// Every region wanted (a change of every byte: a reencryption).
    pub(crate) fn want_all(&self) -> std::ops::Range<u64> {
        self.wanted.set(0, self.wanted.regions);
        0..blocks_for(self.wanted.regions)
    }

    /// Writes `blocks` from the wanted bits, makes them durable (fdatasync), and only then
    /// counts what they hold as durable.
    pub(crate) fn flush_blocks(&self, blocks: &[u64]) -> Result<(), CheckpointError> {
        let mut buf = [0u8; BLOCK];
        let mut written = Vec::with_capacity(blocks.len());
        for &b in blocks {
            let words = self.block_words(b);
            encode_block(&words, self.id, b, &mut buf);
            self.file
                .write_all_at(&buf, block_offset(b))
                .map_err(|e| CheckpointError::io("writing", &self.path, e))?;
            written.push((b, words));
        }
        self.file
            .sync_data()
            .map_err(|e| CheckpointError::io("syncing", &self.path, e))?;
        for (b, words) in written {
            for (k, w) in words.iter().enumerate() {
                self.durable.or_word(b as usize * WORDS_PER_BLOCK + k, *w);
            }
        }
        Ok(())
    }

    fn block_words(&self, b: u64) -> [u64; WORDS_PER_BLOCK] {
        let mut words = [0u64; WORDS_PER_BLOCK];
        for (k, w) in words.iter_mut().enumerate() {
            *w = self.wanted.word(b as usize * WORDS_PER_BLOCK + k);
        }
        words
    }

    /// The header, the file's length (its blocks holes: no region changed), then fsync.
    fn write_header(&self) -> Result<(), CheckpointError> {
        let header = BitmapHeader {
            granularity: 1 << self.shift,
            covered: self.covered,
            generation: self.id,
        };
        self.file
            .set_len(block_offset(blocks_for(self.wanted.regions)))
            .and_then(|()| self.file.write_all_at(&header.encode(), 0))
            .and_then(|()| self.file.sync_all())
            .map_err(|e| CheckpointError::io("writing", &self.path, e))
    }

    /// The header and every block, then fsync.
    fn write_all(&self) -> Result<(), CheckpointError> {
        let header = BitmapHeader {
            granularity: 1 << self.shift,
            covered: self.covered,
            generation: self.id,
        };
        let blocks = blocks_for(self.wanted.regions);
        self.file
            .set_len(block_offset(blocks))
            .and_then(|()| self.file.write_all_at(&header.encode(), 0))
            .map_err(|e| CheckpointError::io("writing", &self.path, e))?;
        let all: Vec<u64> = (0..blocks).collect();
        self.flush_blocks(&all)?;
        self.file
            .sync_all()
            .map_err(|e| CheckpointError::io("syncing", &self.path, e))
    }

    /// Adds every wanted bit of `other` (a younger checkpoint removed: what changed since it
    /// also changed since this one), durably.
    pub(crate) fn absorb(&self, other: &Generation) -> Result<(), CheckpointError> {
        let mut changed = Vec::new();
        let words = self.wanted.word_count().min(other.wanted.word_count());
        for k in 0..words {
            let theirs = other.wanted.word(k);
            if theirs & !self.wanted.word(k) != 0 {
                self.wanted.or_word(k, theirs);
                let b = (k / WORDS_PER_BLOCK) as u64;
                if changed.last() != Some(&b) {
                    changed.push(b);
                }
            }
        }
        self.flush_blocks(&changed)
    }

    pub(crate) fn remove_file(&self) -> Result<(), CheckpointError> {
        std::fs::remove_file(&self.path).map_err(|e| CheckpointError::io("removing", &self.path, e))
    }
}
