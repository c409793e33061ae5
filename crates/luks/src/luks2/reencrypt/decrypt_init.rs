//! Starting a decryption to a detached header (`cryptsetup reencrypt --decrypt --header FILE
//! IMAGE`, 2.7): the layout and the commit order are in `decrypt.rs`. Init writes, in this
//! order, each step synced before the next: the header and keyslots area copied to FILE (a
//! crash leaves an intact image plus a copy of its header); the image's LUKS2 magics wiped;
//! the first `moved_len` bytes of ciphertext copied from the old data offset to offset 0 (the
//! header copy in FILE still describes the untouched data at the old offset); then FILE's one
//! header commit that starts the reencryption. A step that fails (an I/O error, not a crash)
//! puts the header back into the image, which is then as it was.
use super::init::{first_free, largest_gap};
use super::{digest, FLAG_BACKUP_FINAL, FLAG_BACKUP_MOVED, FLAG_BACKUP_PREVIOUS, REQUIREMENT_V3};
use crate::io::HeaderIo;
use crate::luks2::json::{Area, Keyslot, Requirements, Segment, SegmentSize};
use crate::luks2::validate::{keyslots_range, Placement, MAX_KEYSLOTS};
use crate::luks2::Luks2Header;
use crate::{HashAlg, LuksError, PbkdfOptions, Result, UnlockOptions};
use serde_json::Value;
use zeroize::Zeroizing;

/// cryptsetup's default moved segment: the data shift, at most 20 MiB
/// (LUKS2_DEFAULT_NONE_REENCRYPTION_LENGTH).
pub const DEFAULT_MOVED_MAX: u64 = 20 << 20;

/// How the moved segment (decrypted in place, last) is protected against a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MovedResilience {
    /// `datashift-checksum` (cryptsetup's default): a hash of each 4 KiB block of its
    /// ciphertext (`--resilience-hash`, sha256 by default).
    Checksum(HashAlg),
    /// `datashift-journal` (`--resilience journal`): its ciphertext itself.
    Journal,
}

/// What `--decrypt --header FILE` needs.
#[derive(Debug, Clone)]
pub struct DecryptParams {
    pub resilience: MovedResilience,
    /// `--hotzone-size`: the moved segment's length; `None` for cryptsetup's default.
    pub moved_len: Option<u64>,
    /// The keyslot the passphrase must open (`--key-slot`).
    pub keyslot: Option<usize>,
    /// Cost of the reencryption digest (a PBKDF2 digest, as a volume key digest).
    pub pbkdf: PbkdfOptions,
}

fn invalid(msg: String) -> LuksError {
    LuksError::InvalidArgument(msg)
}

fn flagged(mut seg: Segment, flag: &str) -> Segment {
    seg.extra.insert("flags".into(), Value::from(vec![flag]));
    seg
}

