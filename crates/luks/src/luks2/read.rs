//! Reading both metadata copies and choosing the one to trust.
use super::binary::{compute_checksum, BinaryHeader, HeaderCopy, BINARY_SIZE, VALID_HDR_SIZES};
use super::json::Metadata;
use super::validate::{validate_placed, Placement};
use crate::io::HeaderIo;
use crate::{HashAlg, LuksError, Result};

/// One header copy that passed every check.
#[derive(Debug, Clone)]
pub struct ValidCopy {
    pub bin: BinaryHeader,
    pub meta: Metadata,
}

/// Why a copy could not be used.
#[derive(Debug)]
enum CopyError {
    /// No header of this kind there at all.
    Absent(String),
    Damaged(String),
}

impl CopyError {
    fn text(&self) -> &str {
        match self {
            CopyError::Absent(s) | CopyError::Damaged(s) => s,
        }
    }
}

fn read_copy(
    file: &dyn HeaderIo,
    file_len: u64,
    offset: u64,
    copy: HeaderCopy,
    placement: Placement,
) -> std::result::Result<ValidCopy, CopyError> {
    if file_len < offset.saturating_add(BINARY_SIZE as u64) {
        return Err(CopyError::Absent(format!(
            "image too short for a header at offset {offset}"
        )));
    }
    let mut head = [0u8; BINARY_SIZE];
    file.read_exact_at(&mut head, offset)
        .map_err(|e| CopyError::Damaged(format!("read failed: {e}")))?;
    if head[..6] != copy.magic() {
        return Err(CopyError::Absent(format!(
            "no {} header magic at offset {offset}",
            copy.name()
        )));
    }
    let version = u16::from_be_bytes([head[6], head[7]]);
    if version != 2 {
        // A LUKS1 image shares the primary magic; it is another format, not a damaged LUKS2.
        return Err(CopyError::Absent(format!(
            "LUKS version {version} header at offset {offset}, not LUKS2"
        )));
    }
    let bin = BinaryHeader::parse(&head, copy).map_err(CopyError::Damaged)?;
    if bin.hdr_offset != offset {
        return Err(CopyError::Damaged(format!(
            "header offset field {} does not match its position {offset}",
            bin.hdr_offset
        )));
    }
    let alg = HashAlg::parse(&bin.checksum_alg).map_err(|_| {
        CopyError::Damaged(format!(
            "unsupported checksum algorithm '{}'",
            bin.checksum_alg
        ))
    })?;
    // hdr_size is one of the spec's sizes (at most 4 MiB), so this allocation is bounded.
    let size = bin.hdr_size as usize;
    if file_len < offset.saturating_add(bin.hdr_size) {
        return Err(CopyError::Damaged(format!(
            "image too short for the {} byte header",
            bin.hdr_size
        )));
    }
    let mut area = vec![0u8; size];
    file.read_exact_at(&mut area, offset)
        .map_err(|e| CopyError::Damaged(format!("read failed: {e}")))?;
    let want = compute_checksum(alg, &area).map_err(CopyError::Damaged)?;
    let n = alg.digest_len();
    if want[..n] != bin.checksum[..n] {
        return Err(CopyError::Damaged("checksum mismatch".to_string()));
    }
    let json_area = area.get(BINARY_SIZE..).unwrap_or_default();
    let end = json_area
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| CopyError::Damaged("JSON metadata is not NUL-terminated".to_string()))?;
    let meta: Metadata = serde_json::from_slice(json_area.get(..end).unwrap_or_default())
        .map_err(|e| CopyError::Damaged(format!("invalid JSON metadata: {e}")))?;
    validate_placed(&meta, bin.hdr_size, placement)
        .map_err(|e| CopyError::Damaged(format!("invalid metadata: {e}")))?;
    Ok(ValidCopy { bin, meta })
}

/// With the primary unusable its hdr_size cannot be trusted, so look for the secondary at
/// every offset the spec allows, as cryptsetup does.
fn probe_secondary(
    file: &dyn HeaderIo,
    file_len: u64,
    placement: Placement,
) -> std::result::Result<ValidCopy, CopyError> {
    let mut damaged = None;
    for &off in &VALID_HDR_SIZES {
        match read_copy(file, file_len, off, HeaderCopy::Secondary, placement) {
            Ok(c) => return Ok(c),
            Err(CopyError::Absent(_)) => {}
            Err(e) => {
                damaged.get_or_insert(e);
            }
        }
    }
    Err(damaged.unwrap_or_else(|| {
        CopyError::Absent("no secondary header found at any valid offset".to_string())
    }))
}

/// Read both copies and return the valid one with the higher seqid, plus warnings about the
/// other copy. `placement` says where the data segments may lie.
pub fn read_header(file: &dyn HeaderIo, placement: Placement) -> Result<(ValidCopy, Vec<String>)> {
    let file_len = file.size()?;
    let primary = read_copy(file, file_len, 0, HeaderCopy::Primary, placement);
    let secondary = match &primary {
        Ok(p) => read_copy(
            file,
            file_len,
            p.bin.hdr_size,
            HeaderCopy::Secondary,
            placement,
        ),
        Err(_) => probe_secondary(file, file_len, placement),
    };
    let mut warnings = Vec::new();
    match (primary, secondary) {
        (Ok(p), Ok(s)) if s.bin.uuid != p.bin.uuid || s.bin.hdr_size != p.bin.hdr_size => {
            // A leftover secondary from an earlier format must never override the primary,
            // whatever its seqid.
            warnings.push(format!(
                "secondary header belongs to another header (uuid {}, size {}), using the primary copy",
                s.bin.uuid, s.bin.hdr_size
            ));
            Ok((p, warnings))
        }
        (Ok(p), Ok(s)) => {
            if s.bin.seqid > p.bin.seqid {
                warnings.push(format!(
                    "primary header is older (seqid {}) than the secondary (seqid {}), using the secondary copy",
                    p.bin.seqid, s.bin.seqid
                ));
                Ok((s, warnings))
            } else {
                if s.bin.seqid < p.bin.seqid {
                    warnings.push(format!(
                        "secondary header is older (seqid {}) than the primary (seqid {}), using the primary copy",
                        s.bin.seqid, p.bin.seqid
                    ));
                }
                Ok((p, warnings))
            }
        }
        (Ok(p), Err(e)) => {
            warnings.push(format!(
                "secondary header damaged ({}), using the primary copy",
                e.text()
            ));
            Ok((p, warnings))
        }
        (Err(e), Ok(s)) => {
            warnings.push(format!(
                "primary header damaged ({}), using the secondary copy",
                e.text()
            ));
            Ok((s, warnings))
        }
        (Err(CopyError::Absent(p)), Err(CopyError::Absent(_))) => Err(not_luks2(file, p)),
        (Err(p), Err(s)) => Err(LuksError::Corrupt(format!(
            "both LUKS2 header copies are unusable: primary header: {}; secondary header: {}",
            p.text(),
            s.text()
        ))),
    }
}

fn not_luks2(file: &dyn HeaderIo, reason: String) -> LuksError {
    let mut head = [0u8; 8];
    if file.read_exact_at(&mut head, 0).is_ok() && head[..6] == *b"LUKS\xba\xbe" {
        let v = u16::from_be_bytes([head[6], head[7]]);
        return LuksError::NotLuks(format!("LUKS version {v} header, not LUKS2"));
    }
    LuksError::NotLuks(reason)
}
