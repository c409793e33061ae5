//! The start of an encryption in place (see `encrypt.rs` for the whole scheme): the new
//! header formatted in memory for an image of a given length, with the first hotzone's
//! plaintext copied to the end of the file (`backup-moved-segment`), then written in one go
//! ([`encrypt_prepare`], [`PreparedEncryption::apply`], [`encrypt_init`]).

use super::{digest, FLAG_BACKUP_FINAL, FLAG_BACKUP_MOVED, FLAG_BACKUP_PREVIOUS, REQUIREMENT_V2};
use crate::io::HeaderIo;
use crate::luks2::json::{Area, Keyslot, Requirements, Segment, SegmentSize};
use crate::luks2::Luks2Header;
use crate::{FormatOptions, LuksError, Result};
use cryptblk_crypto::SecretKey;
use serde_json::Value;
use std::cell::RefCell;
use zeroize::Zeroizing;

/// cryptsetup's ceiling for `--reduce-device-size`.
pub const MAX_REDUCE: u64 = 1 << 30;
/// The two copies of the binary header and JSON area (16 KiB each).
const METADATA: u64 = 2 * 16 * 1024;
/// The datashift keyslot area cryptsetup allocates (it holds nothing).
const DATASHIFT_AREA: u64 = 4096;

/// What `--encrypt` needs.
#[derive(Debug, Clone)]
pub struct EncryptParams {
    /// Cipher, key size, sector size, hash and KDF of the new header.
    pub format: FormatOptions,
    /// `--reduce-device-size`: the header gets half of it, the data shift is the other half.
    pub reduce: u64,
}

/// The smallest `--reduce-device-size` whose half holds the header, one keyslot of
/// `key_bytes` and the datashift area.
pub fn min_reduce(key_bytes: usize) -> u64 {
    let material = (key_bytes as u64 * 4000).div_ceil(4096) * 4096;
    2 * (METADATA + material + DATASHIFT_AREA)
}

/// An image-sized buffer the new header is formatted into, so the file itself is written
/// once, after the data it covers has been moved (cryptsetup formats a temporary header
/// file and restores it the same way).
struct MemIo(RefCell<Vec<u8>>);

impl HeaderIo for MemIo {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let v = self.0.borrow();
        let s = usize::try_from(offset).unwrap_or(usize::MAX);
        let src = v
            .get(s..s.saturating_add(buf.len()))
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let mut v = self.0.borrow_mut();
        let s = usize::try_from(offset).unwrap_or(usize::MAX);
        let dst = v
            .get_mut(s..s.saturating_add(buf.len()))
            .ok_or(std::io::ErrorKind::WriteZero)?;
        dst.copy_from_slice(buf);
        Ok(())
    }
    fn size(&self) -> std::io::Result<u64> {
        Ok(self.0.borrow().len() as u64)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        if len == self.size()? {
            Ok(())
        } else {
            Err(std::io::ErrorKind::InvalidInput.into())
        }
    }
    fn sync_data(&self) -> std::io::Result<()> {
        Ok(())
    }
}

fn invalid(msg: String) -> LuksError {
    LuksError::InvalidArgument(msg)
}

fn linear(offset: u64, size: u64, flag: Option<&str>) -> Segment {
    let mut extra = serde_json::Map::new();
    if let Some(f) = flag {
        extra.insert("flags".into(), Value::from(vec![f]));
    }
    Segment {
        kind: "linear".into(),
        offset,
        size: SegmentSize::Fixed(size),
        iv_tweak: None,
        encryption: None,
        sector_size: None,
        extra,
    }
}

/// Start encrypting the plaintext image `file`: move its first `S` bytes to the end and
/// write a LUKS2 header in reencryption state over them. Returns the header.
pub fn encrypt_init(
    file: &dyn HeaderIo,
    passphrase: &[u8],
    params: &EncryptParams,
) -> Result<Luks2Header> {
    encrypt_prepare(file.size()?, passphrase, params)?.apply(file)
}

/// A header made for the encryption of an image of a given length, not yet written: the
/// first half of `encrypt_init`, which holds the slow part (the keyslot's key derivation)
/// and touches no file, so a served disk is fenced off only for `apply`'s copy and write.
pub struct PreparedEncryption {
    hdr: Luks2Header,
    /// The header and keyslots area, `shift` bytes, as they go to the image's head.
    image: Vec<u8>,
    /// The image's length the header was made for.
    len: u64,
    /// Where the plaintext the header covers goes, and how much of it there is.
    moved_at: u64,
    moved_len: u64,
}

impl std::fmt::Debug for PreparedEncryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedEncryption")
            .field("len", &self.len)
            .field("moved_at", &self.moved_at)
            .field("moved_len", &self.moved_len)
            .finish_non_exhaustive()
    }
}

impl PreparedEncryption {
    /// Move the plaintext the header covers to the end of `file` (durably), then write the
    /// header over it. `file` must have the length the header was made for. When the
    /// header's write fails, the plaintext is put back at the head (a torn write leaves
    /// neither the disk nor a LUKS2 image otherwise); the copy at the end stays.
    pub fn apply(self, file: &dyn HeaderIo) -> Result<Luks2Header> {
        let len = file.size()?;
        if len != self.len {
            return Err(invalid(format!(
                "the image is {len} bytes, the encryption header was made for {}",
                self.len
            )));
        }
        // cryptsetup's order: a crash between the two leaves a plaintext image whose first
        // S bytes are also at the end.
        let mut head = Zeroizing::new(vec![0u8; self.moved_len as usize]);
        crate::io::read_at(file, 0, &mut head, "plaintext to move")?;
        file.write_all_at(&head, self.moved_at)?;
        file.sync_data()?;
        let written = file
            .write_all_at(&self.image, 0)
            .and_then(|()| file.sync_data());
        if let Err(e) = written {
            // Best effort: the error that matters is the header's.
            let _ = file.write_all_at(&head, 0).and_then(|()| file.sync_data());
            return Err(e.into());
        }
        Ok(self.hdr)
    }

