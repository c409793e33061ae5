//! Converting a LUKS1 header to LUKS2 in place, as `cryptsetup convert --type luks2` does.
//!
//! The volume key, the payload and its offset stay as they are: the LUKS1 keyslots become
//! LUKS2 keyslots of type `luks2` with a `pbkdf2` KDF and a `luks1` anti-forensic split
//! (4000 stripes), the master-key digest becomes a `pbkdf2` digest, and one `crypt` segment
//! starts at the old payload offset with 512-byte sectors. Nothing needs the passphrase.
//!
//! Two placements of the keyslot material:
//! - **Shifted** (cryptsetup's, whenever it fits): the LUKS2 headers need the first 32 KiB,
//!   where LUKS1 keeps keyslot material from 4 KiB on, so everything from 4 KiB to the end of
//!   the last keyslot area moves up by 28 KiB. The result equals cryptsetup's byte for byte
//!   except the binary headers' random salts and checksums and the JSON's key order.
//!   Crash window as cryptsetup's: between the move and the header write neither header is
//!   usable, so keep a header backup.
//! - **Compacted** (when the shift does not fit, as in every QEMU-made image, whose payload
//!   starts right after the eighth keyslot area; cryptsetup refuses those): each *active*
//!   keyslot's material is copied to a free place in the LUKS2 keyslots area that overlaps no
//!   active LUKS1 material, synced, and only then is the header written, so until that last
//!   write the LUKS1 header still opens the image. The old copies are wiped afterwards.
use super::binary::{BinaryHeader, BINARY_SIZE, CSUM_LEN, SALT_LEN};
use super::json::{Af, Area, Config, Digest, KdfJson, Keyslot, Metadata, Segment, SegmentSize};
use super::validate::{validate, MAX_KEYSLOTS_SIZE};
use super::write::{b64, random_bytes};
use super::Luks2Header;
use crate::io::{read_at, zero_range, HeaderIo};
use crate::luks1::phdr::{Phdr, SECTOR, STRIPES};
use crate::luks1::{cipher_error, Luks1Header};
use crate::{HashAlg, LuksError, Result};
use cryptblk_crypto::CipherSpec;
use std::collections::BTreeMap;
use zeroize::Zeroizing;

/// One LUKS2 header copy (binary header + JSON area), as cryptsetup's conversion writes it.
const HDR_SIZE: u64 = 16 * 1024;
/// Where LUKS2 keyslots begin: behind both header copies.
const KEYSLOTS_START: u64 = 2 * HDR_SIZE;
/// LUKS1 keyslot areas are 4 KiB aligned, and cryptsetup only shifts images whose first one
/// starts right after the 4 KiB holding the LUKS1 header.
const ALIGN: u64 = 4096;
/// cryptsetup's shift: the first keyslot moves from 4 KiB to 32 KiB.
const SHIFT: u64 = KEYSLOTS_START - ALIGN;
/// The luksmeta package's foreign metadata behind the LUKS1 keyslots; cryptsetup refuses to
/// convert over it (the LUKS2 keyslots area would overwrite it).
const LUKSMETA_MAGIC: &[u8; 8] = b"LUKSMETA";

/// Where the keyslot material went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyslotPlacement {
    /// Everything moved up by 28 KiB, as cryptsetup does.
    Shifted,
    /// The shift did not fit before the payload; active keyslots were copied to free space.
    Compacted,
}

/// One active LUKS1 keyslot: where its material is and where it goes.
#[derive(Debug)]
struct SlotMove {
    slot: usize,
    from: u64,
    to: u64,
}

