//! Adding and removing keyslots. Key material is written and synced before the header that
//! refers to it; a removal rewrites the header before wiping the area.
use super::json::{Af, Area, KdfJson, Keyslot};
use super::unlock::{digest_matches, material_len};
use super::validate::{keyslots_range, validate_placed, MAX_KEYSLOTS};
use super::write::{b64, random_bytes, round_up, SALT_BYTES};
use super::{ensure_writable, parse_cipher, Luks2Header};
use crate::io::zero_range;
use crate::io::HeaderIo;
use crate::kdf::{self, Argon2Variant, Kdf};
use crate::kdf_cost;
use crate::{af, keyslot_area, HashAlg, LuksError, PbkdfOptions, Result};
use cryptblk_crypto::SecretKey;
use zeroize::Zeroizing;

impl Luks2Header {
    /// Add a keyslot holding `volume_key` under `passphrase`; returns its id.
    pub fn add_keyslot(
        &mut self,
        file: &dyn HeaderIo,
        volume_key: &SecretKey,
        passphrase: &[u8],
        slot: Option<usize>,
        pbkdf: &PbkdfOptions,
    ) -> Result<usize> {
        self.add_keyslot_with_hash(file, volume_key, passphrase, slot, pbkdf, pbkdf.hash)
    }

    pub(super) fn add_keyslot_with_hash(
        &mut self,
        file: &dyn HeaderIo,
        volume_key: &SecretKey,
        passphrase: &[u8],
        slot: Option<usize>,
        pbkdf: &PbkdfOptions,
        af_hash: HashAlg,
    ) -> Result<usize> {
        ensure_writable(self)?;
        let (digest_id, digest) = self.segment_digest()?;
        let digest_id = digest_id.to_string();
        if !digest_matches(digest, volume_key)? {
            return Err(LuksError::InvalidArgument(
                "the volume key does not match the header's digest".into(),
            ));
        }
        let id = match slot {
            Some(id) if id >= MAX_KEYSLOTS => {
                return Err(LuksError::InvalidArgument(format!(
                    "keyslot {id} out of range (0..{MAX_KEYSLOTS})"
                )))
            }
            Some(id) if self.meta.keyslots.contains_key(&id.to_string()) => {
                return Err(LuksError::InvalidArgument(format!(
                    "keyslot {id} is already in use"
                )))
            }
            Some(id) => id,
            None => (0..MAX_KEYSLOTS)
                .find(|id| !self.meta.keyslots.contains_key(&id.to_string()))
                .ok_or_else(|| LuksError::InvalidArgument("all keyslots are in use".into()))?,
        };
        let (_, seg) = self.segment()?;
        let spec = parse_cipher(
            seg.encryption.as_deref().unwrap_or_default(),
            volume_key.len(),
        )?;
        let keyslot =
            self.write_keyslot_material(file, volume_key, &spec, passphrase, pbkdf, af_hash)?;
        let before = self.meta.clone();
        self.meta.keyslots.insert(id.to_string(), keyslot);
        if let Some(d) = self.meta.digests.get_mut(&digest_id) {
            d.keyslots.push(id.to_string());
        }
        if let Err(e) = self.commit(file) {
            self.meta = before;
            return Err(e);
        }
        Ok(id)
    }