/// Start decrypting `image` (a LUKS2 image with its header at its head) to the detached
/// header `header_out` (an empty file the caller created). Returns the detached header.
pub fn decrypt_init(
    image: &dyn HeaderIo,
    header_out: &dyn HeaderIo,
    passphrase: &[u8],
    unlock: &UnlockOptions,
    params: &DecryptParams,
) -> Result<Luks2Header> {
    let (hdr, _) = Luks2Header::read(image)?;
    crate::luks2::ensure_writable(&hdr)?;
    let (seg_id, seg) = hdr.segment().map(|(i, s)| (i.to_string(), s.clone()))?;
    if seg_id != "0" || seg.size != SegmentSize::Dynamic || seg.iv_tweak.unwrap_or(0) != 0 {
        return Err(LuksError::Unsupported {
            what: "data segment",
            name: format!("{seg_id} ({:?})", seg.size),
            hint: "cryptblk decrypts images whose one data segment runs to the end of the file"
                .into(),
        });
    }
    let (_, digest) = hdr.segment_digest()?;
    let (_, old_key) = crate::luks2::unlock::unlock_digest(
        &hdr,
        image,
        passphrase,
        unlock,
        digest,
        params.keyslot,
    )?;
    let (old_digest, _) = hdr
        .segment_digest()
        .map(|(i, d)| (i.to_string(), d.clone()))?;

    let shift = seg.offset;
    let sector = u64::from(seg.sector_size.unwrap_or(512));
    let block = sector.max(4096);
    let image_len = image.size()?;
    let data_size = image_len
        .checked_sub(shift)
        .map(|n| n - n % sector)
        .filter(|&n| n > 0)
        .ok_or_else(|| invalid(format!("the image ({image_len} bytes) holds no data")))?;
    let moved_len = match params.moved_len {
        Some(n) if n == 0 || !n.is_multiple_of(block) || n > shift => {
            return Err(invalid(format!(
                "--hotzone-size {n}: the moved segment must be a positive multiple of {block} bytes up to the data offset ({shift})"
            )))
        }
        Some(n) => n,
        None => shift.min(DEFAULT_MOVED_MAX),
    }
    .min(data_size);
    if !moved_len.is_multiple_of(block) {
        return Err(invalid(format!(
            "the volume ({data_size} bytes) is not a whole number of {block}-byte checksum blocks"
        )));
    }

    let mut meta = hdr.meta.clone();
    // Live: the moved copy at 0, the rest where it is; backups as cryptsetup orders them.
    let mut first = seg.clone();
    first.offset = 0;
    first.size = SegmentSize::Fixed(moved_len);
    first.extra.remove("flags");
    let mut segments = std::collections::BTreeMap::new();
    segments.insert("0".to_string(), first.clone());
    if data_size > moved_len {
        let mut rest = first.clone();
        rest.offset = shift + moved_len;
        rest.size = SegmentSize::Dynamic;
        rest.iv_tweak = Some(moved_len / 512);
        segments.insert("1".to_string(), rest);
    }
    let next = segments.len();
    segments.insert(next.to_string(), flagged(first, FLAG_BACKUP_MOVED));
    segments.insert(
        (next + 1).to_string(),
        flagged(seg.clone(), FLAG_BACKUP_PREVIOUS),
    );
    let plain = Segment {
        kind: "linear".into(),
        offset: 0,
        size: SegmentSize::Dynamic,
        iv_tweak: None,
        encryption: None,
        sector_size: None,
        extra: Default::default(),
    };
    segments.insert((next + 2).to_string(), flagged(plain, FLAG_BACKUP_FINAL));
    if let Some(d) = meta.digests.get_mut(&old_digest) {
        d.segments = (0..=next + 1).map(|i| i.to_string()).collect();
    }
    meta.segments = segments;

    // The reencrypt keyslot: the largest free gap of the keyslots area holds the checksums.
    let slot_id = (0..MAX_KEYSLOTS)
        .map(|i| i.to_string())
        .find(|i| !meta.keyslots.contains_key(i))
        .ok_or_else(|| {
            invalid(
                "all keyslots are in use; remove one to make room for the reencryption keyslot"
                    .into(),
            )
        })?;
    let (start, end) = keyslots_range(hdr.bin.hdr_size, &meta)
        .ok_or_else(|| LuksError::Corrupt("keyslots area overflows".into()))?;
    let (area_offset, area_size) = largest_gap(&meta, start, end);
    let mut area_extra = serde_json::Map::new();
    let (kind, protects) = match params.resilience {
        MovedResilience::Checksum(hash) => {
            area_extra.insert("hash".into(), Value::from(hash.name()));
            area_extra.insert("sector_size".into(), Value::from(block));
            (
                "datashift-checksum",
                area_size / hash.digest_len() as u64 * block,
            )
        }
        MovedResilience::Journal => ("datashift-journal", area_size),
    };
    if protects < moved_len {
        return Err(invalid(format!(
            "the free keyslots area ({area_size} bytes) protects {protects} bytes with {kind}, the moved segment is {moved_len}; use a smaller --hotzone-size"
        )));
    }
    area_extra.insert("shift_size".into(), Value::from(shift.to_string()));
    let mut slot_extra = serde_json::Map::new();
    slot_extra.insert("mode".into(), Value::from("decrypt"));
    slot_extra.insert("direction".into(), Value::from("forward"));
    meta.keyslots.insert(
        slot_id.clone(),
        Keyslot {
            kind: "reencrypt".into(),
            key_size: 1,
            af: None,
            area: Area {
                kind: kind.into(),
                offset: area_offset,
                size: area_size,
                encryption: None,
                key_size: None,
                extra: area_extra,
            },
            kdf: None,
            priority: Some(0),
            extra: slot_extra,
        },
    );
    meta.config
        .requirements
        .get_or_insert_with(|| Requirements {
            mandatory: Vec::new(),
            extra: Default::default(),
        })
        .mandatory
        .push(REQUIREMENT_V3.into());
    let rd_id = first_free(&meta.digests).to_string();
    digest::bind(
        &mut meta,
        &rd_id,
        &slot_id,
        Some(&old_key),
        None,
        &params.pbkdf,
    )?;
    drop(old_key);

    // 1. The header and keyslots area to FILE, as `luksHeaderBackup` writes it; the copy in
    //    memory puts the image back should a later step fail (cryptsetup restores it too).
    let mut original = vec![0u8; end as usize];
    crate::io::read_at(image, 0, &mut original, "LUKS2 header and keyslots area")?;
    header_out.set_len(end)?;
    header_out.write_all_at(&original, 0)?;
    header_out.sync_all()?;
    let hdr_size = hdr.bin.hdr_size;
    let started = (|| -> Result<Luks2Header> {
        // 2. The image is no LUKS device any more (the copy in FILE describes it).
        for at in [0, hdr_size] {
            image.write_all_at(&[0u8; 6], at)?;
        }
        image.sync_data()?;
        // 3. The first moved_len bytes of ciphertext to offset 0.
        let mut moved = Zeroizing::new(vec![0u8; moved_len as usize]);
        crate::io::read_at(image, shift, &mut moved, "ciphertext to move")?;
        image.write_all_at(&moved, 0)?;
        image.sync_data()?;
        drop(moved);
        // 4. One commit in FILE starts the decryption.
        let mut hdr = hdr;
        hdr.placement = Placement::Detached;
        hdr.meta = meta;
        hdr.commit(header_out)?;
        Ok(hdr)
    })();
    if started.is_err() {
        // The data at the old offset is untouched until the commit: the old header makes it
        // the image it was (best effort: the error that stopped the init is the one to see).
        let _ = image
            .write_all_at(&original, 0)
            .and_then(|()| image.sync_data());
    }
    started
}