/// Convert the LUKS1 header `v1` of `file` to LUKS2 in place. Every check runs before the
/// first write, so a refusal leaves the image untouched.
pub fn convert_luks1(
    file: &dyn HeaderIo,
    v1: &Luks1Header,
) -> Result<(Luks2Header, KeyslotPlacement)> {
    let p = v1.phdr();
    if p.payload_offset == 0 {
        return Err(refuse(
            "detached header",
            "the payload lives on another device; convert it with `cryptsetup convert --type luks2 --header FILE`".into(),
        ));
    }
    let encryption = if p.cipher_mode.is_empty() {
        p.cipher_name.clone()
    } else {
        format!("{}-{}", p.cipher_name, p.cipher_mode)
    };
    CipherSpec::parse_luks2(&encryption, p.key_bytes as usize).map_err(cipher_error)?;
    let hash = HashAlg::parse(&p.hash_spec)?;
    let payload = u64::from(p.payload_offset) * SECTOR;
    let material_len = (u64::from(p.key_bytes) * u64::from(STRIPES)).next_multiple_of(SECTOR);
    let area_len = material_len.next_multiple_of(ALIGN);
    for (i, ks) in p.keyslots.iter().enumerate() {
        if ks.active && ks.stripes != STRIPES {
            return Err(refuse(
                "keyslot",
                format!(
                    "keyslot {i} has {} anti-forensic stripes; LUKS2 conversion needs {STRIPES}",
                    ks.stripes
                ),
            ));
        }
    }
    // cryptsetup's "LUKS1 size": the end of the last keyslot area, active or not.
    let starts = p
        .keyslots
        .iter()
        .map(|k| u64::from(k.key_material_offset) * SECTOR);
    let first = starts.clone().min().unwrap_or(ALIGN);
    let luks1_end = (starts.max().unwrap_or(ALIGN) + material_len).next_multiple_of(ALIGN);
    let file_len = file.size()?;
    if file_len < luks1_end || file_len < payload {
        return Err(LuksError::Truncated(format!(
            "the file is {file_len} bytes but its LUKS1 keyslots end at {luks1_end} and the payload starts at {payload}"
        )));
    }
    let mut magic = [0u8; 8];
    if file_len >= luks1_end + 8 {
        read_at(file, luks1_end, &mut magic, "luksmeta probe")?;
        if &magic == LUKSMETA_MAGIC {
            return Err(refuse(
                "luksmeta metadata",
                format!("luksmeta data at offset {luks1_end} would be overwritten by the LUKS2 keyslots area; remove it (`luksmeta wipe`) first, as cryptsetup requires"),
            ));
        }
    }
    let keyslots_size = payload.saturating_sub(KEYSLOTS_START) / ALIGN * ALIGN;
    if keyslots_size < area_len || keyslots_size > MAX_KEYSLOTS_SIZE {
        return Err(refuse(
            "payload offset",
            format!("the payload starts at {payload}, which leaves LUKS2 a keyslots area of {keyslots_size} bytes; it needs between {area_len} and {MAX_KEYSLOTS_SIZE}"),
        ));
    }
    let active: Vec<(usize, u64)> = p
        .keyslots
        .iter()
        .enumerate()
        .filter(|(_, k)| k.active)
        .map(|(i, k)| (i, u64::from(k.key_material_offset) * SECTOR))
        .collect();
    let placement = if first == ALIGN && luks1_end + SHIFT <= payload {
        KeyslotPlacement::Shifted
    } else {
        KeyslotPlacement::Compacted
    };
    let moves = match placement {
        KeyslotPlacement::Shifted => active
            .iter()
            .map(|&(slot, from)| SlotMove {
                slot,
                from,
                to: from + SHIFT,
            })
            .collect(),
        KeyslotPlacement::Compacted => {
            compact(&active, area_len, KEYSLOTS_START + keyslots_size, payload)?
        }
    };
    let mut hdr = new_header(p, &encryption, hash, &moves, area_len, keyslots_size)?;
    validate(&hdr.meta, HDR_SIZE).map_err(|e| {
        LuksError::InvalidArgument(format!(
            "the converted LUKS2 metadata would be invalid: {e}"
        ))
    })?;
    hdr.encode_copy(super::binary::HeaderCopy::Primary)?;

    match placement {
        KeyslotPlacement::Shifted => {
            // One read and one write of the whole range, as cryptsetup: the areas overlap
            // their own destinations.
            let len = usize::try_from(luks1_end - ALIGN)
                .map_err(|_| LuksError::InvalidArgument("keyslot range too large".into()))?;
            let mut buf = Zeroizing::new(vec![0u8; len]);
            read_at(file, ALIGN, &mut buf, "LUKS1 keyslot areas")?;
            file.write_all_at(&buf, KEYSLOTS_START)?;
        }
        KeyslotPlacement::Compacted => {
            let mut buf = Zeroizing::new(vec![0u8; material_len as usize]);
            for m in &moves {
                read_at(file, m.from, &mut buf, "LUKS1 keyslot material")?;
                file.write_all_at(&buf, m.to)?;
            }
        }
    }
    file.sync_data()?;
    hdr.commit(file)?;
    if placement == KeyslotPlacement::Compacted {
        wipe_old_copies(file, &moves, material_len, area_len)?;
    }
    Ok((hdr, placement))
}

fn refuse(name: &str, hint: String) -> LuksError {
    LuksError::Unsupported {
        what: "LUKS1 layout for conversion",
        name: name.into(),
        hint,
    }
}

/// Lowest 4 KiB-aligned places in [32 KiB, `end`) overlapping neither active LUKS1 material
/// nor each other, one per active keyslot.
fn compact(
    active: &[(usize, u64)],
    area_len: u64,
    end: u64,
    payload: u64,
) -> Result<Vec<SlotMove>> {
    let mut taken: Vec<(u64, u64)> = active
        .iter()
        .map(|&(_, from)| (from, from + area_len))
        .collect();
    let mut moves = Vec::with_capacity(active.len());
    for &(slot, from) in active {
        let mut at = KEYSLOTS_START;
        while let Some(&(_, busy_end)) = taken.iter().find(|&&(s, e)| at < e && s < at + area_len) {
            at = busy_end.next_multiple_of(ALIGN);
        }
        if at + area_len > end {
            return Err(refuse(
                "payload offset",
                format!(
                    "the payload starts at {payload}: no room to move {} active keyslots of {area_len} bytes into a LUKS2 keyslots area without overwriting keyslot material still in use; remove keyslots you no longer need (`cryptblk key remove`) and try again",
                    active.len()
                ),
            ));
        }
        taken.push((at, at + area_len));
        moves.push(SlotMove { slot, from, to: at });
    }
    Ok(moves)
}

