//! Parsing and validating the qcow2 header and its extensions (docs/interop/qcow2.txt).
//! Everything here is untrusted input: each field is range-checked against the file size
//! before anything else uses it.

use crate::format::QCOW2_MAGIC;
use crate::BlockError;

const V2_HEADER_LEN: u64 = 72;
const V3_MIN_HEADER_LEN: u64 = 104;
/// 2 MiB clusters are the largest QEMU creates; 512 bytes the smallest.
const MAX_CLUSTER_BITS: u32 = 21;
const MIN_CLUSTER_BITS: u32 = 9;
/// QEMU's limit on the L1 table (32 MiB), which caps the memory an image can make us spend.
pub(crate) const MAX_L1_BYTES: u64 = 32 * 1024 * 1024;
/// QEMU's limit on the backing file name length.
const MAX_BACKING_NAME: u32 = 1023;
/// Refuse virtual sizes whose byte offsets could not be represented by QEMU either.
const MAX_VIRTUAL_SIZE: u64 = 1 << 61;

const EXT_END: u32 = 0;
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
const EXT_EXTERNAL_DATA_FILE: u32 = 0x4441_5441;

const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION: u64 = 1 << 3;
const INCOMPAT_EXTL2: u64 = 1 << 4;

/// Reads bytes at an offset of the image file (already range-checked by the caller).
pub(crate) type ReadAt<'a> = dyn Fn(u64, &mut [u8]) -> Result<(), BlockError> + 'a;

/// The parts of a qcow2 header the reader needs, already validated.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    pub size: u64,
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub backing_file: Option<String>,
    pub backing_format: Option<String>,
    /// The image was not closed cleanly; refcounts may be stale (harmless for reading).
    pub dirty: bool,
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(a)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// Byte range `[off, off+len)` must lie within the file.
fn check_in_file(what: &str, off: u64, len: u64, file_len: u64) -> Result<(), BlockError> {
    match off.checked_add(len) {
        Some(end) if end <= file_len => Ok(()),
        _ => Err(BlockError::corrupt(format!(
            "{what} ({len} bytes at offset {off}) lies beyond the end of the file ({file_len} bytes)"
        ))),
    }
}

