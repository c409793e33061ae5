//! Starting a reencryption (cryptsetup's `reencrypt --init-only`): a keyslot for a fresh
//! volume key bound to its own digest, the backup segments, a `reencrypt` keyslot over the
//! largest free gap of the keyslots area, the requirement flag and the reencryption digest,
//! all in one header commit after the new keyslot's material is on disk.
use super::{digest, ReencryptState, FLAG_BACKUP_FINAL, FLAG_BACKUP_PREVIOUS, REQUIREMENT_V2};
use crate::io::HeaderIo;
use crate::luks2::json::{Area, Digest, Keyslot, Requirements, SegmentSize};
use crate::luks2::validate::{keyslots_range, MAX_KEYSLOTS};
use crate::luks2::write::{b64, random_bytes, SALT_BYTES};
use crate::luks2::Luks2Header;
use crate::{kdf, kdf_cost, HashAlg, LuksError, PbkdfOptions, Result, UnlockOptions};
use cryptblk_crypto::{CipherSpec, SecretKey};
use serde_json::Value;

/// Resilience for a reencryption cryptblk starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResilienceChoice {
    Checksum(HashAlg),
    /// The hotzone's old ciphertext is copied to the keyslot area before it is rewritten.
    Journal,
    None,
}

/// What to change: anything left `None` keeps the current value.
#[derive(Debug, Clone)]
pub struct InitParams {
    pub cipher: Option<CipherSpec>,
    pub sector_size: Option<u32>,
    pub resilience: ResilienceChoice,
    /// KDF for the new keyslot.
    pub pbkdf: PbkdfOptions,
    /// The keyslot the passphrase opens (the only one kept when the image has several).
    pub keyslot: Option<usize>,
}

fn invalid(msg: String) -> LuksError {
    LuksError::InvalidArgument(msg)
}

impl Luks2Header {
    /// The reencryption state, if the header is in one (validated, digest not yet verified).
    pub fn reencrypt_state(&self) -> Result<Option<ReencryptState>> {
        ReencryptState::parse(&self.meta)
    }

    /// The live segments of a reencryption as volume extents (no keys needed; the digest is
    /// not verified, so this is a description, not something to decrypt by).
    pub fn reencrypt_extents(&self, file_len: u64) -> Result<Option<Vec<super::SegmentExtent>>> {
        match ReencryptState::parse(&self.meta)? {
            Some(state) => Ok(Some(super::layout::live_extents(
                &self.meta, &state, file_len,
            )?)),
            None => Ok(None),
        }
    }

    /// The cipher the data ends up in, for a volume key of `key_bytes`: during a
    /// reencryption the `backup-final` segment's (the data segment `cipher_spec` reads may be
    /// a live segment with a non-zero IV base, or the old key's), otherwise the data
    /// segment's. A decryption ends in plaintext: that is an error.
    pub fn final_cipher_spec(&self, key_bytes: usize) -> Result<CipherSpec> {
        let Some(state) = ReencryptState::parse(&self.meta)? else {
            return self.cipher_spec();
        };
        let fin =
            self.meta.segments.get(&state.segment_new).ok_or_else(|| {
                LuksError::Corrupt(format!("segment {} vanished", state.segment_new))
            })?;
        if fin.kind != "crypt" {
            return Err(invalid(format!(
                "this {} ends in a plaintext ({}) segment",
                state.mode.name(),
                fin.kind
            )));
        }
        super::super::parse_cipher(fin.encryption.as_deref().unwrap_or_default(), key_bytes)
    }

