//! LUKS2: two checksummed copies of a binary header plus JSON metadata, keyslots in the area
//! behind them, the encrypted payload at the crypt segment's offset.
//!
//! Every value read from the image is untrusted: copies are checksummed and validated as a
//! whole (`validate.rs`) before anything else looks at them.

pub mod binary;
mod dump;
mod format;
pub mod from_luks1;
pub mod json;
mod keyslots;
mod read;
pub mod reencrypt;
mod resize;
mod unlock;
mod validate;
mod write;

use crate::io::HeaderIo;
use crate::{DigestFingerprint, LuksError, Result, UnlockOptions, Unlocker};
use binary::BinaryHeader;
use cryptblk_crypto::{CipherSpec, SecretKey};
use json::{Digest, Metadata, Segment, SegmentSize};

use validate::Placement;
pub use validate::MAX_KEYSLOTS;

/// A parsed, validated LUKS2 header (the copy that was chosen when reading).
#[derive(Debug, Clone)]
pub struct Luks2Header {
    bin: BinaryHeader,
    /// The binary header salts of the (primary, secondary) copies, kept across rewrites.
    salts: [[u8; binary::SALT_LEN]; 2],
    meta: Metadata,
    /// Attached (data behind the header on the same device) or detached (the header is a
    /// file of its own; segment offsets count on a separate data device).
    placement: Placement,
}

impl Luks2Header {
    /// Read and validate both copies; use the valid one with the higher seqid. Warnings report
    /// a damaged or stale copy.
    pub fn read(file: &dyn HeaderIo) -> Result<(Self, Vec<String>)> {
        Self::read_placed(file, Placement::Attached)
    }

    /// Read a detached header (cryptsetup's `--header FILE`): `file` holds the header and the
    /// keyslots area only, the data segments lie on another device from its offset 0. Only
    /// for callers that keep the two apart; the attached `read` never accepts such a header.
    pub fn read_detached(file: &dyn HeaderIo) -> Result<(Self, Vec<String>)> {
        Self::read_placed(file, Placement::Detached)
    }

    fn read_placed(file: &dyn HeaderIo, placement: Placement) -> Result<(Self, Vec<String>)> {
        let (copy, warnings) = read::read_header(file, placement)?;
        let salts = [copy.bin.salt, copy.bin.salt];
        Ok((
            Luks2Header {
                bin: copy.bin,
                salts,
                meta: copy.meta,
                placement,
            },
            warnings,
        ))
    }

    /// Whether the header is detached from its data (read with `read_detached`).
    pub fn is_detached(&self) -> bool {
        self.placement == Placement::Detached
    }

    pub fn uuid(&self) -> &str {
        &self.bin.uuid
    }

    pub fn label(&self) -> Option<&str> {
        Some(self.bin.label.as_str()).filter(|l| !l.is_empty())
    }

    pub fn subsystem(&self) -> Option<&str> {
        Some(self.bin.subsystem.as_str()).filter(|l| !l.is_empty())
    }

    /// Header sequence id (cryptsetup's "Epoch"); grows with every metadata update.
    pub fn seqid(&self) -> u64 {
        self.bin.seqid
    }

    /// Size of one header copy (binary header + JSON area).
    pub fn hdr_size(&self) -> u64 {
        self.bin.hdr_size
    }

    /// The parsed JSON metadata (read-only view, for tools and tests).
    pub fn metadata(&self) -> &Metadata {
        &self.meta
    }

    /// The data segment: the "crypt" segment with the lowest id.
    fn segment(&self) -> Result<(&str, &Segment)> {
        self.meta
            .segments
            .iter()
            .filter(|(_, s)| s.kind == "crypt")
            .min_by_key(|(id, _)| json::parse_u64(id).unwrap_or(u64::MAX))
            .map(|(id, s)| (id.as_str(), s))
            .ok_or_else(|| LuksError::Corrupt("no crypt segment in the LUKS2 metadata".to_string()))
    }

    /// The digest that verifies the data segment's volume key.
    fn segment_digest(&self) -> Result<(&str, &Digest)> {
        let (seg_id, _) = self.segment()?;
        self.meta
            .digests
            .iter()
            .find(|(_, d)| d.segments.iter().any(|s| s == seg_id))
            .map(|(id, d)| (id.as_str(), d))
            .ok_or_else(|| LuksError::Corrupt(format!("no digest is assigned to segment {seg_id}")))
    }

    /// Volume key length: the key_size of keyslots bound to the segment's digest.
    fn volume_key_bytes(&self) -> Result<usize> {
        let (_, digest) = self.segment_digest()?;
        digest
            .keyslots
            .iter()
            .filter_map(|k| self.meta.keyslots.get(k))
            .find(|k| k.kind == "luks2")
            .map(|k| k.key_size as usize)
            .ok_or_else(|| {
                LuksError::Corrupt(
                    "no keyslot is bound to the data segment, volume key size unknown".to_string(),
                )
            })
    }

    /// The data segment cipher.
    pub fn cipher_spec(&self) -> Result<CipherSpec> {
        let (id, seg) = self.segment()?;
        if seg.extra.contains_key("integrity") {
            // dm-integrity tags interleave with the data; plain sector decryption would be wrong.
            return Err(LuksError::Unsupported {
                what: "segment integrity",
                name: seg.extra.get("integrity").map(|v| v.to_string()).unwrap_or_default(),
                hint: format!("segment {id} uses authenticated encryption (dm-integrity), which cryptblk does not implement"),
            });
        }
        if seg.iv_tweak.unwrap_or(0) != 0 {
            return Err(LuksError::Unsupported {
                what: "segment iv_tweak",
                name: seg.iv_tweak.unwrap_or(0).to_string(),
                hint: format!(
                    "segment {id} starts its IVs at a non-zero sector; cryptblk only supports 0"
                ),
            });
        }
        let enc = seg.encryption.as_deref().unwrap_or_default();
        parse_cipher(enc, self.volume_key_bytes()?)
    }