/// Parses and validates the header of a file of `file_len` bytes; `read` fetches byte ranges
/// that are already known to lie within the file.
pub(crate) fn parse(file_len: u64, read: &ReadAt) -> Result<Header, BlockError> {
    if file_len < V2_HEADER_LEN {
        return Err(BlockError::corrupt(format!(
            "file of {file_len} bytes is too short for a qcow2 header"
        )));
    }
    let mut fixed = [0u8; V3_MIN_HEADER_LEN as usize + 8];
    let fixed_len = (fixed.len() as u64).min(file_len) as usize;
    read(0, &mut fixed[..fixed_len])?;
    if fixed[..4] != QCOW2_MAGIC {
        return Err(BlockError::corrupt("not a qcow2 image (bad magic)"));
    }
    let version = be32(&fixed, 4);
    if version != 2 && version != 3 {
        return Err(BlockError::unsupported(format!(
            "qcow2 version {version} (only versions 2 and 3 are supported)"
        )));
    }
    let backing_file_offset = be64(&fixed, 8);
    let backing_file_size = be32(&fixed, 16);
    let cluster_bits = be32(&fixed, 20);
    let size = be64(&fixed, 24);
    let crypt_method = be32(&fixed, 32);
    let l1_size = be32(&fixed, 36);
    let l1_table_offset = be64(&fixed, 40);

    if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
        return Err(BlockError::corrupt(format!(
            "cluster_bits {cluster_bits} outside the valid range {MIN_CLUSTER_BITS}..={MAX_CLUSTER_BITS}"
        )));
    }
    let cluster_size = 1u64 << cluster_bits;
    match crypt_method {
        0 => {}
        1 => return Err(BlockError::unsupported("qcow2 image uses the legacy built-in AES encryption; convert it with qemu-img first")),
        2 => return Err(BlockError::unsupported("qcow2 image uses built-in LUKS encryption (encrypt.format=luks); convert it with qemu-img first")),
        m => return Err(BlockError::corrupt(format!("unknown crypt_method {m}"))),
    }
    if size > MAX_VIRTUAL_SIZE {
        return Err(BlockError::corrupt(format!(
            "virtual size {size} is too large"
        )));
    }

    let (header_length, incompat) = if version == 3 {
        if fixed_len < V3_MIN_HEADER_LEN as usize {
            return Err(BlockError::corrupt("file too short for a qcow2 v3 header"));
        }
        let header_length = u64::from(be32(&fixed, 100));
        if header_length < V3_MIN_HEADER_LEN
            || header_length > cluster_size
            || !header_length.is_multiple_of(8)
        {
            return Err(BlockError::corrupt(format!(
                "invalid v3 header_length {header_length}"
            )));
        }
        (header_length, be64(&fixed, 72))
    } else {
        (V2_HEADER_LEN, 0)
    };

    if incompat & INCOMPAT_CORRUPT != 0 {
        return Err(BlockError::corrupt(
            "image is marked corrupt by QEMU (incompatible feature bit 'corrupt'); repair it with 'qemu-img check -r all'",
        ));
    }
    let mut unsupported = Vec::new();
    if incompat & INCOMPAT_DATA_FILE != 0 {
        unsupported.push("external data file".to_string());
    }
    if incompat & INCOMPAT_EXTL2 != 0 {
        unsupported.push("extended L2 entries (subclusters)".to_string());
    }
    if incompat & INCOMPAT_COMPRESSION != 0 {
        let ctype = if header_length > V3_MIN_HEADER_LEN && fixed_len > V3_MIN_HEADER_LEN as usize {
            fixed[V3_MIN_HEADER_LEN as usize]
        } else {
            0
        };
        match ctype {
            0 => {}
            1 => unsupported.push("compression type zstd".to_string()),
            t => unsupported.push(format!("compression type {t}")),
        }
    }
    let known = INCOMPAT_DIRTY
        | INCOMPAT_CORRUPT
        | INCOMPAT_DATA_FILE
        | INCOMPAT_COMPRESSION
        | INCOMPAT_EXTL2;
    for bit in 0..64 {
        if incompat & !known & (1u64 << bit) != 0 {
            unsupported.push(format!("unknown incompatible feature bit {bit}"));
        }
    }
    if !unsupported.is_empty() {
        return Err(BlockError::unsupported(format!(
            "qcow2 features not supported: {}",
            unsupported.join(", ")
        )));
    }

    let l1_bytes = u64::from(l1_size) * 8;
    if l1_bytes > MAX_L1_BYTES {
        return Err(BlockError::corrupt(format!(
            "L1 table of {l1_size} entries exceeds the 32 MiB limit"
        )));
    }
    // Each L1 entry covers one L2 table worth of clusters.
    let per_l1 = cluster_size * (cluster_size / 8);
    let needed = size.div_ceil(per_l1);
    if u64::from(l1_size) < needed {
        return Err(BlockError::corrupt(format!(
            "L1 table of {l1_size} entries is too small for a virtual size of {size} bytes (needs {needed})"
        )));
    }
    if l1_size > 0 {
        if !l1_table_offset.is_multiple_of(cluster_size) {
            return Err(BlockError::corrupt(format!(
                "L1 table offset {l1_table_offset} is not cluster aligned"
            )));
        }
        check_in_file("L1 table", l1_table_offset, l1_bytes, file_len)?;
    }

    let backing_file = if backing_file_offset != 0 {
        if backing_file_size == 0 || backing_file_size > MAX_BACKING_NAME {
            return Err(BlockError::corrupt(format!(
                "backing file name length {backing_file_size} is invalid"
            )));
        }
        check_in_file(
            "backing file name",
            backing_file_offset,
            u64::from(backing_file_size),
            file_len,
        )?;
        let mut name = vec![0u8; backing_file_size as usize];
        read(backing_file_offset, &mut name)?;
        Some(
            String::from_utf8(name)
                .map_err(|_| BlockError::corrupt("backing file name is not valid UTF-8"))?,
        )
    } else {
        None
    };

    let ext = read_extensions(header_length, cluster_size, file_len, read)?;

    Ok(Header {
        version,
        cluster_bits,
        size,
        l1_size,
        l1_table_offset,
        backing_file,
        backing_format: ext.backing_format,
        dirty: incompat & INCOMPAT_DIRTY != 0,
    })
}

struct Extensions {
    backing_format: Option<String>,
}

/// Walks the header extensions, which live between the header and the end of the first
/// cluster.
fn read_extensions(
    start: u64,
    cluster_size: u64,
    file_len: u64,
    read: &ReadAt,
) -> Result<Extensions, BlockError> {
    let mut out = Extensions {
        backing_format: None,
    };
    let end = cluster_size.min(file_len);
    let mut off = start;
    while off + 8 <= end {
        let mut hdr = [0u8; 8];
        read(off, &mut hdr)?;
        let ty = be32(&hdr, 0);
        let len = u64::from(be32(&hdr, 4));
        if ty == EXT_END {
            return Ok(out);
        }
        let data_off = off + 8;
        let padded = len.div_ceil(8) * 8;
        if data_off + padded > end {
            return Err(BlockError::corrupt(format!(
                "header extension 0x{ty:08x} of {len} bytes runs past the first cluster"
            )));
        }
        match ty {
            EXT_BACKING_FORMAT => {
                let mut name = vec![0u8; len as usize];
                read(data_off, &mut name)?;
                let name = String::from_utf8(name)
                    .map_err(|_| BlockError::corrupt("backing format name is not valid UTF-8"))?;
                out.backing_format = Some(name);
            }
            EXT_EXTERNAL_DATA_FILE => {
                return Err(BlockError::unsupported(
                    "qcow2 features not supported: external data file",
                ));
            }
            // Feature name table, bitmaps, full disk encryption header, unknown: not needed
            // for reading guest data.
            _ => {}
        }
        off = data_off + padded;
    }
    // No end marker within the cluster: QEMU accepts this as long as nothing overflows.
    Ok(out)
}
