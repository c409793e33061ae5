//! An unlocked reencryption: both keys verified against the metadata, plaintext reads across
//! the old and new segments, crash recovery of an interrupted hotzone (`recovery.rs`), and the
//! loop that rewrites one hotzone after another (`hotzone.rs`, `read_ahead.rs`).
use super::layout::{self, ExtentCipher, KeyRole, SegmentExtent};
use super::stale::StaleBlocks;
use super::{digest, unsupported, ReencryptDirection, ReencryptMode, ReencryptState, Resilience};
use crate::io::HeaderIo;
use crate::luks2::json::{Metadata, Segment};
use crate::luks2::Luks2Header;
use crate::{HashAlg, KnownKey, LuksError, Result, UnlockOptions, Unlocker};
use cryptblk_crypto::{default_engine_for, CryptoPool, Direction, SecretKey, SectorCipher};
use std::sync::Arc;

/// Progress after a step: bytes of the volume in the new layout, and the volume's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepReport {
    pub done: u64,
    pub total: u64,
}

pub struct Reencryption<'f> {
    /// The header and its keyslots area (with the reencrypt keyslot's checksums or journal).
    pub(super) file: &'f dyn HeaderIo,
    /// The data segments: the same device as `file`, or a separate one for a detached header.
    pub(super) data: &'f dyn HeaderIo,
    pub(super) hdr: Luks2Header,
    pub(super) state: ReencryptState,
    old_key: Option<SecretKey>,
    new_key: Option<SecretKey>,
    pub(super) old_cipher: Option<Arc<dyn SectorCipher>>,
    pub(super) new_cipher: Option<Arc<dyn SectorCipher>>,
    /// The keyslot the passphrase opened for the old key.
    pub(super) keyslot: Option<usize>,
    pub(super) pool: Arc<CryptoPool>,
    /// The data device's length.
    pub(super) file_len: u64,
    pub(super) stale: Option<StaleBlocks>,
    /// Resilience `none`: post segments exist only in memory until the end or a stop.
    pub(super) uncommitted: bool,
    /// The hotzone's buffer, kept between steps.
    pub(super) hotzone: Vec<u8>,
    /// An encryption keeps the volume's size to the end (`keep_volume_size`).
    pub(super) keep_size: bool,
}

fn make_cipher(seg: &Segment, key: &SecretKey) -> Result<Arc<dyn SectorCipher>> {
    let enc = seg.encryption.as_deref().unwrap_or_default();
    let spec = crate::luks2::parse_cipher(enc, key.len())?;
    let cipher = default_engine_for(&spec)?.new_cipher(
        &spec,
        key,
        seg.sector_size.unwrap_or(512) as usize,
    )?;
    Ok(cipher)
}

impl<'f> Reencryption<'f> {
    /// Unlock both volume keys with `passphrase`, verify the reencryption digest, and check the
    /// layout is one cryptblk can read. Nothing is written.
    pub fn open(
        file: &'f dyn HeaderIo,
        hdr: Luks2Header,
        passphrase: &[u8],
        opts: &UnlockOptions,
        keyslot: Option<usize>,
        pool: Arc<CryptoPool>,
    ) -> Result<Self> {
        Self::open_with(
            file,
            hdr,
            Unlocker::Passphrase(passphrase),
            opts,
            keyslot,
            pool,
        )
    }

    /// As `open`, with the volume keys already known instead of a passphrase when `unlocker`
    /// has them (a restarted daemon's; no KDF runs).
    pub fn open_with(
        file: &'f dyn HeaderIo,
        hdr: Luks2Header,
        unlocker: Unlocker<'_>,
        opts: &UnlockOptions,
        keyslot: Option<usize>,
        pool: Arc<CryptoPool>,
    ) -> Result<Self> {
        if hdr.is_detached() {
            return Err(LuksError::InvalidArgument(
                "the header is detached from its data; open it with `open_detached` and the data device".into(),
            ));
        }
        Self::open_on(file, file, hdr, unlocker, opts, keyslot, pool)
    }

