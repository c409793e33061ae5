//! Crash recovery of an interrupted hotzone, as cryptsetup does it on its next run: the blocks
//! `StaleBlocks` found still holding old ciphertext are rewritten (from the journal with
//! resilience `journal`), then the boundary is committed past the hotzone.
use super::layout;
use super::layout::KeyRole;
use super::session::Reencryption;
use crate::{LuksError, Result};
use cryptblk_crypto::Direction;

impl Reencryption<'_> {
    /// Put an interrupted hotzone right as cryptsetup does: rewrite its blocks that still
    /// hold old ciphertext, then commit the boundary past it.
    pub fn recover(&mut self) -> Result<()> {
        if self.state.is_encrypt_datashift() && self.is_interrupted() {
            return self.recover_datashift();
        }
        if self.state.is_decrypt_datashift() && self.is_interrupted() {
            return self.recover_decrypt();
        }
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
            let (io, from) = match stale.journal {
                Some(journal) => (self.file, journal + (pos - stale.start)),
                None => (self.data, base + pos),
            };
            crate::io::read_at(io, from, &mut buf, "hotzone block")?;
            self.crypt(KeyRole::Old, Direction::Decrypt, pos, &mut buf)?;
            self.crypt(KeyRole::New, Direction::Encrypt, pos, &mut buf)?;
            self.data.write_all_at(&buf, base + pos)?;
        }
        self.data.sync_data()?;
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
