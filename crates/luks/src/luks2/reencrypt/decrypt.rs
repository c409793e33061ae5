//! Decrypting an image in place to a detached header, as `cryptsetup reencrypt --decrypt
//! --header FILE` (2.7 and later) does it: mode `decrypt`, direction `forward`, resilience
//! `datashift-checksum` (or `datashift-journal`, with `--resilience journal`), requirement
//! `online-reencrypt-v3`.
//!
//! Layout, with `D` the old data offset (the header and keyslots area at the image's head)
//! and `M` = `moved_len` = min(D, 20 MiB, the volume) unless `--hotzone-size` says less:
//!
//! - the header goes to FILE (the whole header and keyslots area, as `luksHeaderBackup`
//!   writes it); its segments then describe the image from offset 0 (a detached header,
//!   `Luks2Header::read_detached`), the image's LUKS signatures are wiped;
//! - init copies the first `M` bytes of ciphertext (at `D`) to offset 0 and commits, in one
//!   header write, the live segments `0` crypt @0 len M (iv 0) and `1` crypt @D+M dynamic
//!   (iv M/512), the backups `backup-moved-segment` (crypt @0 len M), `backup-previous`
//!   (crypt @D dynamic) and `backup-final` (linear @0 dynamic), and a `reencrypt` keyslot
//!   whose area (the largest free gap, it holds checksums) has `hash`, `sector_size` and
//!   `shift_size` = D;
//! - hotzones of `D` bytes start at volume offset M and go forward: the ciphertext of
//!   volume offset L is at L + D, its plaintext goes to L, so source and destination never
//!   overlap and a crash is put right by doing the flagged hotzone again from its source.
//!   Hot segments: `[crypt @0 M][linear @M len L-M][linear @L len D, in-reencryption]
//!   [crypt @D+L+D dynamic, iv (L+D)/512]` (the second only once `L > M`, the last only
//!   before the end); post segments merge the hotzone into the linear one;
//! - once the boundary reaches the end, the moved segment (volume 0..M, ciphertext at 0) is
//!   decrypted in place, protected by a checksum of each `sector_size` block of its
//!   ciphertext stored in the keyslot area before the hot segments
//!   (`[linear @0 len M, in-reencryption][linear @M dynamic]`) are committed; after a crash a
//!   block whose hash still matches is ciphertext, the others are plaintext already. With
//!   `datashift-journal` the keyslot area holds the moved segment's ciphertext instead, and
//!   recovery decrypts all of it from there;
//! - finish: the last D bytes of the image (old ciphertext of data already decrypted) are
//!   overwritten with random bytes; the header keeps one `linear @0 dynamic` segment and no
//!   keyslots, digests or requirement. The plaintext volume is the image minus its last D
//!   bytes.
//!
//! The reencryption digest is the v2 one with version byte 3 (`digest.rs`); v3 only makes
//! cryptsetup before 2.7 refuse the image.
//!
//! Progress is the plaintext below the boundary; the volume is the image minus D
//! (`decrypt_total`), although the last linear segment runs to the image's end.
use super::checksums::block_checksums;
use super::layout::{self, ExtentCipher, KeyRole, SegmentExtent};
use super::session::{Reencryption, StepReport};
use super::stale::StaleBlocks;
use super::{Resilience, FLAG_IN_REENCRYPTION};
use crate::luks2::json::Segment;
use crate::{HashAlg, LuksError, Result};
use cryptblk_crypto::{Direction, SecretKey};
use zeroize::Zeroizing;

/// How the moved segment, decrypted in place, survives a crash.
#[derive(Debug, Clone, Copy)]
enum MovedProtection {
    /// A hash of each `block` bytes of its ciphertext in the keyslot area.
    Checksum { hash: HashAlg, block: u64 },
    /// Its ciphertext itself in the keyslot area.
    Journal,
}

