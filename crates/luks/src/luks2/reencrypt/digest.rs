//! The reencryption digest: a PBKDF2 digest (like a volume-key digest) over a byte string
//! made of a version tag, both volume keys, the reencrypt keyslot's parameters and the backup
//! segments. It stops anyone who can edit the JSON (and fix its checksum) from steering a
//! reencryption, e.g. by swapping the old and new segment, without knowing the keys.
//!
//! Byte layout (cryptsetup 2.4+): 'v', '0' + version (the requirement's: 2, or 3 for a
//! decryption with a data shift, cryptsetup 2.7, whose layout is otherwise the same); the old key, then the new key (each only
//! if it exists, the new one only if it differs); the keyslot's mode, direction, area type,
//! area offset and size (plus hash and block size for checksum types, shift size for datashift
//! types); then the previous, final and (if present) moved backup segments, each as type,
//! offset, size, and for crypt segments iv_tweak, encryption and sector size. Strings are raw
//! bytes (1..=64 of them, no terminator), 64-bit numbers big-endian, sector sizes 32-bit
//! big-endian, and a "dynamic" size the literal word.
use super::{ReencryptState, Resilience};
use crate::luks2::json::{Digest, Metadata, Segment, SegmentSize};
use crate::luks2::unlock::digest_matches;
use crate::luks2::write::{b64, random_bytes, SALT_BYTES};
use crate::{kdf, kdf_cost, HashAlg, LuksError, PbkdfOptions, Result};
use cryptblk_crypto::SecretKey;
use zeroize::Zeroizing;

const MAX_STR: usize = 64;

fn corrupt(msg: String) -> LuksError {
    LuksError::Corrupt(format!("reencryption digest input: {msg}"))
}

fn put_str(out: &mut Vec<u8>, s: &str, what: &str) -> Result<()> {
    if s.is_empty() || s.len() > MAX_STR {
        return Err(corrupt(format!(
            "{what} '{s}' is empty or longer than {MAX_STR} bytes"
        )));
    }
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

fn put_segment(out: &mut Vec<u8>, id: &str, seg: &Segment) -> Result<()> {
    put_str(out, &seg.kind, "segment type")?;
    out.extend_from_slice(&seg.offset.to_be_bytes());
    match seg.size {
        SegmentSize::Dynamic => out.extend_from_slice(b"dynamic"),
        SegmentSize::Fixed(n) => out.extend_from_slice(&n.to_be_bytes()),
    }
    match seg.kind.as_str() {
        "linear" => Ok(()),
        "crypt" => {
            let iv = seg
                .iv_tweak
                .ok_or_else(|| corrupt(format!("segment {id} has no iv_tweak")))?;
            out.extend_from_slice(&iv.to_be_bytes());
            put_str(
                out,
                seg.encryption.as_deref().unwrap_or_default(),
                "segment encryption",
            )?;
            let ss = seg
                .sector_size
                .ok_or_else(|| corrupt(format!("segment {id} has no sector_size")))?;
            out.extend_from_slice(&ss.to_be_bytes());
            Ok(())
        }
        other => Err(corrupt(format!("segment {id} has type '{other}'"))),
    }
}

/// The byte string the digest covers. It holds key material, hence `Zeroizing`.
pub(super) fn verification_data(
    meta: &Metadata,
    state: &ReencryptState,
    old_key: Option<&SecretKey>,
    new_key: Option<&SecretKey>,
) -> Result<Zeroizing<Vec<u8>>> {
    let mut out = Zeroizing::new(Vec::with_capacity(1024));
    out.push(b'v');
    out.push(0x30 + state.version);
    let mut any_key = false;
    if state.digest_old.is_some() {
        let k = old_key
            .ok_or_else(|| LuksError::InvalidArgument("the old volume key is needed".into()))?;
        out.extend_from_slice(k.as_bytes());
        any_key = true;
    }
    if state.digest_new.is_some() && state.digest_new != state.digest_old {
        let k = new_key
            .ok_or_else(|| LuksError::InvalidArgument("the new volume key is needed".into()))?;
        out.extend_from_slice(k.as_bytes());
        any_key = true;
    }
    if !any_key {
        return Err(corrupt(
            "neither backup segment has a volume key digest".into(),
        ));
    }
    let slot = meta
        .keyslots
        .get(&state.keyslot)
        .ok_or_else(|| corrupt(format!("keyslot {} vanished", state.keyslot)))?;
    put_str(&mut out, state.mode.name(), "mode")?;
    let dir = slot
        .extra
        .get("direction")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    put_str(&mut out, dir, "direction")?;
    put_str(&mut out, &slot.area.kind, "area type")?;
    out.extend_from_slice(&slot.area.offset.to_be_bytes());
    out.extend_from_slice(&slot.area.size.to_be_bytes());
    let area_extra = &slot.area.extra;
    let checksum = |out: &mut Vec<u8>| -> Result<()> {
        let hash = area_extra
            .get("hash")
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        put_str(out, hash, "checksum hash")?;
        let bs = area_extra
            .get("sector_size")
            .and_then(|v| v.as_u64())
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| corrupt("checksum sector_size".into()))?;
        out.extend_from_slice(&bs.to_be_bytes());
        Ok(())
    };
    match &state.resilience {
        Resilience::None | Resilience::Journal => {}
        Resilience::Checksum { .. } => checksum(&mut out)?,
        Resilience::Datashift { shift } | Resilience::DatashiftJournal { shift } => {
            out.extend_from_slice(&shift.to_be_bytes())
        }
        Resilience::DatashiftChecksum { shift, .. } => {
            checksum(&mut out)?;
            out.extend_from_slice(&shift.to_be_bytes());
        }
    }
    let mut ids = vec![&state.segment_old, &state.segment_new];
    ids.extend(state.segment_moved.as_ref());
    for id in ids {
        let seg = meta
            .segments
            .get(id)
            .ok_or_else(|| corrupt(format!("segment {id} vanished")))?;
        put_segment(&mut out, id, seg)?;
    }
    Ok(out)
}

