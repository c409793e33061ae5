//! Where each byte of the volume lives during a reencryption: the live segments as extents of
//! the volume (offset ranges -> device offset, cipher, IV base), and the segment sets
//! cryptsetup commits before ("hot") and after ("post") rewriting a hotzone.
use super::{ReencryptState, FLAG_BACKUP_FINAL, FLAG_BACKUP_PREVIOUS, FLAG_IN_REENCRYPTION};
use crate::luks2::json::{parse_u64, Metadata, Segment, SegmentSize};
use crate::{LuksError, Result};
use serde_json::Value;
use std::collections::BTreeMap;

/// Which volume key a segment is encrypted with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyRole {
    Old,
    New,
}

/// How the bytes of an extent are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtentCipher {
    /// Plaintext (a `linear` segment: encryption not yet done or decryption done).
    Plain,
    /// Encrypted with the `role` key. The IV of the byte at volume offset `p` inside the
    /// extent counts 512-byte units from `iv_tweak`: `iv_tweak + (p - logical_start) / 512`,
    /// as dm-crypt does without `iv_large_sectors`.
    Crypt {
        role: KeyRole,
        encryption: String,
        sector_size: u32,
        iv_tweak: u64,
    },
}

/// One live segment as a range of the volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentExtent {
    pub id: String,
    /// Volume offset of the first byte.
    pub logical_start: u64,
    pub len: u64,
    /// Offset of the first byte in the image.
    pub device_offset: u64,
    pub cipher: ExtentCipher,
    /// The hotzone a crash interrupted: its blocks are old or new, see the session's recovery
    /// (an in-place encryption's may be half written; its plaintext is still at its source,
    /// the moved copy or `shift` bytes below). Recover it before serving it.
    pub in_reencryption: bool,
}

impl SegmentExtent {
    pub fn end(&self) -> u64 {
        self.logical_start + self.len
    }
}

fn corrupt(msg: String) -> LuksError {
    LuksError::Corrupt(format!("reencryption segments: {msg}"))
}

