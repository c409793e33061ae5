//! Opening keyslots with a passphrase and checking volume keys against the digest.
use super::json::{Digest, KdfJson, Keyslot};
use super::validate::b64;
use super::{ensure_writable, parse_cipher, Luks2Header};
use crate::io::HeaderIo;
use crate::kdf::{self, Argon2Variant, Kdf};
use crate::{
    af, keyslot_area, DigestFingerprint, HashAlg, LuksError, Result, UnlockOptions, Unlocker,
};
use cryptblk_crypto::SecretKey;
use zeroize::Zeroizing;

fn corrupt(field: String) -> LuksError {
    LuksError::Corrupt(field)
}

/// The stored KDF as a concrete `Kdf` (validation already checked the fields exist).
pub fn kdf_of(slot_id: &str, k: &KdfJson) -> Result<Kdf> {
    let missing = |f: &str| corrupt(format!("keyslots.{slot_id}.kdf.{f} missing"));
    let argon = |variant| -> Result<Kdf> {
        Ok(Kdf::Argon2 {
            variant,
            time: k.time.ok_or_else(|| missing("time"))?,
            memory_kib: k.memory.ok_or_else(|| missing("memory"))?,
            parallel: k.cpus.ok_or_else(|| missing("cpus"))?,
        })
    };
    match k.kind.as_str() {
        "pbkdf2" => Ok(Kdf::Pbkdf2 {
            hash: HashAlg::parse(k.hash.as_deref().ok_or_else(|| missing("hash"))?)?,
            iterations: k.iterations.ok_or_else(|| missing("iterations"))?,
        }),
        // "argon2" is what early LUKS2 code wrote for argon2i.
        "argon2i" | "argon2" => argon(Argon2Variant::Argon2i),
        "argon2id" => argon(Argon2Variant::Argon2id),
        other => Err(LuksError::Unsupported {
            what: "KDF",
            name: other.to_string(),
            hint: "cryptblk supports pbkdf2, argon2i and argon2id".to_string(),
        }),
    }
}

/// The fingerprint of a digest as stored (`known_key`): its fields as the header spells them.
pub fn fingerprint(digest: &Digest) -> DigestFingerprint {
    DigestFingerprint::of(&[
        b"luks2",
        digest.kind.as_bytes(),
        digest.hash.as_bytes(),
        &digest.iterations.to_le_bytes(),
        digest.salt.as_bytes(),
        digest.digest.as_bytes(),
    ])
}

/// Whether `key` is the volume key `digest` describes (PBKDF2 of the key, constant-time compare).
pub fn digest_matches(digest: &Digest, key: &SecretKey) -> Result<bool> {
    let hash = HashAlg::parse(&digest.hash)?;
    let salt = b64("digest salt", &digest.salt).map_err(corrupt)?;
    let want = b64("digest value", &digest.digest).map_err(corrupt)?;
    let got = kdf::derive(
        &Kdf::Pbkdf2 {
            hash,
            iterations: digest.iterations,
        },
        key.as_bytes(),
        &salt,
        want.len(),
    )?;
    Ok(constant_time_eq(got.as_bytes(), &want))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // black_box keeps the optimiser from turning the fold into an early-exit comparison.
    std::hint::black_box(diff) == 0
}

/// Bytes of the area that hold AF material: whole 512-byte sectors.
pub fn material_len(key_size: usize, stripes: u32) -> Option<usize> {
    let n = key_size.checked_mul(stripes as usize)?;
    n.checked_add(511).map(|v| v & !511)
}

/// Try one keyslot: Some(volume key) if the passphrase opens it and the key matches `digest`.
fn try_slot(
    file: &dyn HeaderIo,
    id: usize,
    key: &str,
    slot: &Keyslot,
    digest: &Digest,
    passphrase: &[u8],
    opts: &UnlockOptions,
) -> Result<Option<SecretKey>> {
    let kdf_json = slot
        .kdf
        .as_ref()
        .ok_or_else(|| LuksError::Keyslot(id, "no kdf".into()))?;
    let af_json = slot
        .af
        .as_ref()
        .ok_or_else(|| LuksError::Keyslot(id, "no af".into()))?;
    let kdf = kdf_of(key, kdf_json)?;
    let place = format!("keyslot {id}");
    match kdf {
        Kdf::Argon2 {
            memory_kib, time, ..
        } => {
            if u64::from(memory_kib) > opts.max_pbkdf_memory_kib {
                return Err(LuksError::PbkdfMemoryLimit {
                    slot: id,
                    needed_kib: memory_kib.into(),
                    limit_kib: opts.max_pbkdf_memory_kib,
                });
            }
            opts.check_argon2(&place, time, memory_kib)?;
        }
        Kdf::Pbkdf2 { iterations, .. } => opts.check_pbkdf2(&place, iterations)?,
    }
    // The digest check after a successful decrypt runs PBKDF2 too.
    opts.check_pbkdf2(&format!("{place} digest"), digest.iterations)?;
    let area_key_bytes = slot.area.key_size.unwrap_or(0) as usize;
    let spec = parse_cipher(
        slot.area.encryption.as_deref().unwrap_or_default(),
        area_key_bytes,
    )?;
    let af_hash = HashAlg::parse(&af_json.hash)?;
    let key_size = slot.key_size as usize;
    let len = material_len(key_size, af_json.stripes)
        .filter(|&n| n as u64 <= slot.area.size)
        .ok_or_else(|| LuksError::Keyslot(id, "AF material does not fit the area".into()))?;
    let salt = b64(&format!("keyslots.{key}.kdf.salt"), &kdf_json.salt).map_err(corrupt)?;

    let slot_key = kdf::derive(&kdf, passphrase, &salt, area_key_bytes)?;
    let mut material = Zeroizing::new(vec![0u8; len]);
    file.read_exact_at(&mut material, slot.area.offset)
        .map_err(|e| {
            LuksError::Truncated(format!(
                "keyslot {id} area at offset {} unreadable: {e}",
                slot.area.offset
            ))
        })?;
    keyslot_area::decrypt_area(&spec, &slot_key, &mut material)?;
    let split = material
        .get(..key_size * af_json.stripes as usize)
        .unwrap_or_default();
    let volume_key = af::af_merge(split, key_size, af_json.stripes, af_hash);
    Ok(digest_matches(digest, &volume_key)?.then_some(volume_key))
}

