//! LUKS2 reencryption metadata as cryptsetup 2.6 writes it: a `reencrypt` keyslot (mode,
//! direction, resilience area), two backup segments that describe the old and the new data
//! layout (`backup-previous`, `backup-final`), the live segments in between (one of them
//! `in-reencryption` after a crash), the `online-reencrypt-v2` requirement, and a digest that
//! binds all of it to both volume keys. cryptsetup 2.7's in-place decryption to a detached
//! header (`online-reencrypt-v3`, resilience `datashift-checksum`) is in `decrypt.rs`.
//!
//! Nothing here is trusted before `verify_digest` has checked the metadata against the keys:
//! the header's checksum only proves the JSON is intact, not that it belongs to these keys.

mod checksums;
mod decrypt;
mod decrypt_init;
mod digest;
mod encrypt;
mod encrypt_init;
mod finish;
mod hotzone;
mod init;
mod layout;
mod online;
mod read_ahead;
mod recovery;
mod session;
mod stale;

pub use decrypt_init::{decrypt_init, DecryptParams, MovedResilience, DEFAULT_MOVED_MAX};
pub use encrypt_init::{
    encrypt_init, encrypt_prepare, min_reduce, EncryptParams, PreparedEncryption, MAX_REDUCE,
};
pub use init::{InitParams, ResilienceChoice};
pub use layout::{ExtentCipher, KeyRole, SegmentExtent};
pub use online::OnlineSegments;
pub use session::{Reencryption, StepReport};

use super::json::{parse_u64, Metadata, Segment};
use crate::{HashAlg, LuksError, Result};
use serde_json::Value;

/// The requirement flags cryptsetup writes for an online (LUKS2) reencryption, by version.
/// Version 1 ("online-reencrypt") predates the metadata digest and is not accepted.
pub const REQUIREMENT_V2: &str = "online-reencrypt-v2";
/// cryptsetup 2.7 sets version 3 for a decryption with a data shift (older ones refuse it).
pub const REQUIREMENT_V3: &str = "online-reencrypt-v3";

/// Segment flags.
pub const FLAG_BACKUP_PREVIOUS: &str = "backup-previous";
pub const FLAG_BACKUP_FINAL: &str = "backup-final";
pub const FLAG_BACKUP_MOVED: &str = "backup-moved-segment";
pub const FLAG_IN_REENCRYPTION: &str = "in-reencryption";

/// What the reencryption does to the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReencryptMode {
    /// Old key to new key.
    Reencrypt,
    /// Plaintext to ciphertext.
    Encrypt,
    /// Ciphertext to plaintext.
    Decrypt,
}

impl ReencryptMode {
    pub fn name(self) -> &'static str {
        match self {
            ReencryptMode::Reencrypt => "reencrypt",
            ReencryptMode::Encrypt => "encrypt",
            ReencryptMode::Decrypt => "decrypt",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReencryptDirection {
    Forward,
    Backward,
}

/// How a hotzone interrupted by a crash is put right on the next run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resilience {
    /// No protection: a crash inside a hotzone loses that hotzone (cryptsetup commits the
    /// metadata only at the end in this mode).
    None,
    /// A hash of every `block_size` bytes of old ciphertext is stored before the hotzone is
    /// rewritten; after a crash, blocks whose hash still matches are old, the others new.
    Checksum { hash: HashAlg, block_size: u32 },
    /// The hotzone's plaintext is journalled (encrypted) in the keyslot area.
    Journal,
    /// Data moves by `shift` bytes, so the old copy survives the write.
    Datashift { shift: u64 },
    /// Decryption with a data shift (cryptsetup 2.7, `online-reencrypt-v3`): the hotzones
    /// move by `shift` like `Datashift`; the first `shift` bytes, moved to offset 0 at the
    /// start, are decrypted in place last, protected as `Checksum` is.
    DatashiftChecksum {
        shift: u64,
        hash: HashAlg,
        block_size: u32,
    },
    /// As `DatashiftChecksum`, with the moved segment protected as `Journal` is.
    DatashiftJournal { shift: u64 },
}

impl Resilience {
    pub fn name(&self) -> &'static str {
        match self {
            Resilience::None => "none",
            Resilience::Checksum { .. } => "checksum",
            Resilience::Journal => "journal",
            Resilience::Datashift { .. } => "datashift",
            Resilience::DatashiftChecksum { .. } => "datashift-checksum",
            Resilience::DatashiftJournal { .. } => "datashift-journal",
        }
    }
}

