//! One hotzone's rewrite, in cryptsetup's commit order:
//!
//! 1. read the hotzone's old ciphertext;
//! 2. store a hash per block (checksum) or the ciphertext itself (journal) in the reencrypt
//!    keyslot area and commit the "hot" segments, which flag the hotzone ([`Reencryption::flag`]);
//! 3. decrypt, encrypt, write, sync;
//! 4. commit the "post" segments that move the boundary past the hotzone
//!    ([`Reencryption::rewrite_flagged`] does 3 and 4).
//!
//! A crash between 2 and 4 leaves blocks that are old (hash matches) or new (it does not),
//! which recovery sorts out; a journal holds the whole old hotzone. With resilience `none`
//! cryptsetup commits nothing until the end (a crash loses the hotzone), and so does this loop.
use super::layout::{self, KeyRole};
use super::session::{Reencryption, StepReport};
use super::Resilience;
use crate::{LuksError, Result};
use cryptblk_crypto::{Direction, SectorCipher};
use std::ops::Range;
use std::sync::Arc;

/// Where a hotzone lies: `len` bytes from `start` bytes into the volume, at `device_offset`
/// in the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hotzone {
    pub(super) start: u64,
    pub(super) len: u64,
    pub(super) device_offset: u64,
}

/// `len` bytes of `backing`, grown as needed, aligned for a `DirectFile`'s O_DIRECT transfers.
pub(super) fn aligned_hotzone(backing: &mut Vec<u8>, len: u64) -> &mut [u8] {
    let len = len as usize;
    if backing.len() < len + crate::DIRECT_ALIGN {
        backing.resize(len + crate::DIRECT_ALIGN, 0);
    }
    let at = backing.as_ptr().align_offset(crate::DIRECT_ALIGN);
    &mut backing[at..at + len]
}

