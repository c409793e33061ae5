//! Ending a reencryption the way cryptsetup does: one commit that leaves a plain LUKS2 header
//! (the new segment, the new key's keyslots and digest), then wiping the old key's keyslots.
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
        if super::decrypt::is_decrypt_datashift(&self.state) {
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
        fin.size = SegmentSize::Dynamic;
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
        for a in areas {
            crate::io::zero_range(self.file, a.offset, a.size)?;
        }
        self.file.sync_data()?;
        Ok(removed)
    }
}