    /// Mark the image for reencryption to a new volume key. Returns the new keyslot's id.
    pub fn reencrypt_init(
        &mut self,
        file: &dyn HeaderIo,
        passphrase: &[u8],
        unlock: &UnlockOptions,
        params: &InitParams,
    ) -> Result<usize> {
        super::super::ensure_writable(self)?;
        let (old_seg_id, old_seg) = self.segment().map(|(i, s)| (i.to_string(), s.clone()))?;
        if old_seg_id != "0" || self.meta.segments.len() != 1 {
            return Err(invalid(
                "the image must have exactly one data segment".into(),
            ));
        }
        if old_seg.size != SegmentSize::Dynamic {
            return Err(LuksError::Unsupported {
                what: "data segment size",
                name: format!("{:?}", old_seg.size),
                hint: "cryptblk reencrypts images whose data runs to the end of the file".into(),
            });
        }
        let old_spec = self.cipher_spec()?;
        let (_, digest) = self.segment_digest()?;
        // With --key-slot only that slot is tried, so the slot kept is the one named.
        let (_, old_key) = crate::luks2::unlock::unlock_digest(
            self,
            file,
            passphrase,
            unlock,
            digest,
            params.keyslot,
        )?;
        let (old_digest_id, old_digest) = self
            .segment_digest()
            .map(|(i, d)| (i.to_string(), d.clone()))?;
        let bound: Vec<&String> = old_digest.keyslots.iter().collect();
        if bound.len() > 1 && params.keyslot.is_none() {
            return Err(invalid(format!(
                "the image has {} keyslots ({}); cryptblk reencrypts with one passphrase, so name the one to keep with --key-slot (the others are removed when the reencryption ends)",
                bound.len(),
                bound.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
            )));
        }
        let new_spec = params.cipher.clone().unwrap_or_else(|| old_spec.clone());
        let new_ss = params.sector_size.unwrap_or_else(|| self.sector_size());
        if !(512..=4096).contains(&new_ss) || !new_ss.is_power_of_two() {
            return Err(invalid(format!(
                "sector size {new_ss} is not a power of two from 512 to 4096"
            )));
        }
        let old_ss = self.sector_size();
        let file_len = file.size()?;
        let data_size = self.data_size(file_len)?;
        let align = u64::from(old_ss.max(new_ss));
        if !data_size.is_multiple_of(align) {
            return Err(invalid(format!(
                "the data area ({data_size} bytes) is not a whole number of {align}-byte sectors"
            )));
        }
        let new_key = SecretKey::random(new_spec.key_bytes())?;

        let mut meta = self.meta.clone();
        // Keyslot for the new key, bound to a new digest only (cryptsetup's "unbound").
        let new_slot = (0..MAX_KEYSLOTS)
            .find(|i| !meta.keyslots.contains_key(&i.to_string()))
            .ok_or_else(|| invalid("all keyslots are in use".into()))?;
        let keyslot = self.write_keyslot_material(
            file,
            &new_key,
            &new_spec,
            passphrase,
            &params.pbkdf,
            params.pbkdf.hash,
        )?;
        meta.keyslots.insert(new_slot.to_string(), keyslot);
        let digest_id = first_free(&meta.digests);
        let hash = params.pbkdf.hash;
        let iterations = kdf_cost::digest_iterations(hash, &params.pbkdf, new_key.len())?;
        let salt = random_bytes(SALT_BYTES)?;
        let value = kdf::derive(
            &kdf::Kdf::Pbkdf2 { hash, iterations },
            new_key.as_bytes(),
            &salt,
            hash.digest_len(),
        )?;
        meta.digests.insert(
            digest_id.to_string(),
            Digest {
                kind: "pbkdf2".into(),
                keyslots: vec![new_slot.to_string()],
                segments: vec!["2".into()],
                hash: hash.name().into(),
                iterations,
                salt: b64(&salt),
                digest: b64(value.as_bytes()),
                extra: Default::default(),
            },
        );

        // Backups: the current layout and the new one, after the live segment 0.
        let mut prev = old_seg.clone();
        prev.extra
            .insert("flags".into(), Value::from(vec![FLAG_BACKUP_PREVIOUS]));
        let mut fin = old_seg.clone();
        fin.encryption = Some(new_spec.to_luks2_string());
        fin.sector_size = Some(new_ss);
        fin.iv_tweak = Some(0);
        fin.extra
            .insert("flags".into(), Value::from(vec![FLAG_BACKUP_FINAL]));
        meta.segments.insert("1".into(), prev);
        meta.segments.insert("2".into(), fin);
        if let Some(d) = meta.digests.get_mut(&old_digest_id) {
            d.segments = vec!["0".into(), "1".into()];
        }

        // The reencrypt keyslot takes the largest free gap for its checksums.
        let reenc_slot = (0..MAX_KEYSLOTS)
            .find(|i| !meta.keyslots.contains_key(&i.to_string()))
            .ok_or_else(|| {
                invalid(
                    "all keyslots are in use; remove one to make room for the reencryption keyslot"
                        .into(),
                )
            })?;
        let (start, end) = keyslots_range(self.bin.hdr_size, &meta)
            .ok_or_else(|| LuksError::Corrupt("keyslots area overflows".into()))?;
        let (gap_off, gap_len) = largest_gap(&meta, start, end);
        let mut area_extra = serde_json::Map::new();
        let kind = match params.resilience {
            ResilienceChoice::Checksum(h) => {
                area_extra.insert("hash".into(), Value::from(h.name()));
                area_extra.insert(
                    "sector_size".into(),
                    Value::from(u64::from(old_ss.max(new_ss).max(4096))),
                );
                if gap_len < 4096 {
                    return Err(invalid(
                        "no free space in the keyslots area for the reencryption checksums".into(),
                    ));
                }
                "checksum"
            }
            ResilienceChoice::Journal => {
                if gap_len < 1 << 20 {
                    return Err(invalid(
                        "less than 1 MiB free in the keyslots area for the reencryption journal"
                            .into(),
                    ));
                }
                "journal"
            }
            ResilienceChoice::None => "none",
        };
        let mut slot_extra = serde_json::Map::new();
        slot_extra.insert("mode".into(), Value::from("reencrypt"));
        slot_extra.insert("direction".into(), Value::from("forward"));
        meta.keyslots.insert(
            reenc_slot.to_string(),
            Keyslot {
                kind: "reencrypt".into(),
                key_size: 1,
                af: None,
                area: Area {
                    kind: kind.into(),
                    offset: gap_off,
                    size: gap_len,
                    encryption: None,
                    key_size: None,
                    extra: area_extra,
                },
                kdf: None,
                priority: Some(0),
                extra: slot_extra,
            },
        );
        let reqs = meta
            .config
            .requirements
            .get_or_insert_with(|| Requirements {
                mandatory: Vec::new(),
                extra: Default::default(),
            });
        reqs.mandatory.push(REQUIREMENT_V2.into());
        let rd_id = first_free(&meta.digests).to_string();
        digest::bind(
            &mut meta,
            &rd_id,
            &reenc_slot.to_string(),
            Some(&old_key),
            Some(&new_key),
            &params.pbkdf,
        )?;

        let before = std::mem::replace(&mut self.meta, meta);
        if let Err(e) = self.commit(file) {
            self.meta = before;
            return Err(e);
        }
        Ok(new_slot)
    }
}

pub(super) fn first_free<T>(map: &std::collections::BTreeMap<String, T>) -> usize {
    (0..)
        .find(|i: &usize| !map.contains_key(&i.to_string()))
        .unwrap_or(0)
}

/// The largest 4096-aligned free range of the keyslots area `[start, end)`.
pub(super) fn largest_gap(meta: &crate::luks2::json::Metadata, start: u64, end: u64) -> (u64, u64) {
    let mut used: Vec<(u64, u64)> = meta
        .keyslots
        .values()
        .filter(|k| k.area.size > 0)
        .map(|k| (k.area.offset, k.area.offset.saturating_add(k.area.size)))
        .collect();
    used.sort_unstable();
    let mut best = (start, 0);
    let mut cursor = start;
    for (s, e) in used.into_iter().chain(std::iter::once((end, end))) {
        let from = cursor.div_ceil(4096) * 4096;
        if s > from && s - from > best.1 {
            best = (from, (s - from) / 4096 * 4096);
        }
        cursor = cursor.max(e);
    }
    best
}
