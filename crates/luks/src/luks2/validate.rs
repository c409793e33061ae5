//! Structural checks on untrusted LUKS2 metadata, done once when a copy is read so the rest of
//! the module can rely on ids, ranges and encodings. Errors name the offending field.
use super::binary::BINARY_SIZE;
use super::json::{parse_u64, Metadata, SegmentSize};
use crate::HashAlg;
use base64::Engine as _;

/// cryptsetup's upper bound on the keyslots area; also bounds every allocation for key material.
pub const MAX_KEYSLOTS_SIZE: u64 = 128 * 1024 * 1024;
/// LUKS2 allows keyslot ids 0..32.
pub const MAX_KEYSLOTS: usize = 32;
/// Key sizes above this are not real ciphers and would only serve to allocate memory.
const MAX_KEY_BYTES: u32 = 512;

pub fn b64(field: &str, text: &str) -> Result<Vec<u8>, String> {
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| format!("{field}: invalid base64 ({e})"))
}

fn id(kind: &str, key: &str, max: usize) -> Result<usize, String> {
    match parse_u64(key) {
        Some(n) if (n as u128) < max as u128 && (key == "0" || !key.starts_with('0')) => {
            Ok(n as usize)
        }
        _ => Err(format!("{kind} id '{key}' is not a number below {max}")),
    }
}

fn hash(field: &str, name: &str) -> Result<HashAlg, String> {
    HashAlg::parse(name).map_err(|_| format!("{field}: unsupported hash '{name}'"))
}

/// The keyslots area as byte range [start, end) of the image.
pub fn keyslots_range(hdr_size: u64, meta: &Metadata) -> Option<(u64, u64)> {
    let start = hdr_size.checked_mul(2)?;
    Some((start, start.checked_add(meta.config.keyslots_size)?))
}

/// Where the data segments live relative to the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Header and data share one device: every segment lies behind the keyslots area.
    Attached,
    /// The header is a file of its own (cryptsetup's `--header`): segment offsets count
    /// from the start of a separate data device, so 0 is a valid one.
    Detached,
}

/// Validate metadata whose data segments follow it on the same device.
pub fn validate(meta: &Metadata, hdr_size: u64) -> Result<(), String> {
    validate_placed(meta, hdr_size, Placement::Attached)
}