    /// As `open`, for a detached header (`Luks2Header::read_detached`): `header` is the file
    /// that holds it (and the keyslots area), `data` the device its segments describe.
    pub fn open_detached(
        header: &'f dyn HeaderIo,
        data: &'f dyn HeaderIo,
        hdr: Luks2Header,
        passphrase: &[u8],
        opts: &UnlockOptions,
        keyslot: Option<usize>,
        pool: Arc<CryptoPool>,
    ) -> Result<Self> {
        if !hdr.is_detached() {
            return Err(LuksError::InvalidArgument(
                "the header was read as attached to its data; read it with `read_detached`".into(),
            ));
        }
        Self::open_on(
            header,
            data,
            hdr,
            Unlocker::Passphrase(passphrase),
            opts,
            keyslot,
            pool,
        )
    }

    fn open_on(
        file: &'f dyn HeaderIo,
        data: &'f dyn HeaderIo,
        hdr: Luks2Header,
        unlocker: Unlocker<'_>,
        opts: &UnlockOptions,
        keyslot: Option<usize>,
        pool: Arc<CryptoPool>,
    ) -> Result<Self> {
        let state = ReencryptState::parse(&hdr.meta)?.ok_or_else(|| {
            LuksError::InvalidArgument(
                "the image is not in reencryption (no online-reencrypt requirement)".into(),
            )
        })?;
        let decrypt_datashift = state.is_decrypt_datashift();
        let datashift = state.is_encrypt_datashift() || decrypt_datashift;
        if !datashift
            && (state.segment_moved.is_some()
                || !matches!(
                    state.resilience,
                    Resilience::None | Resilience::Checksum { .. } | Resilience::Journal
                ))
        {
            return Err(unsupported(
                "reencryption resilience",
                state.resilience.name(),
                "cryptblk moves data only to encrypt a plaintext image (encrypt, backward, datashift) or to decrypt one to a detached header (decrypt, forward, datashift-checksum); finish this one with `cryptsetup reencrypt --resume-only`",
            ));
        }
        let unlock = |d: &Option<String>| -> Result<Option<(Option<usize>, SecretKey)>> {
            match d {
                None => Ok(None),
                Some(id) => {
                    let dg = hdr
                        .meta
                        .digests
                        .get(id)
                        .ok_or_else(|| LuksError::Corrupt(format!("digest {id} vanished")))?;
                    let (slot, k) = crate::luks2::unlock::unlock_digest_with(
                        &hdr, file, unlocker, opts, dg, keyslot,
                    )?;
                    Ok(Some((slot, k)))
                }
            }
        };
        let (opened_slot, old_key) = match unlock(&state.digest_old)? {
            Some((slot, key)) => (slot, Some(key)),
            None => (None, None),
        };
        let new_key = if state.digest_new == state.digest_old {
            old_key
                .as_ref()
                .map(|k| SecretKey::from_slice(k.as_bytes()))
        } else {
            // The new key's keyslot may be a different one than --key-slot names.
            match &state.digest_new {
                None => None,
                Some(id) => {
                    let dg = hdr
                        .meta
                        .digests
                        .get(id)
                        .ok_or_else(|| LuksError::Corrupt(format!("digest {id} vanished")))?;
                    let (_, k) = crate::luks2::unlock::unlock_digest_with(&hdr, file, unlocker, opts, dg, None)
                        .map_err(|e| match e {
                            LuksError::WrongPassphrase => LuksError::InvalidArgument(
                                "the passphrase opens the old volume key but no keyslot of the new one; cryptblk needs one passphrase for both".into(),
                            ),
                            other => other,
                        })?;
                    Some(k)
                }
            }
        };
        digest::verify(&hdr.meta, &state, old_key.as_ref(), new_key.as_ref())?;
        let seg = |id: &String| {
            hdr.meta
                .segments
                .get(id)
                .cloned()
                .ok_or_else(|| LuksError::Corrupt(format!("segment {id} vanished")))
        };
        let old_cipher = match (&old_key, seg(&state.segment_old)?) {
            (Some(k), s) if s.kind == "crypt" => Some(make_cipher(&s, k)?),
            _ => None,
        };
        let new_cipher = match (&new_key, seg(&state.segment_new)?) {
            (Some(k), s) if s.kind == "crypt" => Some(make_cipher(&s, k)?),
            _ => None,
        };
        let file_len = data.size()?;
        let mut me = Reencryption {
            file,
            data,
            hdr,
            state,
            old_key,
            new_key,
            old_cipher,
            new_cipher,
            keyslot: opened_slot,
            pool,
            file_len,
            stale: None,
            uncommitted: false,
            hotzone: Vec::new(),
            keep_size: false,
        };
        let extents = me.extents()?;
        // A data shift keeps the hotzone's source intact, except for a decryption's moved
        // segment, decrypted in place under checksums.
        let classified =
            |e: &SegmentExtent| !datashift || (decrypt_datashift && e.logical_start == 0);
        if let Some(hot) = extents.iter().find(|e| e.in_reencryption && classified(e)) {
            me.stale = Some(StaleBlocks::classify(
                me.file,
                me.data,
                &me.state,
                hot,
                me.alignment(),
            )?);
        }
        Ok(me)
    }