/// The live segments of `meta` as extents, for an image of `file_len` bytes.
pub fn live_extents(
    meta: &Metadata,
    state: &ReencryptState,
    file_len: u64,
) -> Result<Vec<SegmentExtent>> {
    let mut live: Vec<(u64, &String, &Segment)> = meta
        .segments
        .iter()
        .filter(|(_, s)| !s.is_backup())
        .filter_map(|(id, s)| parse_u64(id).map(|n| (n, id, s)))
        .collect();
    live.sort_by_key(|(n, _, _)| *n);
    let backup = |id: &String| {
        meta.segments
            .get(id)
            .ok_or_else(|| corrupt(format!("backup segment {id} vanished")))
    };
    let old = backup(&state.segment_old)?;
    let new = backup(&state.segment_new)?;
    let in_digest = |digest: &Option<String>, id: &str| {
        digest
            .as_ref()
            .and_then(|d| meta.digests.get(d))
            .is_some_and(|d| d.segments.iter().any(|s| s == id))
    };
    let mut out = Vec::with_capacity(live.len());
    let mut pos = 0u64;
    let count = live.len();
    for (i, (_, id, seg)) in live.into_iter().enumerate() {
        let hot = seg.flags().contains(&FLAG_IN_REENCRYPTION);
        let len = match seg.size {
            SegmentSize::Fixed(n) => n,
            SegmentSize::Dynamic if i + 1 == count => {
                let avail = file_len.checked_sub(seg.offset).ok_or_else(|| {
                    LuksError::Truncated(format!(
                        "segment {id} starts at {} beyond the image's end",
                        seg.offset
                    ))
                })?;
                let align = u64::from(
                    seg.sector_size
                        .unwrap_or(512)
                        .max(new.sector_size.unwrap_or(512))
                        .max(old.sector_size.unwrap_or(512)),
                );
                avail - avail % align
            }
            SegmentSize::Dynamic => {
                return Err(corrupt(format!("segment {id} is dynamic but not the last")))
            }
        };
        if seg.offset.checked_add(len).is_none_or(|e| e > file_len) {
            return Err(LuksError::Truncated(format!(
                "segment {id} needs {len} bytes at offset {}, the image has {file_len}",
                seg.offset
            )));
        }
        let cipher = match seg.kind.as_str() {
            "linear" => ExtentCipher::Plain,
            "crypt" => {
                let role = if hot || in_digest(&state.digest_new, id) {
                    KeyRole::New
                } else if in_digest(&state.digest_old, id) {
                    KeyRole::Old
                } else {
                    return Err(corrupt(format!(
                        "segment {id} is bound to neither the old nor the new key"
                    )));
                };
                let model = if role == KeyRole::New { new } else { old };
                if seg.encryption != model.encryption || seg.sector_size != model.sector_size {
                    return Err(corrupt(format!(
                        "segment {id} ({:?}, {:?}-byte sectors) matches neither backup segment",
                        seg.encryption, seg.sector_size
                    )));
                }
                let sector_size = seg.sector_size.unwrap_or(512);
                let iv_tweak = seg.iv_tweak.unwrap_or(0);
                if (iv_tweak
                    .checked_mul(512)
                    .ok_or_else(|| corrupt(format!("segment {id} iv_tweak overflows")))?)
                    % u64::from(sector_size)
                    != 0
                    || !pos.is_multiple_of(u64::from(sector_size))
                    || !len.is_multiple_of(u64::from(sector_size))
                {
                    return Err(corrupt(format!(
                        "segment {id} is not aligned to its {sector_size}-byte sectors"
                    )));
                }
                ExtentCipher::Crypt {
                    role,
                    encryption: seg.encryption.clone().unwrap_or_default(),
                    sector_size,
                    iv_tweak,
                }
            }
            other => return Err(corrupt(format!("segment {id} has type '{other}'"))),
        };
        out.push(SegmentExtent {
            id: id.clone(),
            logical_start: pos,
            len,
            device_offset: seg.offset,
            cipher,
            in_reencryption: hot,
        });
        pos = pos
            .checked_add(len)
            .ok_or_else(|| corrupt("segment sizes overflow".into()))?;
    }
    Ok(out)
}

/// The length of a segment that must have one (every segment but the last).
pub(super) fn fixed(seg: &Segment) -> Result<u64> {
    match seg.size {
        SegmentSize::Fixed(n) => Ok(n),
        SegmentSize::Dynamic => Err(LuksError::Corrupt(
            "reencryption segments: a dynamic segment before the end".into(),
        )),
    }
}

/// A copy of backup segment `model` placed at volume offset `start` (length `len`, or to the
/// end of the device), without backup flags.
pub(super) fn placed(
    model: &Segment,
    data_offset: u64,
    start: u64,
    len: Option<u64>,
    hot: bool,
) -> Segment {
    let mut seg = model.clone();
    seg.offset = data_offset.saturating_add(start);
    seg.size = len.map_or(SegmentSize::Dynamic, SegmentSize::Fixed);
    if seg.kind == "crypt" {
        seg.iv_tweak = Some(model.iv_tweak.unwrap_or(0).saturating_add(start / 512));
    }
    seg.extra.remove("flags");
    if hot {
        seg.extra
            .insert("flags".into(), Value::from(vec![FLAG_IN_REENCRYPTION]));
    }
    seg
}

/// The live segments while `[offset, offset + len)` is being rewritten (forward direction):
/// new data before it, the hotzone itself (new layout, flagged), old data after it.
pub fn hot_segments(
    meta: &Metadata,
    state: &ReencryptState,
    device_size: u64,
    offset: u64,
    len: u64,
) -> Result<Vec<(Segment, KeyRole)>> {
    let (old, new, data_offset) = models(meta, state)?;
    let mut out = Vec::new();
    if offset > 0 {
        out.push((
            placed(new, data_offset, 0, Some(offset), false),
            KeyRole::New,
        ));
    }
    out.push((
        placed(new, data_offset, offset, Some(len), true),
        KeyRole::New,
    ));
    if offset + len < device_size {
        out.push((
            placed(old, data_offset, offset + len, None, false),
            KeyRole::Old,
        ));
    }
    Ok(out)
}