/// Check the stored reencryption digest against the metadata and both keys.
pub(super) fn verify(
    meta: &Metadata,
    state: &ReencryptState,
    old_key: Option<&SecretKey>,
    new_key: Option<&SecretKey>,
) -> Result<()> {
    let digest = meta
        .digests
        .get(&state.digest_reencrypt)
        .ok_or_else(|| corrupt(format!("digest {} vanished", state.digest_reencrypt)))?;
    let data = verification_data(meta, state, old_key, new_key)?;
    if digest_matches(digest, &SecretKey::from_slice(&data))? {
        Ok(())
    } else {
        Err(LuksError::Corrupt(
            "the reencryption digest does not match the reencryption metadata and volume keys: the metadata was changed by something that does not hold the keys; refusing to use it".into(),
        ))
    }
}

/// A new digest over the current metadata (for a reencryption cryptblk starts).
/// Binds the reencryption keyslot `slot` of `meta` to the volume keys with digest `id`, over
/// the reencryption metadata as it now stands (the rest of it must be final). A placeholder
/// under `id` first makes the state parse; the digest then replaces it.
pub(super) fn bind(
    meta: &mut Metadata,
    id: &str,
    slot: &str,
    old_key: Option<&SecretKey>,
    new_key: Option<&SecretKey>,
    pbkdf: &PbkdfOptions,
) -> Result<()> {
    meta.digests.insert(
        id.to_string(),
        Digest {
            kind: "pbkdf2".into(),
            keyslots: vec![slot.to_string()],
            segments: Vec::new(),
            hash: "sha256".into(),
            iterations: 1000,
            salt: b64(&[0u8; 32]),
            digest: b64(&[0u8; 32]),
            extra: Default::default(),
        },
    );
    let state = ReencryptState::parse(meta)?
        .ok_or_else(|| LuksError::Corrupt("reencryption state not built".into()))?;
    let rd = create(meta, &state, old_key, new_key, pbkdf)?;
    meta.digests.insert(id.to_string(), rd);
    Ok(())
}

pub(super) fn create(
    meta: &Metadata,
    state: &ReencryptState,
    old_key: Option<&SecretKey>,
    new_key: Option<&SecretKey>,
    pbkdf: &PbkdfOptions,
) -> Result<Digest> {
    let data = verification_data(meta, state, old_key, new_key)?;
    let hash = HashAlg::Sha256;
    let iterations = kdf_cost::digest_iterations(hash, pbkdf, data.len())?;
    let salt = random_bytes(SALT_BYTES)?;
    let value = kdf::derive(
        &kdf::Kdf::Pbkdf2 { hash, iterations },
        &data,
        &salt,
        hash.digest_len(),
    )?;
    Ok(Digest {
        kind: "pbkdf2".into(),
        keyslots: vec![state.keyslot.clone()],
        segments: Vec::new(),
        hash: hash.name().into(),
        iterations,
        salt: b64(&salt),
        digest: b64(value.as_bytes()),
        extra: Default::default(),
    })
}
