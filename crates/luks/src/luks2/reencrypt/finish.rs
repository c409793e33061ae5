//! Ending a reencryption the way cryptsetup does: one commit that leaves a plain LUKS2 header
//! (the new segment, the new key's keyslots and digest), then wiping the old key's keyslots.
//! An encryption that kept the volume's size (`keep_volume_size`) commits its final segment at
//! that size, where cryptsetup makes it `dynamic`, cuts the image at the volume's end, and
//! then makes the segment `dynamic` again: the image is then exactly what luksFormat and the
//! data would give (which a later key rotation, for one, requires), and a crash at any point
//! leaves a volume of the size kept.
use super::session::Reencryption;
use crate::luks2::json::SegmentSize;
use crate::{LuksError, Result};

impl Reencryption<'_> {
    /// Once every byte is in the new layout: drop the backups, the reencrypt keyslot, its
    /// digest, the old key's keyslots and digest and the requirement in one commit; then wipe
    /// the old keyslots' areas. Returns the ids of the keyslots removed.
    pub fn finish(&mut self) -> Result<Vec<String>> {
        let total = self.device_size()?;
        if self.done_bytes()? < total {
            return Err(LuksError::InvalidArgument(
                "the reencryption is not complete".into(),
            ));
        }
        if self.uncommitted {
            self.data.sync_data()?;
        }
        // As cryptsetup: the plaintext copy an encryption moved to the end goes first; a
        // decryption's last `shift` bytes (ciphertext of data now plaintext below) likewise.
        if self.state.is_decrypt_datashift() {
            self.wipe_shifted_tail()?;
        } else {
            self.wipe_moved_segment()?;
        }
        let st = self.state.clone();
        let mut meta = self.hdr.meta.clone();
        let mut fin = meta
            .segments
            .get(&st.segment_new)
            .cloned()
            .ok_or_else(|| LuksError::Corrupt("no final segment".into()))?;
        fin.extra.remove("flags");
        let fixed_size = self.encrypt_final_size();
        fin.size = fixed_size.map_or(SegmentSize::Dynamic, SegmentSize::Fixed);
        let data_end = fixed_size.map(|n| fin.offset + n);
        meta.segments = [("0".to_string(), fin)].into_iter().collect();
        let mut removed = vec![st.keyslot.clone()];
        if st.digest_old != st.digest_new {
            if let Some(d) = st.digest_old.as_ref().and_then(|d| meta.digests.remove(d)) {
                removed.extend(d.keyslots);
            }
        }
        meta.digests.remove(&st.digest_reencrypt);
        for d in meta.digests.values_mut() {
            d.segments.clear();
        }
        if let Some(d) = st.digest_new.as_ref().and_then(|d| meta.digests.get_mut(d)) {
            d.segments.push("0".into());
        }
        let mut areas = Vec::new();
        for id in &removed {
            if let Some(k) = meta.keyslots.remove(id) {
                if k.kind == "luks2" {
                    areas.push(k.area);
                }
            }
            for tok in meta.tokens.values_mut() {
                if let Some(list) = tok.get_mut("keyslots").and_then(|v| v.as_array_mut()) {
                    list.retain(|v| v.as_str() != Some(id.as_str()));
                }
            }
        }
        if let Some(req) = meta.config.requirements.as_mut() {
            req.mandatory.retain(|r| !r.starts_with("online-reencrypt"));
            if req.mandatory.is_empty() && req.extra.is_empty() {
                meta.config.requirements = None;
            }
        }
        let before = std::mem::replace(&mut self.hdr.meta, meta);
        if let Err(e) = self.hdr.commit(self.file) {
            self.hdr.meta = before;
            return Err(e);
        }
        self.uncommitted = false;
        // The volume kept its size: what lies past it is the wiped moved copy. A crash before
        // the truncation leaves a longer image whose volume is still the fixed size.
        if let Some(end) = data_end {
            if self.data.size()? > end {
                self.data.set_len(end)?;
                self.data.sync_data()?;
                self.file_len = end;
            }
            if self.data.size()? == end {
                let before = self.hdr.meta.clone();
                if let Some(seg) = self.hdr.meta.segments.get_mut("0") {
                    seg.size = SegmentSize::Dynamic;
                }
                if let Err(e) = self.hdr.commit(self.file) {
                    self.hdr.meta = before;
                    return Err(e);
                }
            }
        }
        for a in areas {
            crate::io::zero_range(self.file, a.offset, a.size)?;
        }
        self.file.sync_data()?;
        Ok(removed)
    }
}