/// The live segments once `[0, done)` is in the new layout.
pub fn post_segments(
    meta: &Metadata,
    state: &ReencryptState,
    device_size: u64,
    done: u64,
) -> Result<Vec<(Segment, KeyRole)>> {
    let (old, new, data_offset) = models(meta, state)?;
    if done >= device_size {
        return Ok(vec![(
            placed(new, data_offset, 0, None, false),
            KeyRole::New,
        )]);
    }
    Ok(vec![
        (placed(new, data_offset, 0, Some(done), false), KeyRole::New),
        (placed(old, data_offset, done, None, false), KeyRole::Old),
    ])
}

fn models<'a>(
    meta: &'a Metadata,
    state: &ReencryptState,
) -> Result<(&'a Segment, &'a Segment, u64)> {
    let get = |id: &String| {
        meta.segments
            .get(id)
            .ok_or_else(|| corrupt(format!("backup segment {id} vanished")))
    };
    let old = get(&state.segment_old)?;
    let new = get(&state.segment_new)?;
    if old.offset != new.offset {
        return Err(LuksError::Unsupported {
            what: "reencryption layout",
            name: "data shift".into(),
            hint: "the old and new data start at different offsets (datashift); cryptblk does not move data yet".into(),
        });
    }
    Ok((old, new, new.offset))
}

/// Replace the live segments with `live` (ids 0..n), put the backups after them as cryptsetup
/// does, and bind every crypt segment to the digest of its key (the hotzone to both).
pub fn install_segments(
    meta: &mut Metadata,
    state: &ReencryptState,
    live: Vec<(Segment, KeyRole)>,
) -> Result<()> {
    let mut old_bk = meta
        .segments
        .get(&state.segment_old)
        .cloned()
        .ok_or_else(|| corrupt("no previous backup".into()))?;
    let mut new_bk = meta
        .segments
        .get(&state.segment_new)
        .cloned()
        .ok_or_else(|| corrupt("no final backup".into()))?;
    old_bk
        .extra
        .insert("flags".into(), Value::from(vec![FLAG_BACKUP_PREVIOUS]));
    new_bk
        .extra
        .insert("flags".into(), Value::from(vec![FLAG_BACKUP_FINAL]));
    let mut segments = BTreeMap::new();
    let mut old_ids = Vec::new();
    let mut new_ids = Vec::new();
    let n = live.len();
    for (i, (seg, role)) in live.into_iter().enumerate() {
        let id = i.to_string();
        if seg.kind == "crypt" {
            let hot = seg.flags().contains(&FLAG_IN_REENCRYPTION);
            if hot || role == KeyRole::New {
                new_ids.push(id.clone());
            }
            if hot || role == KeyRole::Old {
                old_ids.push(id.clone());
            }
        }
        segments.insert(id, seg);
    }
    old_ids.push(n.to_string());
    new_ids.push((n + 1).to_string());
    segments.insert(n.to_string(), old_bk);
    segments.insert((n + 1).to_string(), new_bk);
    // cryptsetup keeps the moved segment (encryption with a data shift) after the two.
    if let Some(moved) = state
        .segment_moved
        .as_ref()
        .and_then(|id| meta.segments.get(id))
    {
        // A decryption's moved segment is ciphertext: bound to the old key, as cryptsetup
        // binds it (an encryption's is plaintext, bound to none).
        if moved.kind == "crypt" {
            old_ids.push((n + 2).to_string());
        }
        segments.insert((n + 2).to_string(), moved.clone());
    }
    meta.segments = segments;
    for d in meta.digests.values_mut() {
        d.segments.clear();
    }
    for (digest, ids) in [(&state.digest_old, old_ids), (&state.digest_new, new_ids)] {
        if let Some(d) = digest.as_ref().and_then(|d| meta.digests.get_mut(d)) {
            d.segments.extend(ids);
        }
    }
    Ok(())
}