    /// The header `apply` writes.
    pub fn header(&self) -> &Luks2Header {
        &self.hdr
    }
}

/// Make the header that starts encrypting an image of `len` bytes (its new volume key, the
/// keyslot for `passphrase`, the reencryption metadata), without touching the image: the
/// limits `encrypt_init` checks are checked here.
pub fn encrypt_prepare(
    len: u64,
    passphrase: &[u8],
    params: &EncryptParams,
) -> Result<PreparedEncryption> {
    let reduce = params.reduce;
    let ss = u64::from(params.format.sector_size);
    let min = min_reduce(params.format.cipher.key_bytes());
    if reduce < min || reduce > MAX_REDUCE || !reduce.is_multiple_of(2 * ss.max(512)) {
        return Err(invalid(format!(
            "--reduce-device-size {reduce}: use a multiple of {} bytes from {min} (the LUKS2 header with one keyslot takes half of it) to {MAX_REDUCE}; cryptsetup recommends 32M",
            2 * ss.max(512)
        )));
    }
    let shift = reduce / 2;
    let data = len.checked_sub(reduce).filter(|&d| d > 0).ok_or_else(|| {
        invalid(format!(
            "the image ({len} bytes) is too small to encrypt with --reduce-device-size {reduce}: nothing of it would be left"
        ))
    })?;
    if !(len - shift).is_multiple_of(ss) {
        return Err(invalid(format!(
            "the image size {len} minus half of --reduce-device-size is not a whole number of {ss}-byte sectors"
        )));
    }

    let new_key = SecretKey::random(params.format.cipher.key_bytes())?;
    let mem = MemIo(RefCell::new(vec![0u8; shift as usize]));
    let mut hdr = Luks2Header::format_at(&mem, &params.format, passphrase, &new_key, None, shift)?;
    let mut meta = hdr.meta.clone();
    let (_, fin) = hdr.segment().map(|(i, s)| (i.to_string(), s.clone()))?;
    // The datashift keyslot area: the first free 4 KiB after keyslot 0.
    let area_offset = meta
        .keyslots
        .values()
        .map(|k| (k.area.offset + k.area.size).div_ceil(4096) * 4096)
        .max()
        .unwrap_or(METADATA);
    if area_offset + DATASHIFT_AREA > METADATA + meta.config.keyslots_size {
        return Err(invalid(format!(
            "--reduce-device-size {reduce} leaves no room for the reencryption keyslot; use at least {min}"
        )));
    }

    // Live: the moved first part, then the rest in place; backups as cryptsetup orders them.
    // (Less plaintext than the shift: all of it is moved, and lands right after its copy.)
    let moved_at = len - shift;
    let moved_len = shift.min(data);
    let mut segments = std::collections::BTreeMap::new();
    segments.insert("0".to_string(), linear(moved_at, moved_len, None));
    let mut next = 1;
    if data > shift {
        segments.insert("1".to_string(), linear(shift, data - shift, None));
        next = 2;
    }
    segments.insert(
        next.to_string(),
        linear(moved_at, moved_len, Some(FLAG_BACKUP_MOVED)),
    );
    segments.insert(
        (next + 1).to_string(),
        linear(0, data, Some(FLAG_BACKUP_PREVIOUS)),
    );
    let mut final_seg = fin;
    final_seg
        .extra
        .insert("flags".into(), Value::from(vec![FLAG_BACKUP_FINAL]));
    segments.insert((next + 2).to_string(), final_seg);
    meta.segments = segments;
    for d in meta.digests.values_mut() {
        d.segments = vec![(next + 2).to_string()];
    }

    let mut area_extra = serde_json::Map::new();
    area_extra.insert("shift_size".into(), Value::from(shift.to_string()));
    let mut slot_extra = serde_json::Map::new();
    slot_extra.insert("mode".into(), Value::from("encrypt"));
    slot_extra.insert("direction".into(), Value::from("backward"));
    let slot_id = "1".to_string();
    meta.keyslots.insert(
        slot_id.clone(),
        Keyslot {
            kind: "reencrypt".into(),
            key_size: 1,
            af: None,
            area: Area {
                kind: "datashift".into(),
                offset: area_offset,
                size: DATASHIFT_AREA,
                encryption: None,
                key_size: None,
                extra: area_extra,
            },
            kdf: None,
            priority: Some(0),
            extra: slot_extra,
        },
    );
    meta.config.requirements = Some(Requirements {
        mandatory: vec![REQUIREMENT_V2.into()],
        extra: Default::default(),
    });
    digest::bind(
        &mut meta,
        "1",
        &slot_id,
        None,
        Some(&new_key),
        &params.format.pbkdf,
    )?;
    hdr.meta = meta;
    hdr.commit(&mem)?;
    Ok(PreparedEncryption {
        hdr,
        image: mem.0.into_inner(),
        len,
        moved_at,
        moved_len,
    })
}