    pub fn sector_size(&self) -> u32 {
        self.segment()
            .ok()
            .and_then(|(_, s)| s.sector_size)
            .unwrap_or(512)
    }

    pub fn data_offset(&self) -> u64 {
        self.segment().map(|(_, s)| s.offset).unwrap_or(0)
    }

    /// Payload bytes for an image of `file_len` bytes.
    pub fn data_size(&self, file_len: u64) -> Result<u64> {
        let (_, seg) = self.segment()?;
        let available = file_len.checked_sub(seg.offset).ok_or_else(|| {
            LuksError::Truncated(format!(
                "image is {file_len} bytes, the data segment starts at {}",
                seg.offset
            ))
        })?;
        match seg.size {
            SegmentSize::Dynamic => {
                let sector = u64::from(seg.sector_size.unwrap_or(512));
                Ok(available - available % sector)
            }
            SegmentSize::Fixed(n) if n <= available => Ok(n),
            SegmentSize::Fixed(n) => Err(LuksError::Truncated(format!(
                "data segment needs {n} bytes at offset {}, the image has {available}",
                seg.offset
            ))),
        }
    }

    /// Ids of the keyslots holding key material, ascending.
    pub fn active_keyslots(&self) -> Vec<usize> {
        let mut ids: Vec<usize> = self
            .meta
            .keyslots
            .iter()
            .filter(|(_, k)| k.kind == "luks2")
            .filter_map(|(id, _)| json::parse_u64(id).and_then(|n| usize::try_from(n).ok()))
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The most memory one keyslot's KDF takes (argon2's cost; 0 when every keyslot is
    /// PBKDF2), in KiB: what unlocking with a passphrase may need at once.
    pub fn unlock_memory_kib(&self) -> u64 {
        self.meta
            .keyslots
            .values()
            .filter_map(|k| k.kdf.as_ref()?.memory)
            .map(u64::from)
            .max()
            .unwrap_or(0)
    }

    /// Why this image must not be modified or activated, if it must not.
    pub fn read_only_reason(&self) -> Option<String> {
        let req = self
            .meta
            .config
            .requirements
            .as_ref()
            .map(|r| r.mandatory.as_slice())
            .unwrap_or_default();
        if req.iter().any(|r| r.starts_with("online-reencrypt")) {
            return Some(format!(
                "a reencryption is in progress ({}): finish it with `cryptblk reencrypt --resume-only` (or cryptsetup reencrypt --resume-only)",
                req.join(", ")
            ));
        }
        if !req.is_empty() {
            return Some(format!(
                "the header lists mandatory requirements cryptblk does not implement: {}",
                req.join(", ")
            ));
        }
        if self.meta.segments.len() != 1 {
            return Some(format!(
                "the header has {} segments (a reencryption is in progress?); cryptblk supports exactly one",
                self.meta.segments.len()
            ));
        }
        None
    }

    pub fn unlock(
        &self,
        file: &dyn HeaderIo,
        passphrase: &[u8],
        opts: &UnlockOptions,
    ) -> Result<(usize, SecretKey)> {
        unlock::unlock(self, file, passphrase, opts)
    }

    /// Opens the data segment's volume key with a passphrase or a known key (`Unlocker`);
    /// the keyslot is `None` for a known key.
    pub fn unlock_with(
        &self,
        file: &dyn HeaderIo,
        unlocker: Unlocker<'_>,
        opts: &UnlockOptions,
    ) -> Result<(Option<usize>, SecretKey)> {
        ensure_writable(self)?;
        let (_, digest) = self.segment_digest()?;
        unlock::unlock_digest_with(self, file, unlocker, opts, digest, None)
    }

    /// The fingerprint of the data segment's digest (`known_key`).
    pub fn volume_key_fingerprint(&self) -> Result<DigestFingerprint> {
        let (_, digest) = self.segment_digest()?;
        Ok(unlock::fingerprint(digest))
    }

    pub fn verify_volume_key(&self, key: &SecretKey) -> Result<()> {
        let (_, digest) = self.segment_digest()?;
        if unlock::digest_matches(digest, key)? {
            Ok(())
        } else {
            Err(LuksError::InvalidArgument(
                "the volume key does not match the header's digest".to_string(),
            ))
        }
    }

    pub fn dump(&self) -> serde_json::Value {
        dump::dump(self)
    }
}

/// Parse a LUKS2 encryption string, naming the whole string when it is not supported.
fn parse_cipher(enc: &str, key_bytes: usize) -> Result<CipherSpec> {
    CipherSpec::parse_luks2(enc, key_bytes).map_err(|e| LuksError::Unsupported {
        what: "cipher",
        name: enc.to_string(),
        hint: e.to_string(),
    })
}

/// Refuse when the image has requirements we do not implement.
fn ensure_writable(hdr: &Luks2Header) -> Result<()> {
    match hdr.read_only_reason() {
        Some(reason) => Err(LuksError::Unsupported {
            what: "LUKS2 header",
            name: hdr.uuid().to_string(),
            hint: reason,
        }),
        None => Ok(()),
    }
}
