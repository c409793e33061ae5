//! The 592-byte LUKS1 partition header: decoding, validation and encoding.
//!
//! Everything here treats the bytes as untrusted: every field is bounds-checked and every
//! size computation is checked, so a hostile header yields `Corrupt`, never a panic or a
//! huge allocation.
use crate::{LuksError, Result};

pub const PHDR_SIZE: usize = 592;
pub const MAGIC: [u8; 6] = *b"LUKS\xba\xbe";
pub const NUM_KEYSLOTS: usize = 8;
pub const SECTOR: u64 = 512;
pub const DIGEST_LEN: usize = 20;
pub const SALT_LEN: usize = 32;
pub use crate::af::STRIPES;
const KEY_ACTIVE: u32 = 0x00AC_71F3;
const KEY_DISABLED: u32 = 0x0000_DEAD;
/// cryptsetup refuses volume keys above this size; so do we, which also bounds the keyslot
/// material we ever read (MAX_KEY_BYTES * MAX_STRIPES).
pub const MAX_KEY_BYTES: u32 = 512;
const MAX_STRIPES: u32 = 65536;

const OFF_VERSION: usize = 6;
const OFF_CIPHER_NAME: usize = 8;
const OFF_CIPHER_MODE: usize = 40;
const OFF_HASH_SPEC: usize = 72;
const FIELD_LEN: usize = 32;
const OFF_PAYLOAD: usize = 104;
const OFF_KEY_BYTES: usize = 108;
const OFF_MK_DIGEST: usize = 112;
const OFF_MK_SALT: usize = 132;
const OFF_MK_ITER: usize = 164;
const OFF_UUID: usize = 168;
const UUID_LEN: usize = 40;
const OFF_KEYSLOTS: usize = 208;
const KEYSLOT_LEN: usize = 48;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyslot {
    pub active: bool,
    pub iterations: u32,
    pub salt: [u8; SALT_LEN],
    /// In 512-byte sectors from the start of the device.
    pub key_material_offset: u32,
    pub stripes: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Phdr {
    pub cipher_name: String,
    pub cipher_mode: String,
    pub hash_spec: String,
    /// In 512-byte sectors; 0 means a detached header.
    pub payload_offset: u32,
    pub key_bytes: u32,
    pub mk_digest: [u8; DIGEST_LEN],
    pub mk_digest_salt: [u8; SALT_LEN],
    pub mk_digest_iter: u32,
    pub uuid: String,
    pub keyslots: [Keyslot; NUM_KEYSLOTS],
}

fn be32(buf: &[u8; PHDR_SIZE], off: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[off..off + 4]);
    u32::from_be_bytes(b)
}

fn array<const N: usize>(buf: &[u8; PHDR_SIZE], off: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&buf[off..off + N]);
    a
}

/// A NUL-padded string field. cryptsetup writes printable ASCII; anything else is damage.
fn string_field(buf: &[u8; PHDR_SIZE], off: usize, len: usize, name: &str) -> Result<String> {
    let raw = &buf[off..off + len];
    let end = raw.iter().position(|&b| b == 0).unwrap_or(len);
    let s = &raw[..end];
    if !s.iter().all(|b| b.is_ascii_graphic()) {
        return Err(LuksError::Corrupt(format!(
            "LUKS1 {name} field is not printable ASCII"
        )));
    }
    // All bytes are ASCII, so this cannot fail; map it anyway instead of unwrapping.
    String::from_utf8(s.to_vec()).map_err(|_| LuksError::Corrupt(format!("LUKS1 {name} field")))
}

fn put_string(
    buf: &mut [u8; PHDR_SIZE],
    off: usize,
    len: usize,
    s: &str,
    name: &str,
) -> Result<()> {
    // Leave at least one NUL so readers that expect C strings stop inside the field.
    if s.len() >= len || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(LuksError::InvalidArgument(format!(
            "LUKS1 {name} '{s}' does not fit the header"
        )));
    }
    buf[off..off + s.len()].copy_from_slice(s.as_bytes());
    Ok(())
}

/// True if `buf` starts with the LUKS magic and version 1.
pub fn is_luks1(buf: &[u8]) -> bool {
    buf.len() >= 8 && buf[..6] == MAGIC && buf[OFF_VERSION..OFF_VERSION + 2] == [0, 1]
}

