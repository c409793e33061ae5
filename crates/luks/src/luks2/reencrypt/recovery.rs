//! Crash recovery of an interrupted hotzone, as cryptsetup does it on its next run: with
//! `checksum`, each block whose hash still matches the stored one holds old ciphertext and is
//! rewritten, the others are new already; with `journal`, the whole hotzone is rewritten from
//! the old ciphertext saved in the keyslot area. Until recovery writes, reads use the same
//! classification, so a read-only open returns the right data.
use super::layout::{self, KeyRole, SegmentExtent};
use super::session::Reencryption;
use super::Resilience;
use crate::{LuksError, Result};
use cryptblk_crypto::Direction;

/// Which blocks of an interrupted hotzone still hold old ciphertext (read-only view before
/// recovery has rewritten them).
#[derive(Debug, Clone)]
pub(super) struct StaleBlocks {
    pub(super) start: u64,
    pub(super) block: u64,
    pub(super) old: Vec<bool>,
    /// Resilience `journal`: the old ciphertext of the whole hotzone is at this image offset
    /// (the reencrypt keyslot area), whatever the hotzone itself holds now.
    pub(super) journal: Option<u64>,
}

fn unsupported(what: &'static str, name: &str, hint: &str) -> LuksError {
    LuksError::Unsupported {
        what,
        name: name.to_string(),
        hint: hint.to_string(),
    }
}

impl Reencryption<'_> {
    /// Sort an interrupted hotzone's blocks into old and new by their stored checksums.
    pub(super) fn classify_hotzone(&self, hot: &SegmentExtent) -> Result<StaleBlocks> {
        if self.state.resilience == Resilience::Journal {
            let block = self.alignment();
            if hot.len > self.state.area_size || !hot.len.is_multiple_of(block) {
                return Err(LuksError::Corrupt(format!(
                    "hotzone of {} bytes does not fit the {}-byte journal in whole {block}-byte sectors",
                    hot.len, self.state.area_size
                )));
            }
            return Ok(StaleBlocks {
                start: hot.logical_start,
                block,
                old: vec![true; (hot.len / block) as usize],
                journal: Some(self.state.area_offset),
            });
        }
        let Some((hash, block)) = self.checksum_params() else {
            return Err(unsupported(
                "recovery of an interrupted hotzone with resilience",
                self.state.resilience.name(),
                "only checksum and journal hotzones can be recovered (with `none` the interrupted hotzone is lost, as in cryptsetup)",
            ));
        };
        if !hot.len.is_multiple_of(block) {
            return Err(LuksError::Corrupt(format!(
                "hotzone of {} bytes is not whole {block}-byte checksum blocks",
                hot.len
            )));
        }
        let count = (hot.len / block) as usize;
        let hlen = hash.digest_len();
        let need = (count as u64) * hlen as u64;
        if need > self.state.area_size {
            return Err(LuksError::Corrupt(format!(
                "hotzone needs {need} bytes of checksums, the area holds {}",
                self.state.area_size
            )));
        }
        let mut sums = vec![0u8; need as usize];
        crate::io::read_at(
            self.file,
            self.state.area_offset,
            &mut sums,
            "reencryption checksums",
        )?;
        let mut old = Vec::with_capacity(count);
        let mut buf = vec![0u8; block as usize];
        for i in 0..count {
            crate::io::read_at(
                self.file,
                hot.device_offset + i as u64 * block,
                &mut buf,
                "hotzone",
            )?;
            let got = hash.digest(&[&buf]);
            old.push(got[..] == sums[i * hlen..(i + 1) * hlen]);
        }
        Ok(StaleBlocks {
            start: hot.logical_start,
            block,
            old,
            journal: None,
        })
    }

    /// Put an interrupted hotzone right as cryptsetup does: rewrite its blocks that still
    /// hold old ciphertext, then commit the boundary past it.
    pub fn recover(&mut self) -> Result<()> {
        let Some(stale) = self.stale.clone() else {
            return Ok(());
        };
        self.ensure_forward_reencrypt()?;
        let mut buf = vec![0u8; stale.block as usize];
        let data_start = self
            .extents()?
            .iter()
            .find(|e| e.in_reencryption)
            .map(|e| e.device_offset - e.logical_start);
        let base = data_start.ok_or_else(|| LuksError::Corrupt("hotzone vanished".into()))?;
        for (i, _) in stale.old.iter().enumerate().filter(|(_, o)| **o) {
            let pos = stale.start + i as u64 * stale.block;
            let from = match stale.journal {
                Some(journal) => journal + (pos - stale.start),
                None => base + pos,
            };
            crate::io::read_at(self.file, from, &mut buf, "hotzone block")?;
            self.crypt(KeyRole::Old, Direction::Decrypt, pos, &mut buf)?;
            self.crypt(KeyRole::New, Direction::Encrypt, pos, &mut buf)?;
            self.file.write_all_at(&buf, base + pos)?;
        }
        self.file.sync_data()?;
        let done = stale.start + stale.old.len() as u64 * stale.block;
        let total = self.device_size()?;
        let mut meta = self.hdr.meta.clone();
        let post = layout::post_segments(&meta, &self.state, total, done)?;
        layout::install_segments(&mut meta, &self.state, post)?;
        self.commit_meta(meta)?;
        self.stale = None;
        Ok(())
    }
}