    /// Allocate an area for `volume_key` under `passphrase`, write its AF material encrypted
    /// with `spec` and sync it; returns the keyslot JSON, not yet in the header.
    pub(super) fn write_keyslot_material(
        &self,
        file: &dyn HeaderIo,
        volume_key: &SecretKey,
        spec: &cryptblk_crypto::CipherSpec,
        passphrase: &[u8],
        pbkdf: &PbkdfOptions,
        af_hash: HashAlg,
    ) -> Result<Keyslot> {
        let key_len = volume_key.len();
        let material = material_len(key_len, af::STRIPES)
            .ok_or_else(|| LuksError::InvalidArgument("key too long".into()))?;
        let area_size = round_up(material as u64, 4096)
            .ok_or_else(|| LuksError::InvalidArgument("key too long".into()))?;
        let offset = self.allocate_area(area_size)?;

        let kdf = kdf_cost::resolve(pbkdf, key_len)?;
        let salt = random_bytes(SALT_BYTES)?;
        let slot_key = kdf::derive(&kdf, passphrase, &salt, key_len)?;
        let split = af::af_split(volume_key, af::STRIPES, af_hash)?;
        let mut buf = Zeroizing::new(vec![0u8; material]);
        let n = split.len().min(material);
        buf[..n].copy_from_slice(&split[..n]);
        keyslot_area::encrypt_area(spec, &slot_key, &mut buf)?;
        file.write_all_at(&buf, offset)?;
        file.sync_data()?;

        let kdf_json = match kdf {
            Kdf::Pbkdf2 { hash, iterations } => KdfJson {
                kind: "pbkdf2".into(),
                hash: Some(hash.name().into()),
                iterations: Some(iterations),
                time: None,
                memory: None,
                cpus: None,
                salt: b64(&salt),
                extra: Default::default(),
            },
            Kdf::Argon2 {
                variant,
                time,
                memory_kib,
                parallel,
            } => KdfJson {
                kind: match variant {
                    Argon2Variant::Argon2i => "argon2i",
                    Argon2Variant::Argon2id => "argon2id",
                }
                .into(),
                hash: None,
                iterations: None,
                time: Some(time),
                memory: Some(memory_kib),
                cpus: Some(parallel),
                salt: b64(&salt),
                extra: Default::default(),
            },
        };
        let keyslot = Keyslot {
            kind: "luks2".into(),
            key_size: key_len as u32,
            af: Some(Af {
                kind: "luks1".into(),
                stripes: af::STRIPES,
                hash: af_hash.name().into(),
                extra: Default::default(),
            }),
            area: Area {
                kind: "raw".into(),
                offset,
                size: area_size,
                encryption: Some(spec.to_luks2_string()),
                key_size: Some(key_len as u32),
                extra: Default::default(),
            },
            kdf: Some(kdf_json),
            priority: None,
            extra: Default::default(),
        };
        Ok(keyslot)
    }

    /// Lowest 4096-aligned gap in the keyslots area that fits `size` bytes.
    fn allocate_area(&self, size: u64) -> Result<u64> {
        let (start, end) = keyslots_range(self.bin.hdr_size, &self.meta)
            .ok_or_else(|| LuksError::Corrupt("keyslots area overflows".into()))?;
        let mut used: Vec<(u64, u64)> = self
            .meta
            .keyslots
            .values()
            .map(|k| (k.area.offset, k.area.offset.saturating_add(k.area.size)))
            .collect();
        used.sort_unstable();
        let mut candidate = start;
        for (s, e) in used {
            if candidate.checked_add(size).is_some_and(|c| c <= s) {
                break;
            }
            candidate = candidate.max(round_up(e, 4096).unwrap_or(u64::MAX));
        }
        match candidate.checked_add(size) {
            Some(c) if c <= end => Ok(candidate),
            _ => Err(LuksError::InvalidArgument(format!(
                "no room for a {size} byte keyslot area in the keyslots area"
            ))),
        }
    }

    /// Remove a keyslot as cryptsetup does: its area is wiped (and synced) first, then the
    /// header stops referring to it. A crash in between leaves a slot that no longer opens,
    /// never a header that says the key is gone while its material is still on disk.
    pub fn remove_keyslot(&mut self, file: &dyn HeaderIo, slot: usize) -> Result<()> {
        ensure_writable(self)?;
        let key = slot.to_string();
        let area = match self.meta.keyslots.get(&key) {
            Some(k) => k.area.clone(),
            None => {
                return Err(LuksError::InvalidArgument(format!(
                    "keyslot {slot} is not in use"
                )))
            }
        };
        let before = self.meta.clone();
        self.meta.keyslots.remove(&key);
        for d in self.meta.digests.values_mut() {
            d.keyslots.retain(|k| *k != key);
        }
        // Tokens name the keyslots they unlock; drop the dangling reference as cryptsetup does.
        for tok in self.meta.tokens.values_mut() {
            if let Some(list) = tok.get_mut("keyslots").and_then(|v| v.as_array_mut()) {
                list.retain(|v| v.as_str() != Some(key.as_str()));
            }
        }
        // Refuse before destroying anything if the header without this slot would be invalid.
        if let Err(e) = validate_placed(&self.meta, self.bin.hdr_size, self.placement) {
            self.meta = before;
            return Err(LuksError::InvalidArgument(format!(
                "refusing to write invalid metadata: {e}"
            )));
        }
        // Validation bounded the area by the keyslots area (at most 128 MiB).
        let wiped = zero_range(file, area.offset, area.size)
            .and_then(|()| file.sync_data().map_err(LuksError::from));
        if let Err(e) = wiped.and_then(|()| self.commit(file)) {
            self.meta = before;
            return Err(e);
        }
        Ok(())
    }
}