impl Phdr {
    pub fn decode(buf: &[u8; PHDR_SIZE]) -> Result<Self> {
        if buf[..6] != MAGIC {
            return Err(LuksError::NotLuks("no LUKS magic".into()));
        }
        let version = u16::from_be_bytes([buf[OFF_VERSION], buf[OFF_VERSION + 1]]);
        if version != 1 {
            return Err(LuksError::NotLuks(format!(
                "LUKS version {version}, expected 1"
            )));
        }
        let keyslots: [Keyslot; NUM_KEYSLOTS] = std::array::from_fn(|i| {
            let off = OFF_KEYSLOTS + i * KEYSLOT_LEN;
            Keyslot {
                active: be32(buf, off) == KEY_ACTIVE,
                iterations: be32(buf, off + 4),
                salt: array(buf, off + 8),
                key_material_offset: be32(buf, off + 40),
                stripes: be32(buf, off + 44),
            }
        });
        for i in 0..NUM_KEYSLOTS {
            let state = be32(buf, OFF_KEYSLOTS + i * KEYSLOT_LEN);
            if state != KEY_ACTIVE && state != KEY_DISABLED {
                return Err(LuksError::Corrupt(format!(
                    "keyslot {i} has invalid state {state:#010x}"
                )));
            }
        }
        let hdr = Phdr {
            cipher_name: string_field(buf, OFF_CIPHER_NAME, FIELD_LEN, "cipher name")?,
            cipher_mode: string_field(buf, OFF_CIPHER_MODE, FIELD_LEN, "cipher mode")?,
            hash_spec: string_field(buf, OFF_HASH_SPEC, FIELD_LEN, "hash spec")?,
            payload_offset: be32(buf, OFF_PAYLOAD),
            key_bytes: be32(buf, OFF_KEY_BYTES),
            mk_digest: array(buf, OFF_MK_DIGEST),
            mk_digest_salt: array(buf, OFF_MK_SALT),
            mk_digest_iter: be32(buf, OFF_MK_ITER),
            uuid: string_field(buf, OFF_UUID, UUID_LEN, "UUID")?,
            keyslots,
        };
        hdr.validate()?;
        Ok(hdr)
    }

    pub fn encode(&self) -> Result<[u8; PHDR_SIZE]> {
        self.validate()?;
        let mut buf = [0u8; PHDR_SIZE];
        buf[..6].copy_from_slice(&MAGIC);
        buf[OFF_VERSION..OFF_VERSION + 2].copy_from_slice(&1u16.to_be_bytes());
        put_string(
            &mut buf,
            OFF_CIPHER_NAME,
            FIELD_LEN,
            &self.cipher_name,
            "cipher name",
        )?;
        put_string(
            &mut buf,
            OFF_CIPHER_MODE,
            FIELD_LEN,
            &self.cipher_mode,
            "cipher mode",
        )?;
        put_string(
            &mut buf,
            OFF_HASH_SPEC,
            FIELD_LEN,
            &self.hash_spec,
            "hash spec",
        )?;
        buf[OFF_PAYLOAD..OFF_PAYLOAD + 4].copy_from_slice(&self.payload_offset.to_be_bytes());
        buf[OFF_KEY_BYTES..OFF_KEY_BYTES + 4].copy_from_slice(&self.key_bytes.to_be_bytes());
        buf[OFF_MK_DIGEST..OFF_MK_DIGEST + DIGEST_LEN].copy_from_slice(&self.mk_digest);
        buf[OFF_MK_SALT..OFF_MK_SALT + SALT_LEN].copy_from_slice(&self.mk_digest_salt);
        buf[OFF_MK_ITER..OFF_MK_ITER + 4].copy_from_slice(&self.mk_digest_iter.to_be_bytes());
        put_string(&mut buf, OFF_UUID, UUID_LEN, &self.uuid, "UUID")?;
        for (i, ks) in self.keyslots.iter().enumerate() {
            let off = OFF_KEYSLOTS + i * KEYSLOT_LEN;
            let state = if ks.active { KEY_ACTIVE } else { KEY_DISABLED };
            buf[off..off + 4].copy_from_slice(&state.to_be_bytes());
            buf[off + 4..off + 8].copy_from_slice(&ks.iterations.to_be_bytes());
            buf[off + 8..off + 40].copy_from_slice(&ks.salt);
            buf[off + 40..off + 44].copy_from_slice(&ks.key_material_offset.to_be_bytes());
            buf[off + 44..off + 48].copy_from_slice(&ks.stripes.to_be_bytes());
        }
        Ok(buf)
    }