/// Try every keyslot bound to the data segment: high priority first, "ignore" (0) last.
/// cryptsetup skips "ignore" slots unless one is named; callers here cannot name a slot, so
/// such a slot is still tried rather than made unreachable.
pub fn unlock(
    hdr: &Luks2Header,
    file: &dyn HeaderIo,
    passphrase: &[u8],
    opts: &UnlockOptions,
) -> Result<(usize, SecretKey)> {
    // A mandatory requirement we do not know may change what the segment's bytes mean
    // (e.g. a half-done reencryption), so decrypting with this key could return garbage.
    ensure_writable(hdr)?;
    let (_, digest) = hdr.segment_digest()?;
    unlock_digest(hdr, file, passphrase, opts, digest, None)
}

/// The volume key of `digest`: a known one whose fingerprint matches (no keyslot opened:
/// `None`), or the passphrase tried on its keyslots as `unlock_digest` does.
pub fn unlock_digest_with(
    hdr: &Luks2Header,
    file: &dyn HeaderIo,
    unlocker: Unlocker<'_>,
    opts: &UnlockOptions,
    digest: &Digest,
    only_slot: Option<usize>,
) -> Result<(Option<usize>, SecretKey)> {
    match unlocker {
        Unlocker::Passphrase(passphrase) => {
            unlock_digest(hdr, file, passphrase, opts, digest, only_slot)
                .map(|(slot, key)| (Some(slot), key))
        }
        Unlocker::Keys(_) => match unlocker.known(fingerprint(digest)) {
            Some(Some(key)) => Ok((None, key)),
            _ => Err(LuksError::KnownKeyStale("(LUKS2)")),
        },
    }
}

/// Try the keyslots bound to `digest` (only `only_slot` if given): high priority first,
/// "ignore" (0) last.
pub fn unlock_digest(
    hdr: &Luks2Header,
    file: &dyn HeaderIo,
    passphrase: &[u8],
    opts: &UnlockOptions,
    digest: &Digest,
    only_slot: Option<usize>,
) -> Result<(usize, SecretKey)> {
    let mut candidates: Vec<(u32, usize, &str, &Keyslot)> = digest
        .keyslots
        .iter()
        .filter_map(|k| hdr.meta.keyslots.get_key_value(k))
        .filter(|(_, s)| s.kind == "luks2")
        .filter_map(|(k, s)| {
            let id = super::json::parse_u64(k).and_then(|n| usize::try_from(n).ok())?;
            let rank = match s.priority.unwrap_or(1) {
                2 => 0,
                0 => 2,
                _ => 1,
            };
            Some((rank, id, k.as_str(), s))
        })
        .filter(|&(_, id, _, _)| only_slot.is_none_or(|want| want == id))
        .collect();
    candidates.sort_by_key(|&(rank, id, _, _)| (rank, id));
    if candidates.is_empty() {
        // Slots not bound to the data segment's digest cannot open the data either.
        return Err(LuksError::NoKeyslots);
    }
    let mut first_error = None;
    let mut tried = 0usize;
    for (_, id, key, slot) in candidates {
        match try_slot(file, id, key, slot, digest, passphrase, opts) {
            Ok(Some(vk)) => return Ok((id, vk)),
            Ok(None) => tried += 1,
            Err(e @ LuksError::Io(_)) => return Err(e),
            Err(e) => {
                tracing::debug!(keyslot = id, error = %e, "keyslot skipped");
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        // Some slot could not even be tried: report why rather than "wrong passphrase".
        Some(e)
            if tried == 0
                || matches!(
                    e,
                    LuksError::PbkdfMemoryLimit { .. } | LuksError::PbkdfCostLimit { .. }
                ) =>
        {
            Err(e)
        }
        _ => Err(LuksError::WrongPassphrase),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn material_is_whole_sectors() {
        assert_eq!(material_len(32, 4000), Some(128000));
        assert_eq!(material_len(16, 4000), Some(64000));
        assert_eq!(material_len(20, 3), Some(512));
        assert_eq!(material_len(usize::MAX, 2), None);
    }

    #[test]
    fn compares_whole_values() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