pub fn validate_placed(meta: &Metadata, hdr_size: u64, placement: Placement) -> Result<(), String> {
    let json_size = hdr_size.saturating_sub(BINARY_SIZE as u64);
    if meta.config.json_size != json_size {
        return Err(format!(
            "config.json_size {} does not match the header size {hdr_size}",
            meta.config.json_size
        ));
    }
    let ks = meta.config.keyslots_size;
    if !ks.is_multiple_of(4096) || ks > MAX_KEYSLOTS_SIZE {
        return Err(format!(
            "config.keyslots_size {ks} is not a multiple of 4096 up to {MAX_KEYSLOTS_SIZE}"
        ));
    }
    let (area_start, area_end) = keyslots_range(hdr_size, meta)
        .ok_or_else(|| "config.keyslots_size overflows".to_string())?;

    let mut areas: Vec<(u64, u64, &str)> = Vec::new();
    for (key, slot) in &meta.keyslots {
        id("keyslot", key, MAX_KEYSLOTS)?;
        let f = |name: &str| format!("keyslots.{key}.{name}");
        let a = &slot.area;
        let end = a
            .offset
            .checked_add(a.size)
            .ok_or_else(|| format!("{}: offset + size overflows", f("area")))?;
        if slot.kind != "luks2" && a.size == 0 {
            // e.g. a reencrypt keyslot with area type "none": it occupies nothing.
            continue;
        }
        if a.offset < area_start || end > area_end || a.size == 0 {
            return Err(format!(
                "{}: [{}, {end}) lies outside the keyslots area [{area_start}, {area_end})",
                f("area"),
                a.offset
            ));
        }
        if !a.offset.is_multiple_of(512) || !a.size.is_multiple_of(512) {
            return Err(format!(
                "{}: offset {} or size {} is not 512-byte aligned",
                f("area"),
                a.offset,
                a.size
            ));
        }
        if let Some((_, _, other)) = areas.iter().find(|(s, e, _)| a.offset < *e && *s < end) {
            return Err(format!(
                "{} overlaps the area of keyslot {other}",
                f("area")
            ));
        }
        areas.push((a.offset, end, key));
        if slot.kind != "luks2" {
            // Other keyslot types (e.g. "reencrypt") only come with a mandatory requirement,
            // which makes the image read-only; their area is still reserved above.
            continue;
        }
        if slot.key_size == 0 || slot.key_size > MAX_KEY_BYTES {
            return Err(format!("{}: {} out of range", f("key_size"), slot.key_size));
        }
        if a.kind != "raw" {
            return Err(format!(
                "{}: unsupported area type '{}'",
                f("area.type"),
                a.kind
            ));
        }
        let enc = a
            .encryption
            .as_deref()
            .ok_or_else(|| format!("{} missing", f("area.encryption")))?;
        if enc.is_empty() {
            return Err(format!("{} is empty", f("area.encryption")));
        }
        match a.key_size {
            Some(n) if n > 0 && n <= MAX_KEY_BYTES => {}
            other => return Err(format!("{}: {other:?} out of range", f("area.key_size"))),
        }
        let af = slot
            .af
            .as_ref()
            .ok_or_else(|| format!("{} missing", f("af")))?;
        if af.kind != "luks1" {
            return Err(format!(
                "{}: unsupported AF type '{}'",
                f("af.type"),
                af.kind
            ));
        }
        hash(&f("af.hash"), &af.hash)?;
        u64::from(slot.key_size)
            .checked_mul(u64::from(af.stripes))
            .filter(|&n| af.stripes > 0 && n <= a.size)
            .ok_or_else(|| {
                format!(
                    "{}: {} stripes of {} bytes do not fit the area",
                    f("af.stripes"),
                    af.stripes,
                    slot.key_size
                )
            })?;
        let kdf = slot
            .kdf
            .as_ref()
            .ok_or_else(|| format!("{} missing", f("kdf")))?;
        if b64(&f("kdf.salt"), &kdf.salt)?.is_empty() {
            return Err(format!("{} is empty", f("kdf.salt")));
        }
        match kdf.kind.as_str() {
            "pbkdf2" => {
                hash(&f("kdf.hash"), kdf.hash.as_deref().unwrap_or("(missing)"))?;
                if kdf.iterations.unwrap_or(0) == 0 {
                    return Err(format!("{} missing or zero", f("kdf.iterations")));
                }
            }
            "argon2i" | "argon2id" | "argon2" => {
                for (name, v) in [
                    ("time", kdf.time),
                    ("memory", kdf.memory),
                    ("cpus", kdf.cpus),
                ] {
                    if v.unwrap_or(0) == 0 {
                        return Err(format!("{} missing or zero", f(&format!("kdf.{name}"))));
                    }
                }
            }
            other => return Err(format!("{}: unsupported KDF '{other}'", f("kdf.type"))),
        }
        if let Some(p) = slot.priority {
            if p > 2 {
                return Err(format!("{}: {p} is not 0, 1 or 2", f("priority")));
            }
        }
    }

    for (key, seg) in &meta.segments {
        id("segment", key, usize::MAX)?;
        let f = |name: &str| format!("segments.{key}.{name}");
        // An in-place encryption's `backup-previous` describes the plaintext as it was,
        // from offset 0, before the header took its place.
        let plaintext_backup = seg.kind == "linear" && seg.is_backup();
        if placement == Placement::Attached && seg.offset < area_end && !plaintext_backup {
            return Err(format!(
                "{}: {} lies inside the header and keyslots area (ends at {area_end}): this header describes data on another device (a detached header, cryptsetup's --header); give the data image separately (`cryptblk reencrypt --header THIS-FILE IMAGE`)",
                f("offset"),
                seg.offset
            ));
        }
        if seg.kind != "crypt" {
            continue;
        }
        let sector = seg
            .sector_size
            .ok_or_else(|| format!("{} missing", f("sector_size")))?;
        if !(512..=4096).contains(&sector) || !sector.is_power_of_two() {
            return Err(format!(
                "{}: {sector} is not a power of two from 512 to 4096",
                f("sector_size")
            ));
        }
        if !seg.offset.is_multiple_of(u64::from(sector)) {
            return Err(format!(
                "{}: {} is not a multiple of the sector size",
                f("offset"),
                seg.offset
            ));
        }
        if let SegmentSize::Fixed(n) = seg.size {
            if !n.is_multiple_of(u64::from(sector)) || seg.offset.checked_add(n).is_none() {
                return Err(format!(
                    "{}: {n} is not a whole number of sectors",
                    f("size")
                ));
            }
        }
        if seg.encryption.as_deref().unwrap_or("").is_empty() {
            return Err(format!("{} missing", f("encryption")));
        }
        if seg.iv_tweak.is_none() {
            return Err(format!("{} missing", f("iv_tweak")));
        }
    }

    for (key, d) in &meta.digests {
        id("digest", key, usize::MAX)?;
        let f = |name: &str| format!("digests.{key}.{name}");
        if d.kind != "pbkdf2" {
            return Err(format!(
                "{}: unsupported digest type '{}'",
                f("type"),
                d.kind
            ));
        }
        hash(&f("hash"), &d.hash)?;
        if d.iterations == 0 {
            return Err(format!("{} is zero", f("iterations")));
        }
        if b64(&f("salt"), &d.salt)?.is_empty() {
            return Err(format!("{} is empty", f("salt")));
        }
        let digest = b64(&f("digest"), &d.digest)?;
        if digest.is_empty() || digest.len() > 64 {
            return Err(format!("{}: {} bytes", f("digest"), digest.len()));
        }
        for k in &d.keyslots {
            if !meta.keyslots.contains_key(k) {
                return Err(format!("{}: keyslot '{k}' does not exist", f("keyslots")));
            }
        }
        for s in &d.segments {
            if !meta.segments.contains_key(s) {
                return Err(format!("{}: segment '{s}' does not exist", f("segments")));
            }
        }
    }
    for (key, tok) in &meta.tokens {
        id("token", key, usize::MAX)?;
        if !tok.is_object() {
            return Err(format!("tokens.{key} is not an object"));
        }
    }
    Ok(())
}