impl Reencryption<'_> {
    /// The data shift and how the moved segment is protected.
    fn decrypt_params(&self) -> Result<(u64, MovedProtection)> {
        match self.state.resilience {
            Resilience::DatashiftChecksum {
                shift,
                hash,
                block_size,
            } => Ok((
                shift,
                MovedProtection::Checksum {
                    hash,
                    block: u64::from(block_size),
                },
            )),
            Resilience::DatashiftJournal { shift } => Ok((shift, MovedProtection::Journal)),
            _ => Err(corrupt("not a decryption with a data shift")),
        }
    }

    /// The plaintext volume: the old data segment's bytes, `shift` fewer than the image (the
    /// last live segment runs to the image's end once it is plaintext, over stale ciphertext).
    pub(super) fn decrypt_total(&self) -> Result<u64> {
        let (shift, ..) = self.decrypt_params()?;
        let old = self.backup(&Some(self.state.segment_old.clone()))?;
        let sector = u64::from(old.sector_size.unwrap_or(512));
        let len = self.data_len()?;
        let avail = len
            .checked_sub(old.offset)
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                LuksError::Truncated(format!(
                    "the image ({len} bytes) ends before the old data offset {}",
                    old.offset
                ))
            })?;
        if old.offset != shift {
            return Err(corrupt(
                "the data shift differs from the old data offset (cryptsetup shifts by it)",
            ));
        }
        Ok(avail - avail % sector)
    }

    /// Bytes of the volume already plaintext (live linear segments, up to the volume's end).
    pub(super) fn decrypt_done_bytes(&self) -> Result<u64> {
        let total = self.decrypt_total()?;
        Ok(self
            .extents()?
            .iter()
            .filter(|e| !e.in_reencryption && e.cipher == ExtentCipher::Plain)
            .map(|e| e.len.min(total.saturating_sub(e.logical_start)))
            .sum())
    }

    /// Read-only view of a shifted hotzone a crash interrupted: its source is intact, `shift`
    /// bytes further up, whatever the destination holds.
    pub(super) fn read_shifted_hotzone(
        &self,
        e: &SegmentExtent,
        from: u64,
        part: &mut [u8],
    ) -> Result<()> {
        let (shift, ..) = self.decrypt_params()?;
        let at = e.device_offset + (from - e.logical_start) + shift;
        crate::io::read_at(self.data, at, part, "interrupted hotzone's source")?;
        self.crypt(KeyRole::Old, Direction::Decrypt, from, part)
    }

    /// Decrypt the next hotzone: `shift` bytes from the boundary, or the moved segment once
    /// the rest is plaintext (cryptsetup's reencrypt_offset_forward_moved).
    pub(super) fn step_decrypt(&mut self) -> Result<StepReport> {
        if self.is_interrupted() {
            self.recover_decrypt()?;
        }
        let total = self.decrypt_total()?;
        let (shift, ..) = self.decrypt_params()?;
        let live = self.live_segments();
        if let Some(last_crypt) = live.iter().rposition(|s| s.kind == "crypt") {
            if last_crypt == 0 {
                self.decrypt_moved(&live)?;
            } else {
                let offset = live[last_crypt]
                    .offset
                    .checked_sub(shift)
                    .filter(|&o| o < total)
                    .ok_or_else(|| corrupt("the old data segment lies outside the volume"))?;
                let len = shift.min(total - offset);
                self.decrypt_shifted(&live, offset, len)?;
            }
        }
        Ok(StepReport {
            done: self.decrypt_done_bytes()?,
            total,
        })
    }

    /// The final layout's segment (linear @0), placed at `start` for `len` bytes.
    fn plain_at(&self, start: u64, len: Option<u64>, hot: bool) -> Result<Segment> {
        let fin = self.backup(&Some(self.state.segment_new.clone()))?;
        Ok(layout::placed(&fin, fin.offset, start, len, hot))
    }

    /// The old layout's segment from volume offset `start` to the end.
    fn cipher_from(&self, start: u64) -> Result<Segment> {
        let old = self.backup(&Some(self.state.segment_old.clone()))?;
        Ok(layout::placed(&old, old.offset, start, None, false))
    }

    /// The segments once `[offset, offset + len)` is plaintext (cryptsetup's
    /// _dec_create_segments_shift_after): the moved segment, the plaintext after it, the old
    /// segment after the hotzone (if any).
    fn shifted_post(
        &self,
        moved: &Segment,
        offset: u64,
        len: u64,
        after: Option<Segment>,
    ) -> Result<Vec<Segment>> {
        let moved_len = layout::fixed(moved)?;
        let progress = offset
            .checked_sub(moved_len)
            .ok_or_else(|| corrupt("a hotzone lies inside the moved segment"))?;
        let plain = self.plain_at(moved_len, after.is_some().then_some(progress + len), false)?;
        let mut post = vec![moved.clone(), plain];
        post.extend(after);
        Ok(post)
    }

    /// One shifted hotzone: the ciphertext of `[offset, offset + len)` lies `shift` bytes
    /// further up; flag the hotzone, decrypt it to its place, commit the boundary past it.
    fn decrypt_shifted(&mut self, live: &[Segment], offset: u64, len: u64) -> Result<()> {
        let (shift, ..) = self.decrypt_params()?;
        let total = self.decrypt_total()?;
        let moved = live[0].clone();
        let moved_len = layout::fixed(&moved)?;
        let progress = offset
            .checked_sub(moved_len)
            .ok_or_else(|| corrupt("a hotzone lies inside the moved segment"))?;
        let mut hot = vec![moved.clone()];
        if progress > 0 {
            hot.push(self.plain_at(moved_len, Some(progress), false)?);
        }
        hot.push(self.plain_at(offset, Some(len), true)?);
        let after = if offset + len < total {
            Some(self.cipher_from(offset + len)?)
        } else {
            None
        };
        hot.extend(after.clone());
        self.install_decrypt(hot)?;

        let mut buf = Zeroizing::new(vec![0u8; len as usize]);
        crate::io::read_at(self.data, offset + shift, &mut buf, "hotzone ciphertext")?;
        self.crypt(KeyRole::Old, Direction::Decrypt, offset, &mut buf)?;
        self.data.write_all_at(&buf, offset)?;
        self.data.sync_data()?;
        let post = self.shifted_post(&moved, offset, len, after)?;
        self.install_decrypt(post)
    }

    /// The last hotzone: the moved segment (volume `[0, M)`, its ciphertext copied to offset
    /// 0 at init) is decrypted in place, so the checksums of its ciphertext blocks go to the
    /// keyslot area before the segments that flag it are committed.
    fn decrypt_moved(&mut self, live: &[Segment]) -> Result<()> {
        let (_, protection) = self.decrypt_params()?;
        let moved = self.backup(&self.state.segment_moved.clone())?;
        let len = layout::fixed(&moved)?;
        let mut hot = vec![self.plain_at(0, Some(len), true)?];
        hot.extend(live.get(1).cloned());
        let mut buf = Zeroizing::new(vec![0u8; len as usize]);
        crate::io::read_at(self.data, moved.offset, &mut buf, "moved segment")?;
        let sums;
        let area: &[u8] = match protection {
            MovedProtection::Checksum { hash, block } => {
                if !len.is_multiple_of(block) {
                    return Err(corrupt("the moved segment is not whole checksum blocks"));
                }
                sums = block_checksums(hash, block as usize, &buf, self.pool.threads());
                &sums
            }
            MovedProtection::Journal => &buf,
        };
        if area.len() as u64 > self.state.area_size {
            return Err(corrupt(
                "the moved segment's protection does not fit the reencryption keyslot area",
            ));
        }
        self.file.write_all_at(area, self.state.area_offset)?;
        self.file.sync_data()?;
        self.install_decrypt(hot)?;
        self.crypt(KeyRole::Old, Direction::Decrypt, 0, &mut buf)?;
        self.data.write_all_at(&buf, moved.offset)?;
        self.data.sync_data()?;
        let all = self.plain_at(0, None, false)?;
        self.install_decrypt(vec![all])
    }

    /// Put the hotzone a crash interrupted right, as cryptsetup does: a shifted one is
    /// decrypted again from its intact source; in the moved one, the blocks whose checksum
    /// still matches are ciphertext and are decrypted, the others are plaintext already (with
    /// a journal, all of it is decrypted from the journal).
    pub(super) fn recover_decrypt(&mut self) -> Result<()> {
        let (shift, ..) = self.decrypt_params()?;
        if self.stale.is_none() {
            // Interrupted in this session: classify the moved hotzone's blocks now.
            if let Some(hot) = self
                .extents()?
                .into_iter()
                .find(|e| e.in_reencryption && e.logical_start == 0)
            {
                self.stale = Some(StaleBlocks::classify(
                    self.file,
                    self.data,
                    &self.state,
                    &hot,
                    self.alignment(),
                )?);
            }
        }
        let live = self.live_segments();
        let r = live
            .iter()
            .position(|s| s.flags().contains(&FLAG_IN_REENCRYPTION))
            .ok_or_else(|| corrupt("no hotzone segment"))?;
        let len = layout::fixed(&live[r])?;
        let offset = live[r].offset;
        if r == 0 {
            let stale = self
                .stale
                .clone()
                .ok_or_else(|| corrupt("the moved hotzone's blocks were not classified"))?;
            let mut buf = Zeroizing::new(vec![0u8; stale.block as usize]);
            for (i, _) in stale.old.iter().enumerate().filter(|(_, o)| **o) {
                let pos = stale.start + i as u64 * stale.block;
                let (io, from) = match stale.journal {
                    Some(journal) => (self.file, journal + (pos - stale.start)),
                    None => (self.data, offset + pos),
                };
                crate::io::read_at(io, from, &mut buf, "moved hotzone block")?;
                self.crypt(KeyRole::Old, Direction::Decrypt, pos, &mut buf)?;
                self.data.write_all_at(&buf, offset + pos)?;
            }
            self.data.sync_data()?;
            let all = self.plain_at(0, None, false)?;
            self.install_decrypt(vec![all])?;
            self.stale = None;
            return Ok(());
        }
        let mut buf = Zeroizing::new(vec![0u8; len as usize]);
        crate::io::read_at(self.data, offset + shift, &mut buf, "hotzone ciphertext")?;
        self.crypt(KeyRole::Old, Direction::Decrypt, offset, &mut buf)?;
        self.data.write_all_at(&buf, offset)?;
        self.data.sync_data()?;
        let post = self.shifted_post(&live[0], offset, len, live.get(r + 1).cloned())?;
        self.install_decrypt(post)
    }

    /// Commit `live` as the live segments: crypt ones are the old key's, as the backups and
    /// the moved segment are.
    fn install_decrypt(&mut self, live: Vec<Segment>) -> Result<()> {
        let mut meta = self.hdr.meta.clone();
        let roles = live
            .into_iter()
            .map(|s| {
                let role = if s.kind == "crypt" {
                    KeyRole::Old
                } else {
                    KeyRole::New
                };
                (s, role)
            })
            .collect();
        layout::install_segments(&mut meta, &self.state, roles)?;
        self.commit_meta(meta)
    }

    /// Overwrite the image's last `shift` bytes (the old ciphertext of the volume's last
    /// bytes, decrypted below them by now) with random bytes.
    pub(super) fn wipe_shifted_tail(&self) -> Result<()> {
        let (shift, ..) = self.decrypt_params()?;
        let len = self.data_len()?;
        let start = len
            .checked_sub(shift)
            .ok_or_else(|| corrupt("the image is smaller than the data shift"))?;
        let mut done = 0;
        while done < shift {
            let n = (shift - done).min(1 << 20);
            let noise = SecretKey::random(n as usize)?;
            self.data.write_all_at(noise.as_bytes(), start + done)?;
            done += n;
        }
        self.data.sync_data()?;
        Ok(())
    }
}

fn corrupt(msg: &str) -> LuksError {
    LuksError::Corrupt(format!("decryption with a data shift: {msg}"))
}