    /// The data device's length when the reencryption was opened.
    pub(super) fn data_len(&self) -> Result<u64> {
        Ok(self.file_len)
    }

    pub fn state(&self) -> &ReencryptState {
        &self.state
    }

    pub fn header(&self) -> &Luks2Header {
        &self.hdr
    }

    /// The live segments as volume extents, in volume order, covering `[0, device_size())`
    /// (a data path serves each from its device offset, decrypting `Crypt` ones with
    /// `cipher_of(role)`). An in-place encryption shows the moved part (`Plain`, volume
    /// `[0, shift)`, stored at the image's end), the plaintext in place (`Plain`, device
    /// offset = volume offset) and the encrypted top (`Crypt`, `shift` bytes further up).
    /// An extent `in_reencryption` is a hotzone a crash interrupted: `recover` it before
    /// serving (`read` gives its contents meanwhile).
    pub fn extents(&self) -> Result<Vec<SegmentExtent>> {
        layout::live_extents(&self.hdr.meta, &self.state, self.file_len)
    }

    /// The volume size in bytes. An in-place encryption's is the plaintext kept (`N`) until
    /// its last hotzone, after which it runs to the image's end unless the size is kept
    /// (`keep_volume_size`).
    pub fn device_size(&self) -> Result<u64> {
        if self.state.is_decrypt_datashift() {
            return self.decrypt_total();
        }
        Ok(self.extents()?.last().map_or(0, SegmentExtent::end))
    }

    /// A crash interrupted a hotzone (recovery has not run yet).
    pub fn is_interrupted(&self) -> bool {
        self.state.hot_segment.is_some()
    }

    /// Bytes of the volume already in the new layout: a forward reencryption's below the
    /// boundary, an encryption's encrypted ones (at the volume's top).
    pub fn done_bytes(&self) -> Result<u64> {
        if self.state.mode == ReencryptMode::Encrypt {
            return self.encrypt_done_bytes();
        }
        if self.state.is_decrypt_datashift() {
            return self.decrypt_done_bytes();
        }
        let ext = self.extents()?;
        let new_prefix = ext
            .iter()
            .take_while(|e| !e.in_reencryption && self.role_of(e) == Some(KeyRole::New))
            .map(|e| e.len)
            .sum();
        Ok(new_prefix)
    }

