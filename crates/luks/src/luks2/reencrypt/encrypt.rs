//! Encrypting a plaintext image in place, as `cryptsetup reencrypt --encrypt
//! --reduce-device-size R` does it (mode `encrypt`, direction `backward`, resilience
//! `datashift`):
//!
//! - the header takes the first `S = R / 2` bytes, so the data moves `S` bytes up and the
//!   volume keeps `D = file - R` bytes of the plaintext (the last `R` bytes are given up);
//! - init copies the first `S` bytes of plaintext (which the header will overwrite) to the
//!   end of the file (`backup-moved-segment`), then writes the header in one go;
//! - hotzones run from the end to the start: each is read as plaintext, the metadata flags
//!   it `in-reencryption`, it is encrypted to `S` bytes further up and the boundary moves
//!   down. A hotzone is at most `S` bytes (cryptsetup's size; `step(max_len)` takes less when
//!   asked, so a served disk's requests wait for small hotzones only), so its source and
//!   destination never overlap and after a crash the flagged hotzone is simply encrypted
//!   again from its (intact) source, whatever its size (cryptsetup recovers a flagged hotzone
//!   by the size of its segment, and computes the next one from what is left, so it can take
//!   over from any commit);
//! - the last hotzone (volume offset 0) reads the moved copy, whole: cryptsetup refuses to
//!   resume once the plaintext left is less than `S` while other segments are live, so the
//!   part in place is finished first and the moved part never split. Once every byte is
//!   encrypted the moved copy is overwritten with random bytes.
//!
//! cryptsetup then lets the volume run to the end of the image (its last segment becomes
//! `dynamic`), `S` bytes more than during the encryption. A disk served while it is encrypted
//! must keep its size instead ([`Reencryption::keep_volume_size`]): the daemon grows the image
//! by `R` before `encrypt_init`, the volume stays `N` = image - `R` bytes throughout, and the
//! finished image is truncated to the data offset plus `N`.
//!
//! The init step is `encrypt_init.rs`; this file runs an encryption under way: the volume
//! size a served disk keeps, the next hotzone, its source and its commit.

use super::layout::{self, KeyRole};
use super::session::{Reencryption, StepReport};
use super::{unsupported, ReencryptDirection, ReencryptMode, Resilience, FLAG_IN_REENCRYPTION};
use crate::luks2::json::{parse_u64, Segment, SegmentSize};
use crate::{LuksError, Result};
use cryptblk_crypto::{Direction, SecretKey};
use serde_json::Value;
use std::ops::Range;
use zeroize::Zeroizing;