    /// Byte range of a keyslot's material, rounded up to whole sectors as cryptsetup reads it.
    pub fn area(&self, slot: usize) -> Result<(u64, u64)> {
        let ks = self
            .keyslots
            .get(slot)
            .ok_or_else(|| LuksError::InvalidArgument(format!("no keyslot {slot}")))?;
        let start = u64::from(ks.key_material_offset) * SECTOR;
        let material = u64::from(self.key_bytes) * u64::from(ks.stripes);
        let len = material.div_ceil(SECTOR) * SECTOR;
        Ok((start, len))
    }

    /// The structural checks cryptsetup makes, plus the ones that keep us panic-free.
    fn validate(&self) -> Result<()> {
        if self.key_bytes == 0 || self.key_bytes > MAX_KEY_BYTES {
            return Err(LuksError::Corrupt(format!(
                "volume key size of {} bytes",
                self.key_bytes
            )));
        }
        if self.mk_digest_iter == 0 {
            return Err(LuksError::Corrupt(
                "volume key digest iteration count is zero".into(),
            ));
        }
        let payload = u64::from(self.payload_offset) * SECTOR;
        let mut active_areas: Vec<(usize, u64, u64)> = Vec::new();
        for (i, ks) in self.keyslots.iter().enumerate() {
            if !ks.active {
                continue;
            }
            if ks.iterations == 0 {
                return Err(LuksError::Corrupt(format!(
                    "keyslot {i} has zero PBKDF2 iterations"
                )));
            }
            if ks.stripes == 0 || ks.stripes > MAX_STRIPES {
                return Err(LuksError::Corrupt(format!(
                    "keyslot {i} has {} AF stripes",
                    ks.stripes
                )));
            }
            let (start, len) = self.area(i)?;
            if start < PHDR_SIZE as u64 {
                return Err(LuksError::Corrupt(format!(
                    "keyslot {i} material overlaps the header"
                )));
            }
            let end = start + len;
            if payload != 0 && end > payload {
                return Err(LuksError::Corrupt(format!(
                    "keyslot {i} material overlaps the payload"
                )));
            }
            if let Some((j, ..)) = active_areas.iter().find(|(_, s, e)| start < *e && *s < end) {
                return Err(LuksError::Corrupt(format!("keyslots {j} and {i} overlap")));
            }
            active_areas.push((i, start, end));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Phdr {
        let slot = |i: u32| Keyslot {
            active: i == 0,
            iterations: if i == 0 { 1000 } else { 0 },
            salt: [i as u8; SALT_LEN],
            key_material_offset: 8 + i * 504,
            stripes: STRIPES,
        };
        Phdr {
            cipher_name: "aes".into(),
            cipher_mode: "xts-plain64".into(),
            hash_spec: "sha256".into(),
            payload_offset: 4096,
            key_bytes: 64,
            mk_digest: [1; DIGEST_LEN],
            mk_digest_salt: [2; SALT_LEN],
            mk_digest_iter: 1000,
            uuid: "8f7a5a3a-6d2b-4c43-9a55-2f6f1c0c9b4e".into(),
            keyslots: std::array::from_fn(|i| slot(i as u32)),
        }
    }

    #[test]
    fn encode_decode_round_trip() {
        let h = sample();
        let buf = h.encode().unwrap();
        assert!(is_luks1(&buf));
        assert_eq!(Phdr::decode(&buf).unwrap(), h);
    }

    #[test]
    fn rejects_overlapping_and_absurd_slots() {
        let mut h = sample();
        h.keyslots[1].active = true;
        h.keyslots[1].iterations = 1000;
        h.keyslots[1].key_material_offset = 100;
        let e = h.encode().unwrap_err().to_string();
        assert!(e.contains("overlap"), "{e}");
        let mut h = sample();
        h.keyslots[0].stripes = 0;
        assert!(h.encode().is_err());
        let mut h = sample();
        h.key_bytes = u32::MAX;
        assert!(h.encode().is_err());
        let mut h = sample();
        h.keyslots[0].key_material_offset = u32::MAX;
        assert!(
            h.encode().is_err(),
            "material beyond payload must be refused"
        );
    }

    #[test]
    fn rejects_bad_state_and_strings() {
        let mut buf = sample().encode().unwrap();
        buf[OFF_KEYSLOTS + KEYSLOT_LEN] = 0x12;
        assert!(matches!(Phdr::decode(&buf), Err(LuksError::Corrupt(_))));
        let mut buf = sample().encode().unwrap();
        buf[OFF_CIPHER_NAME] = 0xff;
        assert!(matches!(Phdr::decode(&buf), Err(LuksError::Corrupt(_))));
    }
}