    fn role_of(&self, e: &SegmentExtent) -> Option<KeyRole> {
        match &e.cipher {
            ExtentCipher::Crypt { role, .. } => Some(*role),
            ExtentCipher::Plain => match self.state.mode {
                ReencryptMode::Encrypt => Some(KeyRole::Old),
                _ => Some(KeyRole::New),
            },
        }
    }

    /// The cipher of the `role` key, for a data path serving the `Crypt` extents of that
    /// role; `None` where that side is plaintext (an encryption's old key, a decryption's
    /// new one).
    pub fn cipher_of(&self, role: KeyRole) -> Option<Arc<dyn SectorCipher>> {
        match role {
            KeyRole::Old => self.old_cipher.clone(),
            KeyRole::New => self.new_cipher.clone(),
        }
    }

    fn cipher(&self, role: KeyRole) -> Result<&Arc<dyn SectorCipher>> {
        match role {
            KeyRole::Old => self.old_cipher.as_ref(),
            KeyRole::New => self.new_cipher.as_ref(),
        }
        .ok_or_else(|| {
            unsupported(
                "reencryption mode",
                self.state.mode.name(),
                "plaintext segments are not implemented",
            )
        })
    }

    fn backup_iv_base(&self, role: KeyRole) -> u64 {
        let id = match role {
            KeyRole::Old => &self.state.segment_old,
            KeyRole::New => &self.state.segment_new,
        };
        self.hdr
            .meta
            .segments
            .get(id)
            .and_then(|s| s.iv_tweak)
            .unwrap_or(0)
            .saturating_mul(512)
    }

    /// Decrypt (or encrypt) `buf`, which holds volume bytes from `pos`, as `role` stores them.
    pub(super) fn crypt(
        &self,
        role: KeyRole,
        dir: Direction,
        pos: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let cipher = self.cipher(role)?;
        let ss = cipher.sector_size() as u64;
        let iv_byte = self.backup_iv_base(role).saturating_add(pos);
        if !iv_byte.is_multiple_of(ss) || !(buf.len() as u64).is_multiple_of(ss) {
            return Err(LuksError::InvalidArgument(format!(
                "{pos}+{} is not aligned to {ss}-byte sectors",
                buf.len()
            )));
        }
        self.pool.crypt(cipher, dir, iv_byte / ss, buf)?;
        Ok(())
    }

    pub(super) fn checksum_params(&self) -> Option<(HashAlg, u64)> {
        match self.state.resilience {
            Resilience::Checksum { hash, block_size } => Some((hash, u64::from(block_size))),
            _ => None,
        }
    }