/// The validated reencryption state of a header. Ids are the JSON object keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReencryptState {
    /// Requirement version (2 or 3): part of the digest's input.
    pub version: u8,
    pub keyslot: String,
    pub mode: ReencryptMode,
    pub direction: ReencryptDirection,
    pub resilience: Resilience,
    /// The keyslot area that holds checksums (or the journal).
    pub area_offset: u64,
    pub area_size: u64,
    pub segment_old: String,
    pub segment_new: String,
    pub segment_moved: Option<String>,
    /// Digest of the old volume key (absent when encrypting a plaintext device).
    pub digest_old: Option<String>,
    /// Digest of the new volume key (absent when decrypting).
    pub digest_new: Option<String>,
    /// The digest over the reencryption metadata and both keys.
    pub digest_reencrypt: String,
    /// The live segment a crash interrupted, if any.
    pub hot_segment: Option<String>,
}

fn corrupt(msg: String) -> LuksError {
    LuksError::Corrupt(format!("reencryption metadata: {msg}"))
}

fn str_field<'a>(
    obj: &'a serde_json::Map<String, Value>,
    name: &str,
    place: &str,
) -> Result<&'a str> {
    obj.get(name)
        .and_then(Value::as_str)
        .ok_or_else(|| corrupt(format!("{place}.{name} missing or not a string")))
}

fn u64_field(obj: &serde_json::Map<String, Value>, name: &str, place: &str) -> Result<u64> {
    obj.get(name)
        .and_then(Value::as_str)
        .and_then(parse_u64)
        .ok_or_else(|| {
            corrupt(format!(
                "{place}.{name} missing or not a decimal number string"
            ))
        })
}

/// Which reencryption requirement the header carries: Ok(None) without one; an error for a
/// version cryptblk does not read.
pub fn requirement_version(meta: &Metadata) -> Result<Option<u8>> {
    let reqs = meta
        .config
        .requirements
        .as_ref()
        .map(|r| r.mandatory.as_slice())
        .unwrap_or_default();
    let mut found = None;
    for r in reqs.iter().filter(|r| r.starts_with("online-reencrypt")) {
        let v = match r.as_str() {
            REQUIREMENT_V2 => 2,
            REQUIREMENT_V3 => 3,
            other => {
                return Err(LuksError::Unsupported {
                    what: "reencryption requirement",
                    name: other.to_string(),
                    hint: "cryptblk reads online-reencrypt-v2 and -v3 (cryptsetup 2.4 and later); finish this reencryption with the cryptsetup that started it".into(),
                })
            }
        };
        if found.replace(v).is_some() {
            return Err(corrupt("more than one online-reencrypt requirement".into()));
        }
    }
    Ok(found)
}

/// Segment ids with `flag`: exactly one is expected for the backup flags.
fn segment_with_flag(meta: &Metadata, flag: &str) -> Vec<String> {
    meta.segments
        .iter()
        .filter(|(_, s)| s.flags().contains(&flag))
        .map(|(id, _)| id.clone())
        .collect()
}

fn digest_of_segment(meta: &Metadata, seg: &str) -> Option<String> {
    meta.digests
        .iter()
        .find(|(_, d)| d.segments.iter().any(|s| s == seg))
        .map(|(id, _)| id.clone())
}