fn new_header(
    p: &Phdr,
    encryption: &str,
    hash: HashAlg,
    moves: &[SlotMove],
    area_len: u64,
    keyslots_size: u64,
) -> Result<Luks2Header> {
    let mut keyslots = BTreeMap::new();
    for m in moves {
        let k = &p.keyslots[m.slot];
        keyslots.insert(
            m.slot.to_string(),
            Keyslot {
                kind: "luks2".into(),
                key_size: p.key_bytes,
                af: Some(Af {
                    kind: "luks1".into(),
                    stripes: STRIPES,
                    hash: hash.name().into(),
                    extra: Default::default(),
                }),
                area: Area {
                    kind: "raw".into(),
                    offset: m.to,
                    size: area_len,
                    encryption: Some(encryption.into()),
                    key_size: Some(p.key_bytes),
                    extra: Default::default(),
                },
                kdf: Some(KdfJson {
                    kind: "pbkdf2".into(),
                    hash: Some(hash.name().into()),
                    iterations: Some(k.iterations),
                    time: None,
                    memory: None,
                    cpus: None,
                    salt: b64(&k.salt),
                    extra: Default::default(),
                }),
                priority: None,
                extra: Default::default(),
            },
        );
    }
    let segment = Segment {
        kind: "crypt".into(),
        offset: u64::from(p.payload_offset) * SECTOR,
        size: SegmentSize::Dynamic,
        iv_tweak: Some(0),
        encryption: Some(encryption.into()),
        sector_size: Some(SECTOR as u32),
        extra: Default::default(),
    };
    let digest = Digest {
        kind: "pbkdf2".into(),
        keyslots: moves.iter().map(|m| m.slot.to_string()).collect(),
        segments: vec!["0".into()],
        hash: hash.name().into(),
        iterations: p.mk_digest_iter,
        salt: b64(&p.mk_digest_salt),
        digest: b64(&p.mk_digest),
        extra: Default::default(),
    };
    let meta = Metadata {
        keyslots,
        tokens: BTreeMap::new(),
        segments: BTreeMap::from([("0".to_string(), segment)]),
        digests: BTreeMap::from([("0".to_string(), digest)]),
        config: Config {
            json_size: HDR_SIZE - BINARY_SIZE as u64,
            keyslots_size,
            flags: None,
            requirements: None,
            extra: Default::default(),
        },
        extra: Default::default(),
    };
    let mut salts = [[0u8; SALT_LEN]; 2];
    for s in &mut salts {
        s.copy_from_slice(&random_bytes(SALT_LEN)?);
    }
    Ok(Luks2Header {
        bin: BinaryHeader {
            hdr_size: HDR_SIZE,
            // `commit` bumps it: cryptsetup's converted headers carry seqid 2 as well.
            seqid: 1,
            label: String::new(),
            checksum_alg: "sha256".into(),
            salt: salts[0],
            uuid: p.uuid.clone(),
            subsystem: String::new(),
            hdr_offset: 0,
            checksum: [0; CSUM_LEN],
        },
        salts,
        meta,
        placement: super::validate::Placement::Attached,
    })
}

/// After a compacted conversion, zero what is left of the LUKS1 copies of the key material
/// (the parts no new keyslot area covers), so a passphrase removed later cannot reopen an
/// old copy. The first 32 KiB already hold the LUKS2 headers.
fn wipe_old_copies(
    file: &dyn HeaderIo,
    moves: &[SlotMove],
    material_len: u64,
    area_len: u64,
) -> Result<()> {
    let kept: Vec<(u64, u64)> = moves.iter().map(|m| (m.to, m.to + area_len)).collect();
    for m in moves {
        let mut at = m.from.max(KEYSLOTS_START);
        let end = m.from + material_len;
        while at < end {
            // The next byte a new area keeps, or the end of this old copy.
            let stop = kept
                .iter()
                .filter(|&&(s, _)| s > at)
                .map(|&(s, _)| s)
                .min()
                .unwrap_or(end)
                .min(end);
            if let Some(&(_, e)) = kept.iter().find(|&&(s, e)| s <= at && at < e) {
                at = e;
                continue;
            }
            zero_range(file, at, stop - at)?;
            at = stop;
        }
    }
    file.sync_data()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const AREA: u64 = 258048;

    #[test]
    fn compact_skips_active_material_in_qemu_layout() {
        // QEMU, 512-bit key: slots at 4096 + i * 258048, payload at 2068480.
        let active = [(0, 4096), (1, 4096 + AREA)];
        let moves = compact(&active, AREA, 2068480, 2068480).unwrap();
        assert_eq!(moves[0].to, 4096 + 2 * AREA);
        assert_eq!(moves[1].to, 4096 + 3 * AREA);
    }

    #[test]
    fn compact_refuses_when_no_free_place_is_left() {
        let active: Vec<(usize, u64)> = (0..5).map(|i| (i, 4096 + i as u64 * AREA)).collect();
        let e = compact(&active, AREA, 2068480, 2068480).unwrap_err();
        assert!(e.to_string().contains("no room"), "{e}");
    }
}
