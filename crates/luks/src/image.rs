//! The version-independent API: probe, read, unlock, format and manage keyslots of a LUKS1 or
//! LUKS2 image without caring which one it is.
use crate::io::read_at;
use crate::io::HeaderIo;
use crate::luks1::{is_luks1, Luks1Header};
use crate::luks2::Luks2Header;
use crate::{
    DigestFingerprint, FormatOptions, LuksError, LuksVersion, PbkdfOptions, Result, UnlockOptions,
    Unlocker,
};
use cryptblk_crypto::{CipherSpec, SecretKey};

mod dump_text;

const MAGIC: [u8; 6] = *b"LUKS\xba\xbe";

/// A parsed LUKS header of either version.
#[derive(Debug, Clone)]
pub enum LuksImage {
    V1(Luks1Header),
    V2(Luks2Header),
}

/// Forward a call to whichever version this image is.
macro_rules! both {
    ($self:expr, $h:ident => $e:expr) => {
        match $self {
            LuksImage::V1($h) => $e,
            LuksImage::V2($h) => $e,
        }
    };
}

impl LuksImage {
    /// True if the file starts with the LUKS magic (either version). Only the magic is
    /// checked; `read` does the validation.
    pub fn probe(file: &dyn HeaderIo) -> Result<bool> {
        let mut buf = [0u8; 6];
        match file.read_exact_at(&mut buf, 0) {
            Ok(()) => Ok(buf == MAGIC),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    pub fn read(file: &dyn HeaderIo) -> Result<(LuksImage, Vec<String>)> {
        let mut buf = [0u8; 8];
        let head = read_at(file, 0, &mut buf, "LUKS magic");
        if head.is_ok() && is_luks1(&buf) {
            let (h, w) = Luks1Header::read(file)?;
            return Ok((LuksImage::V1(h), w));
        }
        if head.is_ok() && buf[..6] == MAGIC {
            let version = u16::from_be_bytes([buf[6], buf[7]]);
            if version != 2 {
                return Err(LuksError::NotLuks(format!(
                    "unknown LUKS version {version}"
                )));
            }
        }
        // Version 2, or no primary magic at all: LUKS2 can still be recovered from its
        // secondary copy, so let its reader decide.
        match Luks2Header::read(file) {
            Ok((h, w)) => Ok((LuksImage::V2(h), w)),
            Err(e) if head.is_ok() && buf[..6] == MAGIC => Err(e),
            Err(LuksError::Io(e)) => Err(LuksError::Io(e)),
            Err(e) => Err(LuksError::NotLuks(format!("no LUKS header found ({e})"))),
        }
    }

    pub fn version(&self) -> LuksVersion {
        match self {
            LuksImage::V1(_) => LuksVersion::V1,
            LuksImage::V2(_) => LuksVersion::V2,
        }
    }

    pub fn uuid(&self) -> &str {
        both!(self, h => h.uuid())
    }

    pub fn label(&self) -> Option<&str> {
        both!(self, h => h.label())
    }

    pub fn cipher_spec(&self) -> Result<CipherSpec> {
        both!(self, h => h.cipher_spec())
    }

    pub fn sector_size(&self) -> u32 {
        both!(self, h => h.sector_size())
    }

    pub fn data_offset(&self) -> u64 {
        both!(self, h => h.data_offset())
    }

    pub fn data_size(&self, file_len: u64) -> Result<u64> {
        both!(self, h => h.data_size(file_len))
    }

    pub fn active_keyslots(&self) -> Vec<usize> {
        both!(self, h => h.active_keyslots())
    }

    pub fn read_only_reason(&self) -> Option<String> {
        both!(self, h => h.read_only_reason())
    }

    pub fn unlock(
        &self,
        file: &dyn HeaderIo,
        passphrase: &[u8],
        opts: &UnlockOptions,
    ) -> Result<(usize, SecretKey)> {
        both!(self, h => h.unlock(file, passphrase, opts))
    }

    /// Opens the volume key with a passphrase (trying the keyslots) or with a known key
    /// (matched by the digest's fingerprint, no KDF); the keyslot is `None` for a known key.
    pub fn unlock_with(
        &self,
        file: &dyn HeaderIo,
        unlocker: Unlocker<'_>,
        opts: &UnlockOptions,
    ) -> Result<(Option<usize>, SecretKey)> {
        both!(self, h => h.unlock_with(file, unlocker, opts))
    }

    /// The fingerprint of the digest the data's volume key must match (`KnownKey`).
    pub fn volume_key_fingerprint(&self) -> Result<DigestFingerprint> {
        both!(self, h => h.volume_key_fingerprint())
    }

    pub fn verify_volume_key(&self, key: &SecretKey) -> Result<()> {
        both!(self, h => h.verify_volume_key(key))
    }

    /// The most memory (KiB) one keyslot's KDF needs: argon2's cost, 0 for PBKDF2 (LUKS1).
    pub fn unlock_memory_kib(&self) -> u64 {
        match self {
            LuksImage::V1(_) => 0,
            LuksImage::V2(h) => h.unlock_memory_kib(),
        }
    }

    /// Create a header with a fresh random volume key in keyslot 0; returns the key too.
    pub fn format(
        file: &dyn HeaderIo,
        opts: &FormatOptions,
        passphrase: &[u8],
        payload_size: Option<u64>,
    ) -> Result<(LuksImage, SecretKey)> {
        let volume_key = SecretKey::random(opts.cipher.key_bytes())?;
        let image = match opts.version {
            LuksVersion::V1 => LuksImage::V1(Luks1Header::format(
                file,
                opts,
                passphrase,
                &volume_key,
                payload_size,
            )?),
            LuksVersion::V2 => LuksImage::V2(Luks2Header::format(
                file,
                opts,
                passphrase,
                &volume_key,
                payload_size,
            )?),
        };
        Ok((image, volume_key))
    }

    pub fn add_keyslot(
        &mut self,
        file: &dyn HeaderIo,
        volume_key: &SecretKey,
        new_passphrase: &[u8],
        slot: Option<usize>,
        pbkdf: &PbkdfOptions,
    ) -> Result<usize> {
        self.ensure_writable()?;
        both!(self, h => h.add_keyslot(file, volume_key, new_passphrase, slot, pbkdf))
    }

    pub fn remove_keyslot(&mut self, file: &dyn HeaderIo, slot: usize) -> Result<()> {
        self.ensure_writable()?;
        both!(self, h => h.remove_keyslot(file, slot))
    }

    /// Replace the passphrase `old` with `new`. The new keyslot is written (in another slot)
    /// before the old one is removed, so at every moment at least one slot opens the image.
    /// Returns the new slot id.
    pub fn change_passphrase(
        &mut self,
        file: &dyn HeaderIo,
        old: &[u8],
        new: &[u8],
        pbkdf: &PbkdfOptions,
        unlock: &UnlockOptions,
    ) -> Result<usize> {
        self.ensure_writable()?;
        let (old_slot, volume_key) = self.unlock(file, old, unlock)?;
        let new_slot = self.add_keyslot(file, &volume_key, new, None, pbkdf)?;
        self.remove_keyslot(file, old_slot)?;
        Ok(new_slot)
    }

    /// Makes the payload `size` bytes long in the header, where the header records it: a
    /// fixed-length LUKS2 data segment is rewritten (both copies, crash-safe); LUKS1 and a
    /// `dynamic` LUKS2 segment follow the device, so nothing is written. Returns whether the
    /// header changed. The caller resizes the image itself (grow it first, shrink it after).
    pub fn set_data_size(&mut self, file: &dyn HeaderIo, size: u64) -> Result<bool> {
        self.ensure_writable()?;
        match self {
            LuksImage::V1(_) => Ok(false),
            LuksImage::V2(h) => h.set_data_size(file, size),
        }
    }

    fn ensure_writable(&self) -> Result<()> {
        match self.read_only_reason() {
            Some(reason) => Err(LuksError::Unsupported {
                what: "header change",
                name: self.uuid().to_string(),
                hint: reason,
            }),
            None => Ok(()),
        }
    }

    /// Structured description; salts and digests only, never key material.
    pub fn dump_json(&self) -> serde_json::Value {
        both!(self, h => h.dump())
    }

    /// Text like `cryptsetup luksDump`.
    pub fn dump_text(&self) -> String {
        match self {
            LuksImage::V1(h) => h.dump_text(),
            LuksImage::V2(h) => dump_text::luks2(&h.dump()),
        }
    }
}