impl ReencryptState {
    /// Encryption of a plaintext image in place, its first bytes moved to the end to make room
    /// for the header: backward, with a moved segment (encrypt.rs).
    fn is_encrypt_datashift(&self) -> bool {
        self.mode == ReencryptMode::Encrypt
            && self.direction == ReencryptDirection::Backward
            && matches!(self.resilience, Resilience::Datashift { .. })
            && self.segment_moved.is_some()
    }

    /// Decryption that moves the data back over the header: forward, with a moved segment
    /// (decrypt.rs).
    fn is_decrypt_datashift(&self) -> bool {
        self.mode == ReencryptMode::Decrypt
            && self.direction == ReencryptDirection::Forward
            && matches!(
                self.resilience,
                Resilience::DatashiftChecksum { .. } | Resilience::DatashiftJournal { .. }
            )
            && self.segment_moved.is_some()
    }

    /// Parse and check the reencryption metadata; Ok(None) when the header carries no
    /// reencryption requirement.
    pub fn parse(meta: &Metadata) -> Result<Option<Self>> {
        let Some(version) = requirement_version(meta)? else {
            return Ok(None);
        };
        let slots: Vec<(&String, _)> = meta
            .keyslots
            .iter()
            .filter(|(_, k)| k.kind == "reencrypt")
            .collect();
        let (slot_id, slot) = match slots.as_slice() {
            [one] => *one,
            [] => {
                return Err(corrupt(
                    "the requirement is set but there is no reencrypt keyslot".into(),
                ))
            }
            _ => return Err(corrupt(format!("{} reencrypt keyslots", slots.len()))),
        };
        let place = format!("keyslots.{slot_id}");
        if slot.key_size != 1 {
            return Err(corrupt(format!(
                "{place}.key_size is {}, not 1",
                slot.key_size
            )));
        }
        let mode = match str_field(&slot.extra, "mode", &place)? {
            "reencrypt" => ReencryptMode::Reencrypt,
            "encrypt" => ReencryptMode::Encrypt,
            "decrypt" => ReencryptMode::Decrypt,
            other => return Err(corrupt(format!("{place}.mode '{other}' is unknown"))),
        };
        let direction = match str_field(&slot.extra, "direction", &place)? {
            "forward" => ReencryptDirection::Forward,
            "backward" => ReencryptDirection::Backward,
            other => return Err(corrupt(format!("{place}.direction '{other}' is unknown"))),
        };
        let area = &slot.area;
        let aplace = format!("{place}.area");
        let checksum = || -> Result<(HashAlg, u32)> {
            let hash = str_field(&area.extra, "hash", &aplace)?;
            let hash = HashAlg::parse(hash).map_err(|_| LuksError::Unsupported {
                what: "reencryption checksum hash",
                name: hash.to_string(),
                hint: "cryptblk supports sha1, sha256 and sha512".into(),
            })?;
            let bs = area
                .extra
                .get("sector_size")
                .and_then(Value::as_u64)
                .filter(|&n| (512..=(1 << 20)).contains(&n) && n.is_power_of_two())
                .ok_or_else(|| {
                    corrupt(format!(
                        "{aplace}.sector_size missing or not a power of two from 512"
                    ))
                })?;
            Ok((hash, bs as u32))
        };
        let shift = || u64_field(&area.extra, "shift_size", &aplace);
        let resilience = match area.kind.as_str() {
            "none" => Resilience::None,
            "checksum" => {
                let (hash, block_size) = checksum()?;
                Resilience::Checksum { hash, block_size }
            }
            "journal" => Resilience::Journal,
            "datashift" => Resilience::Datashift { shift: shift()? },
            "datashift-checksum" => {
                let (hash, block_size) = checksum()?;
                Resilience::DatashiftChecksum {
                    shift: shift()?,
                    hash,
                    block_size,
                }
            }
            "datashift-journal" => Resilience::DatashiftJournal { shift: shift()? },
            other => return Err(corrupt(format!("{aplace}.type '{other}' is unknown"))),
        };
        if matches!(
            resilience,
            Resilience::Checksum { .. } | Resilience::Journal
        ) && area.size == 0
        {
            return Err(corrupt(format!(
                "{aplace} is empty but {} needs room",
                resilience.name()
            )));
        }

        let one = |flag: &str| -> Result<String> {
            match segment_with_flag(meta, flag).as_slice() {
                [id] => Ok(id.clone()),
                ids => Err(corrupt(format!(
                    "{} segments flagged {flag}, expected one",
                    ids.len()
                ))),
            }
        };
        let segment_old = one(FLAG_BACKUP_PREVIOUS)?;
        let segment_new = one(FLAG_BACKUP_FINAL)?;
        let segment_moved = match segment_with_flag(meta, FLAG_BACKUP_MOVED).as_slice() {
            [] => None,
            [id] => Some(id.clone()),
            ids => return Err(corrupt(format!("{} moved segments", ids.len()))),
        };
        let hot = segment_with_flag(meta, FLAG_IN_REENCRYPTION);
        if hot.len() > 1 {
            return Err(corrupt(format!(
                "{} segments are in reencryption",
                hot.len()
            )));
        }
        let hot_segment = hot.into_iter().next();
        let digest_old = digest_of_segment(meta, &segment_old);
        let digest_new = digest_of_segment(meta, &segment_new);
        let need = |d: &Option<String>, what: &str, needed: bool| -> Result<()> {
            if needed && d.is_none() {
                return Err(corrupt(format!(
                    "no digest is assigned to the {what} backup segment"
                )));
            }
            Ok(())
        };
        need(&digest_old, "previous", mode != ReencryptMode::Encrypt)?;
        need(&digest_new, "final", mode != ReencryptMode::Decrypt)?;
        let digest_reencrypt = meta
            .digests
            .iter()
            .find(|(_, d)| d.keyslots.iter().any(|k| k == slot_id))
            .map(|(id, _)| id.clone())
            .ok_or_else(|| {
                corrupt(format!(
                    "no digest is assigned to reencrypt keyslot {slot_id}"
                ))
            })?;

        // The live segments: ids 0..n without gaps, each laid out like one of the backups.
        let live: Vec<(&String, &Segment)> = meta
            .segments
            .iter()
            .filter(|(_, s)| !s.is_backup())
            .collect();
        for (i, (id, seg)) in live.iter().enumerate() {
            if parse_u64(id) != Some(i as u64)
                && !live
                    .iter()
                    .any(|(other, _)| parse_u64(other) == Some(i as u64))
            {
                return Err(corrupt(format!(
                    "live segment ids are not 0..{}",
                    live.len()
                )));
            }
            if seg.kind != "crypt" && seg.kind != "linear" {
                return Err(corrupt(format!("segment {id} has type '{}'", seg.kind)));
            }
        }
        if live.is_empty() {
            return Err(corrupt("no live data segment".into()));
        }
        Ok(Some(ReencryptState {
            version,
            keyslot: slot_id.clone(),
            mode,
            direction,
            resilience,
            area_offset: area.offset,
            area_size: area.size,
            segment_old,
            segment_new,
            segment_moved,
            digest_old,
            digest_new,
            digest_reencrypt,
            hot_segment,
        }))
    }
}

/// An error for what this reencryption support does not handle, with a hint for the user.
pub(super) fn unsupported(what: &'static str, name: &str, hint: &str) -> LuksError {
    LuksError::Unsupported {
        what,
        name: name.to_string(),
        hint: hint.to_string(),
    }
}

#[cfg(test)]
mod decrypt_tests;
#[cfg(test)]
mod encrypt_online_tests;
#[cfg(test)]
mod encrypt_tests;
#[cfg(test)]
mod tests;