    /// Read plaintext of the volume at `offset` (aligned to the larger sector size).
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset + buf.len() as u64;
        let mut done = 0usize;
        for e in self.extents()? {
            if e.end() <= offset || e.logical_start >= end {
                continue;
            }
            let from = offset.max(e.logical_start);
            let to = end.min(e.end());
            let part = &mut buf[(from - offset) as usize..(to - offset) as usize];
            crate::io::read_at(
                self.data,
                e.device_offset + (from - e.logical_start),
                part,
                "volume data",
            )?;
            match (&self.stale, e.in_reencryption) {
                (Some(st), true) => {
                    let mut p = from;
                    while p < to {
                        let i = ((p - st.start) / st.block) as usize;
                        let stop = (st.start + (i as u64 + 1) * st.block).min(to);
                        let old = st.old.get(i).copied().unwrap_or(false);
                        let chunk = &mut part[(p - from) as usize..(stop - from) as usize];
                        if let (true, Some(journal)) = (old, st.journal) {
                            crate::io::read_at(
                                self.file,
                                journal + (p - st.start),
                                chunk,
                                "reencryption journal",
                            )?;
                        }
                        // A decryption's new blocks are plaintext.
                        if old || self.new_cipher.is_some() {
                            let role = if old { KeyRole::Old } else { KeyRole::New };
                            self.crypt(role, Direction::Decrypt, p, chunk)?;
                        }
                        p = stop;
                    }
                }
                (None, true) if self.state.is_decrypt_datashift() => {
                    self.read_shifted_hotzone(&e, from, part)?;
                }
                (None, true) if self.state.is_encrypt_datashift() => {
                    // Part written or not, the hotzone's plaintext source is intact.
                    let source = self.encrypt_hotzone_source(&e)?;
                    crate::io::read_at(
                        self.data,
                        source + (from - e.logical_start),
                        part,
                        "plaintext hotzone",
                    )?;
                }
                _ => {
                    if let Some(role) = self
                        .role_of(&e)
                        .filter(|_| matches!(e.cipher, ExtentCipher::Crypt { .. }))
                    {
                        self.crypt(role, Direction::Decrypt, from, part)?;
                    }
                }
            }
            done += part.len();
        }
        if done != buf.len() {
            return Err(LuksError::InvalidArgument(format!(
                "read of {} bytes at {offset} runs past the volume's end",
                buf.len()
            )));
        }
        Ok(())
    }

    pub(super) fn commit_meta(&mut self, meta: Metadata) -> Result<()> {
        let before = std::mem::replace(&mut self.hdr.meta, meta);
        if let Err(e) = self.hdr.commit(self.file) {
            self.hdr.meta = before;
            return Err(e);
        }
        self.reparse()
    }

    pub(super) fn reparse(&mut self) -> Result<()> {
        self.state = ReencryptState::parse(&self.hdr.meta)?
            .ok_or_else(|| LuksError::Corrupt("reencryption state vanished".into()))?;
        Ok(())
    }

    pub(super) fn ensure_forward_reencrypt(&self) -> Result<()> {
        if self.state.mode != ReencryptMode::Reencrypt {
            return Err(unsupported(
                "reencryption mode",
                self.state.mode.name(),
                "cryptblk reencrypts from key to key; finish encrypt/decrypt runs with `cryptsetup reencrypt --resume-only`",
            ));
        }
        if self.state.direction != ReencryptDirection::Forward {
            return Err(unsupported(
                "reencryption direction",
                "backward",
                "cryptblk rewrites forward only; finish with `cryptsetup reencrypt --resume-only`",
            ));
        }
        Ok(())
    }

    /// Make what the loop did durable when stopping early (resilience `none` keeps the
    /// boundary in memory until then).
    pub fn checkpoint(&mut self) -> Result<()> {
        if self.uncommitted {
            self.data.sync_data()?;
            let meta = self.hdr.meta.clone();
            self.commit_meta(meta)?;
            self.uncommitted = false;
        }
        Ok(())
    }

    /// The header after `finish`, for callers that go on using the image.
    pub fn into_header(self) -> Luks2Header {
        self.hdr
    }

    /// The new volume key (for tests and for handing the image to a data path).
    pub fn new_key(&self) -> Option<&SecretKey> {
        self.new_key.as_ref()
    }

    pub fn old_key(&self) -> Option<&SecretKey> {
        self.old_key.as_ref()
    }

    /// The volume keys open now, each with the fingerprint of its digest, for a successor
    /// daemon or the key cache to open the volume again without a KDF (`Unlocker::Keys`).
    pub fn known_keys(&self) -> Result<Vec<KnownKey>> {
        let mut known = Vec::new();
        for (digest, key) in [
            (&self.state.digest_old, &self.old_key),
            (&self.state.digest_new, &self.new_key),
        ] {
            let (Some(id), Some(key)) = (digest, key) else {
                continue;
            };
            let dg = self
                .hdr
                .meta
                .digests
                .get(id)
                .ok_or_else(|| LuksError::Corrupt(format!("digest {id} vanished")))?;
            let digest = crate::luks2::unlock::fingerprint(dg);
            if known.iter().all(|k: &KnownKey| k.digest != digest) {
                known.push(KnownKey {
                    key: SecretKey::from_slice(key.as_bytes()),
                    digest,
                });
            }
        }
        Ok(known)
    }
}