impl Reencryption<'_> {
    fn shift(&self) -> u64 {
        match self.state.resilience {
            Resilience::Datashift { shift } => shift,
            _ => 0,
        }
    }

    /// Keep the volume at its size during the encryption, `N`, to the end, instead of
    /// letting it grow by the shift at the last hotzone as cryptsetup does: the last
    /// hotzone's merged segment stays fixed at `N`, `finish` keeps it so and truncates the
    /// image to the data offset plus `N` (the tail held the moved copy, wiped by then).
    ///
    /// For a disk served while it is encrypted, whose guest must not see its size change.
    /// The choice is not stored in the header (cryptsetup would not keep it): call this on
    /// every `Reencryption` of such a disk before `recover` or `step`, since the recovery of
    /// an interrupted last hotzone commits the merged segment too; once a last hotzone has
    /// committed a `dynamic` segment the volume already runs to the image's end, and stays
    /// so. A forward key-to-key reencryption keeps its size anyway (nothing to do); any other
    /// layout (a decryption's volume grows by design) is refused.
    pub fn keep_volume_size(&mut self) -> Result<()> {
        if self.state.is_encrypt_datashift() {
            self.keep_size = true;
            return Ok(());
        }
        if self.state.mode == ReencryptMode::Reencrypt
            && self.state.direction == ReencryptDirection::Forward
            && self.state.segment_moved.is_none()
        {
            return Ok(());
        }
        Err(unsupported(
            "fixed volume size",
            self.state.mode.name(),
            "the volume keeps its size only in an in-place encryption (encrypt, backward, datashift) or a forward key-to-key reencryption",
        ))
    }

    /// The fixed size `finish` gives the final segment, if any: an encryption's last hotzone
    /// left a single segment, fixed at the volume's size when it was kept (cryptsetup's is
    /// always `dynamic`), and finishing keeps what that commit said. So a session that did
    /// not ask to keep the size after a crash there does not grow the volume, and one that
    /// asks too late (the segment is `dynamic`) does not shrink it.
    pub(super) fn encrypt_final_size(&self) -> Option<u64> {
        if !self.state.is_encrypt_datashift() {
            return None;
        }
        match self.live_segments().as_slice() {
            [only] if only.kind == "crypt" => match only.size {
                SegmentSize::Fixed(n) => Some(n),
                SegmentSize::Dynamic => None,
            },
            _ => None,
        }
    }

    pub(super) fn backup(&self, id: &Option<String>) -> Result<Segment> {
        id.as_ref()
            .and_then(|id| self.hdr.meta.segments.get(id))
            .cloned()
            .ok_or_else(|| LuksError::Corrupt("a backup segment vanished".into()))
    }

    pub(super) fn live_segments(&self) -> Vec<Segment> {
        let mut live: Vec<(u64, Segment)> = self
            .hdr
            .meta
            .segments
            .iter()
            .filter(|(_, s)| !s.is_backup())
            .filter_map(|(id, s)| parse_u64(id).map(|n| (n, s.clone())))
            .collect();
        live.sort_by_key(|(n, _)| *n);
        live.into_iter().map(|(_, s)| s).collect()
    }

    /// Bytes of the volume already encrypted (the crypt segments at its end).
    pub(super) fn encrypt_done_bytes(&self) -> Result<u64> {
        Ok(self
            .extents()?
            .iter()
            .filter(|e| {
                !e.in_reencryption && matches!(e.cipher, layout::ExtentCipher::Crypt { .. })
            })
            .map(|e| e.len)
            .sum())
    }

    /// The volume's size while it is encrypted (the plaintext kept: the backup-previous
    /// segment's size).
    pub(super) fn encrypt_total(&self) -> Result<u64> {
        self.backup(&Some(self.state.segment_old.clone()))
            .and_then(|s| layout::fixed(&s))
    }

    /// Where the next hotzone of at most `max_len` bytes (already aligned) lies: its volume
    /// offset and length, `None` once every byte is encrypted. Mirrors cryptsetup's
    /// `reencrypt_offset_backward_moved`, with the length capped: the top of the plaintext
    /// still in place, at most the shift (source and destination must not overlap); then the
    /// moved part, whole. Assumes no hotzone is flagged (recovery runs first).
    fn encrypt_next(&self, max_len: u64) -> Result<Option<(u64, u64)>> {
        let shift = self.shift();
        let live = self.live_segments();
        let linear_len: u64 = live
            .iter()
            .filter(|s| s.kind == "linear")
            .map(layout::fixed)
            .sum::<Result<u64>>()?;
        if linear_len == 0 {
            return Ok(None);
        }
        if live.len() == 1 {
            // Less plaintext than the shift: all of it was moved, one hotzone.
            return Ok(Some((0, linear_len)));
        }
        // The first live segment is the moved part (volume [0, shift)); the rest of the
        // plaintext is in place right after it.
        let in_place = linear_len.checked_sub(shift).ok_or_else(|| {
            unsupported(
                "encryption layout",
                "plaintext shorter than the data shift",
                "finish with `cryptsetup reencrypt --resume-only`",
            )
        })?;
        if in_place == 0 {
            return Ok(Some((0, shift)));
        }
        let len = in_place.min(shift).min(max_len);
        Ok(Some((shift + in_place - len, len)))
    }

    /// `max_len` rounded down to the alignment; an error when nothing is left of it.
    fn encrypt_limit(&self, max_len: u64) -> Result<u64> {
        let align = self.alignment();
        match max_len - max_len % align {
            0 => Err(LuksError::InvalidArgument(format!(
                "hotzone size {max_len} is below the {align}-byte alignment"
            ))),
            n => Ok(n),
        }
    }

    /// The volume range the next encryption step rewrites (see `next_hotzone`).
    pub(super) fn encrypt_next_range(&self, max_len: u64) -> Result<Option<Range<u64>>> {
        let limit = self.encrypt_limit(max_len)?;
        Ok(self
            .encrypt_next(limit)?
            .map(|(offset, len)| offset..offset + len))
    }

    /// Encrypt the next hotzone: the top `min(max_len, shift)` bytes (aligned) of the
    /// plaintext in place, or, once that is done, the moved part whole. A hotzone a crash
    /// interrupted is encrypted again first.
    pub(super) fn step_encrypt(&mut self, max_len: u64) -> Result<StepReport> {
        let limit = self.encrypt_limit(max_len)?;
        if self.is_interrupted() {
            self.recover_datashift()?;
        }
        let total = self.encrypt_total()?;
        let Some((offset, len)) = self.encrypt_next(limit)? else {
            return Ok(StepReport { done: total, total });
        };
        let live = self.live_segments();
        // The hotzone is the top of the last linear segment: shrink that one below it.
        let sg = live
            .iter()
            .rposition(|s| s.kind == "linear")
            .unwrap_or_default();
        let mut hot: Vec<Segment> = live[..sg].to_vec();
        let last = layout::fixed(&live[sg])?;
        if last > len {
            let mut shrunk = live[sg].clone();
            shrunk.size = SegmentSize::Fixed(last - len);
            hot.push(shrunk);
        }
        let fin = self.backup(&Some(self.state.segment_new.clone()))?;
        let mut enc = fin.clone();
        enc.offset = fin.offset + offset;
        enc.size = SegmentSize::Fixed(len);
        enc.iv_tweak = Some(offset / 512);
        enc.extra
            .insert("flags".into(), Value::from(vec![FLAG_IN_REENCRYPTION]));
        hot.push(enc);
        if let Some(c) = live.iter().find(|s| s.kind == "crypt") {
            hot.push(c.clone());
        }
        self.install(hot)?;
        self.encrypt_hotzone()?;
        Ok(StepReport {
            done: self.encrypt_done_bytes()?.min(total),
            total,
        })
    }

    /// A crash interrupted the flagged hotzone: its plaintext source is intact, so encrypt it
    /// again and commit the boundary past it (cryptsetup's datashift recovery).
    pub(super) fn recover_datashift(&mut self) -> Result<()> {
        self.encrypt_hotzone()
    }

    /// Where the plaintext of a hotzone stored at `offset` is read from: the moved copy for
    /// the first one (volume offset 0), `shift` bytes below it otherwise.
    fn hotzone_source(&self, first: bool, offset: u64) -> Result<u64> {
        if first {
            return Ok(self.backup(&self.state.segment_moved.clone())?.offset);
        }
        offset
            .checked_sub(self.shift())
            .ok_or_else(|| LuksError::Corrupt("the hotzone's source lies before the image".into()))
    }

    /// The plaintext source of the flagged hotzone `e` (an extent of the live segments).
    pub(super) fn encrypt_hotzone_source(&self, e: &layout::SegmentExtent) -> Result<u64> {
        self.hotzone_source(e.logical_start == 0, e.device_offset)
    }

    /// Encrypt the hotzone the live segments flag, then commit the segments after it.
    fn encrypt_hotzone(&mut self) -> Result<()> {
        let hot = self.live_segments();
        let r = hot
            .iter()
            .position(|s| s.flags().contains(&FLAG_IN_REENCRYPTION))
            .ok_or_else(|| LuksError::Corrupt("no hotzone segment".into()))?;
        let fin = self.backup(&Some(self.state.segment_new.clone()))?;
        let len = layout::fixed(&hot[r])?;
        let offset = hot[r].offset.checked_sub(fin.offset).ok_or_else(|| {
            LuksError::Corrupt("the hotzone lies before the new data offset".into())
        })?;
        let source = self.hotzone_source(r == 0, hot[r].offset)?;
        let mut buf = Zeroizing::new(vec![0u8; len as usize]);
        crate::io::read_at(self.data, source, &mut buf, "plaintext hotzone")?;
        self.crypt(KeyRole::New, Direction::Encrypt, offset, &mut buf)?;
        self.data.write_all_at(&buf, hot[r].offset)?;
        self.data.sync_data()?;

        // cryptsetup's _enc_create_segments_shift_after.
        let mut post: Vec<Segment> = hot[..r].to_vec();
        let mut merged = match hot.get(r + 1) {
            Some(after) => {
                let mut m = after.clone();
                m.offset = fin.offset + offset;
                m.iv_tweak = Some(offset / 512);
                m.size = SegmentSize::Fixed(layout::fixed(after).unwrap_or(0) + len);
                m
            }
            None => {
                let mut m = hot[r].clone();
                m.extra.remove("flags");
                m
            }
        };
        if r == 0 {
            // The last hotzone: cryptsetup lets the volume run to the image's end from here
            // (`dynamic`), which takes in the moved copy's `S` bytes. Keeping the size
            // leaves the merged segment at the volume's size, so no commit ever shows a
            // served disk a larger volume.
            if !self.keep_size {
                merged.size = SegmentSize::Dynamic;
            } else if layout::fixed(&merged)? != self.encrypt_total()? {
                return Err(LuksError::Corrupt(format!(
                    "the encrypted segments add up to {:?} bytes, the volume has {}",
                    merged.size,
                    self.encrypt_total()?
                )));
            }
        }
        post.push(merged);
        self.install(post)
    }

    fn install(&mut self, live: Vec<Segment>) -> Result<()> {
        let mut meta = self.hdr.meta.clone();
        let roles = live
            .into_iter()
            .map(|s| {
                let role = if s.kind == "crypt" {
                    KeyRole::New
                } else {
                    KeyRole::Old
                };
                (s, role)
            })
            .collect();
        layout::install_segments(&mut meta, &self.state, roles)?;
        self.commit_meta(meta)
    }

    /// Overwrite the plaintext copy the encryption left at the end with random bytes.
    pub(super) fn wipe_moved_segment(&self) -> Result<()> {
        let Some(moved) = self
            .state
            .segment_moved
            .as_ref()
            .and_then(|id| self.hdr.meta.segments.get(id))
        else {
            return Ok(());
        };
        let len = layout::fixed(moved)?;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(1 << 20);
            let noise = SecretKey::random(n as usize)?;
            self.data
                .write_all_at(noise.as_bytes(), moved.offset + done)?;
            done += n;
        }
        self.data.sync_data()?;
        Ok(())
    }
}
