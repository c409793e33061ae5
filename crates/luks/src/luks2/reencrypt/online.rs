//! What a data path needs to serve a volume while it is re-encrypted in place: both ciphers,
//! where the payload starts, and the boundary between the new and the old segment. An
//! in-place encryption (a plaintext disk encrypted while served) has three extents and data
//! that moves; it is served by `extents()` and `cipher_of`, not by `OnlineSegments`.
use super::session::Reencryption;
use super::{unsupported, ReencryptDirection, ReencryptMode};
use crate::{LuksError, Result};
use cryptblk_crypto::SectorCipher;
use std::sync::Arc;

/// The two segments of a forward key-to-key reencryption without data shift.
pub struct OnlineSegments {
    /// The payload's offset in the container (the same for both segments).
    pub data_offset: u64,
    /// The volume's size.
    pub size: u64,
    /// Bytes of the volume in the new segment (below the boundary).
    pub done: u64,
    pub old: Arc<dyn SectorCipher>,
    pub new: Arc<dyn SectorCipher>,
    /// The new segment's cipher as LUKS2 names it, with its key size in bits.
    pub new_cipher_name: String,
}

impl Reencryption<'_> {
    /// The segments to serve by, for a reencryption a data path can follow: forward, from key
    /// to key, in place, no hotzone left to recover. Anything else is `Unsupported`, naming
    /// what to do instead.
    pub fn online_segments(&self) -> Result<OnlineSegments> {
        self.ensure_servable()?;
        let state = self.state();
        if state.is_encrypt_datashift() {
            return Err(unsupported(
                "online reencryption layout",
                "encrypt",
                "an in-place encryption has more than two segments; serve it by `extents()`",
            ));
        }
        if self.is_interrupted() {
            return Err(LuksError::InvalidArgument(
                "a hotzone interrupted by a crash must be recovered first".into(),
            ));
        }
        let meta = &self.header().meta;
        let seg = |id: &String| {
            meta.segments
                .get(id)
                .ok_or_else(|| LuksError::Corrupt(format!("segment {id} vanished")))
        };
        let (old, new) = (seg(&state.segment_old)?, seg(&state.segment_new)?);
        if old.offset != new.offset
            || old.iv_tweak.unwrap_or(0) != 0
            || new.iv_tweak.unwrap_or(0) != 0
        {
            return Err(unsupported(
                "online reencryption layout",
                "shifted",
                "the old and new segments differ in offset or IV base; finish with `cryptblk reencrypt --resume-only` offline",
            ));
        }
        let missing = || {
            unsupported(
                "reencryption mode",
                state.mode.name(),
                "plaintext segments are not served",
            )
        };
        let key_bits = self.new_key().map_or(0, |k| k.len() * 8);
        let new_cipher_name = format!(
            "{} ({key_bits} bits, {}-byte sectors)",
            new.encryption.as_deref().unwrap_or("?"),
            new.sector_size.unwrap_or(512)
        );
        Ok(OnlineSegments {
            new_cipher_name,
            data_offset: new.offset,
            size: self.device_size()?,
            done: self.done_bytes()?,
            old: self.old_cipher.clone().ok_or_else(missing)?,
            new: self.new_cipher.clone().ok_or_else(missing)?,
        })
    }

    /// Refuse, before anything is written (recovery included), a reencryption no data path
    /// follows. Served are a forward key-to-key reencryption and an in-place encryption in
    /// the layout cryptblk (and cryptsetup) writes: encrypt, backward, datashift, with the
    /// moved part at the image's end (`extents()` describes each of its states). Refused are
    /// decryptions and every other direction or resilience.
    pub fn ensure_servable(&self) -> Result<()> {
        let state = self.state();
        let forward_reencrypt = state.mode == ReencryptMode::Reencrypt
            && state.direction == ReencryptDirection::Forward;
        if !forward_reencrypt && !state.is_encrypt_datashift() {
            return Err(unsupported(
                "online reencryption",
                state.mode.name(),
                "cryptblk serves forward key-to-key reencryptions and in-place encryptions (encrypt, backward, datashift) only; finish this one offline first with `cryptblk reencrypt --resume-only IMAGE` (or cryptsetup's)",
            ));
        }
        Ok(())
    }

    /// The keyslot the passphrase opened (of the old volume key).
    pub fn opened_keyslot(&self) -> Option<usize> {
        self.keyslot
    }
}