impl Reencryption<'_> {
    /// Rewrite the next hotzone of at most `max_len` bytes. Returns the progress after it.
    pub fn step(&mut self, max_len: u64) -> Result<StepReport> {
        if self.state.is_encrypt_datashift() {
            return self.step_encrypt(max_len);
        }
        if self.state.is_decrypt_datashift() {
            return self.step_decrypt();
        }
        self.ensure_forward_reencrypt()?;
        if self.stale.is_some() {
            self.recover()?;
        }
        let done = self.done_bytes()?;
        let Some(hz) = self.hotzone_at(done, max_len)? else {
            return Ok(StepReport {
                done,
                total: self.device_size()?,
            });
        };
        // One buffer for every hotzone (a fresh one is mapped and faulted in again each time,
        // which costs more system time than the copy into it), aligned for a `DirectFile`.
        let mut backing = std::mem::take(&mut self.hotzone);
        let buf = aligned_hotzone(&mut backing, hz.len);
        let rewritten = crate::io::read_at(self.data, hz.device_offset, buf, "hotzone")
            .and_then(|()| self.rewrite(hz, buf));
        self.hotzone = backing;
        rewritten
    }

    /// The volume range the next `step(max_len)` rewrites, for a data path to fence off
    /// before stepping (requests touching it wait until the step has returned); `None` once
    /// every byte is done. A forward reencryption's begins at the boundary; an in-place
    /// encryption's is the top of the plaintext still in place, then the moved part whole.
    /// A hotzone a crash interrupted is recovered first (`recover`), which this refuses.
    pub fn next_hotzone(&self, max_len: u64) -> Result<Option<Range<u64>>> {
        if self.is_interrupted() {
            return Err(LuksError::InvalidArgument(
                "a hotzone interrupted by a crash must be recovered first".into(),
            ));
        }
        if self.state.is_encrypt_datashift() {
            return self.encrypt_next_range(max_len);
        }
        self.ensure_forward_reencrypt()?;
        Ok(self
            .hotzone_at(self.done_bytes()?, max_len)?
            .map(|hz| hz.start..hz.start + hz.len))
    }

    /// The hotzone of at most `max_len` bytes that begins `start` bytes into the volume (where
    /// the boundary is, or will be once the hotzones before it are rewritten); `None` at the end.
    pub(super) fn hotzone_at(&self, start: u64, max_len: u64) -> Result<Option<Hotzone>> {
        let total = self.device_size()?;
        if start >= total {
            return Ok(None);
        }
        let align = self.alignment();
        let mut len = max_len.min(total - start);
        len -= len % align;
        if len == 0 {
            return Err(LuksError::InvalidArgument(format!(
                "hotzone size {max_len} is below the {align}-byte alignment"
            )));
        }
        let data_base = self
            .hdr
            .meta
            .segments
            .get(&self.state.segment_new)
            .map(|s| s.offset)
            .unwrap_or(0);
        Ok(Some(Hotzone {
            start,
            len,
            device_offset: data_base + start,
        }))
    }

    /// Rewrite `hz`, the hotzone at the boundary, whose old ciphertext `buf` holds.
    pub(super) fn rewrite(&mut self, hz: Hotzone, buf: &mut [u8]) -> Result<StepReport> {
        self.flag(hz, buf, None)?;
        self.rewrite_flagged(hz, buf)
    }

    /// The first half of a rewrite: make the old ciphertext of `hz` (the hotzone at the
    /// boundary, which `buf` holds) recoverable, with its checksums (`sums`, when the caller
    /// computed them already) or a copy in the journal, and commit the segments that flag it.
    pub(super) fn flag(&mut self, hz: Hotzone, buf: &[u8], sums: Option<Vec<u8>>) -> Result<()> {
        let (done, len) = (hz.start, hz.len);
        if self.hotzone_at(self.done_bytes()?, len)? != Some(hz) || buf.len() as u64 != len {
            return Err(LuksError::InvalidArgument(format!(
                "hotzone {done}+{len} does not begin at the reencryption boundary"
            )));
        }
        let sums = match (&self.state.resilience, sums) {
            (Resilience::Checksum { .. }, Some(sums)) => sums,
            (Resilience::Checksum { .. }, None) => self.checksums(buf)?,
            _ => Vec::new(),
        };
        let area: &[u8] = match &self.state.resilience {
            Resilience::Checksum { .. } => &sums,
            Resilience::Journal => buf,
            _ => return Ok(()),
        };
        if area.len() as u64 > self.state.area_size {
            return Err(LuksError::InvalidArgument(format!(
                "hotzone of {len} bytes needs {} bytes of the {}-byte resilience area",
                area.len(),
                self.state.area_size
            )));
        }
        self.file.write_all_at(area, self.state.area_offset)?;
        self.file.sync_data()?;
        let total = self.device_size()?;
        let mut meta = self.hdr.meta.clone();
        let hot = layout::hot_segments(&meta, &self.state, total, done, len)?;
        layout::install_segments(&mut meta, &self.state, hot)?;
        self.commit_meta(meta)
    }

    /// The checksums the `checksum` resilience stores for a hotzone's old ciphertext.
    fn checksums(&self, old: &[u8]) -> Result<Vec<u8>> {
        let sums = self.checksummer().ok_or_else(|| {
            LuksError::InvalidArgument("this reencryption keeps no checksums".into())
        })?;
        Ok(sums(old))
    }

    /// What computes those checksums, for a thread of its own; `None` without them.
    pub(super) fn checksummer(&self) -> Option<impl Fn(&[u8]) -> Vec<u8> + Send + 'static> {
        let (hash, block) = self.checksum_params()?;
        let threads = self.pool.threads();
        Some(move |old: &[u8]| {
            super::checksums::block_checksums(hash, block as usize, old, threads)
        })
    }

    /// The second half: decrypt, encrypt and write the flagged hotzone, then commit the
    /// segments that move the boundary past it.
    pub(super) fn rewrite_flagged(&mut self, hz: Hotzone, buf: &mut [u8]) -> Result<StepReport> {
        let (done, len) = (hz.start, hz.len);
        let total = self.device_size()?;
        self.crypt(KeyRole::Old, Direction::Decrypt, done, buf)?;
        self.crypt(KeyRole::New, Direction::Encrypt, done, buf)?;
        self.data.write_all_at(buf, hz.device_offset)?;
        let mut meta = self.hdr.meta.clone();
        let post = layout::post_segments(&meta, &self.state, total, done + len)?;
        layout::install_segments(&mut meta, &self.state, post)?;
        if let Resilience::Checksum { .. } | Resilience::Journal = self.state.resilience {
            self.data.sync_data()?;
            self.commit_meta(meta)?;
        } else {
            self.hdr.meta = meta;
            self.reparse()?;
            self.uncommitted = true;
        }
        Ok(StepReport {
            done: done + len,
            total,
        })
    }

    /// Hotzones are whole checksum blocks, or whole sectors of both layouts.
    pub fn alignment(&self) -> u64 {
        match self.checksum_params() {
            Some((_, block)) => block,
            None => {
                let ss = |c: &Option<Arc<dyn SectorCipher>>| {
                    c.as_ref().map_or(512, |c| c.sector_size() as u64)
                };
                ss(&self.old_cipher).max(ss(&self.new_cipher)).max(4096)
            }
        }
    }

    /// The largest hotzone the resilience area allows.
    pub fn max_hotzone(&self) -> u64 {
        match self.checksum_params() {
            Some((hash, block)) => self.state.area_size / hash.digest_len() as u64 * block,
            None if self.state.resilience == Resilience::Journal => self.state.area_size,
            None => u64::MAX,
        }
    }
}
