//! Decoding L2 table entries into where a cluster's data lives. Entries come from the untrusted
//! file, so every host offset is checked against the file size here, once, for all callers.

use crate::BlockError;

/// Host offset bits of L1 and standard L2 entries (bits 9..=55).
pub(crate) const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const COMPRESSED: u64 = 1 << 62;
/// "Reads as zeros" (version 3 only; reserved in version 2).
const ZERO: u64 = 1;

/// Where a guest cluster's data lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mapping {
    /// Not allocated here: read from the backing image, or zeros without one.
    Unallocated,
    Zero,
    /// Host offset of the (cluster-aligned) data cluster.
    Data(u64),
    /// Host byte offset and length of deflate-compressed cluster data.
    Compressed {
        host: u64,
        len: u64,
    },
}

/// What decoding an entry depends on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub cluster_bits: u32,
    pub version: u32,
    pub file_len: u64,
}

pub(crate) fn decode_l2(entry: u64, g: &Geometry) -> Result<Mapping, BlockError> {
    let cb = g.cluster_bits;
    if entry & COMPRESSED != 0 {
        // The split between offset and sector count moves with the cluster size.
        let x = 62 - (cb - 8);
        let host = entry & ((1u64 << x) - 1);
        let extra_sectors = (entry >> x) & ((1u64 << (cb - 8)) - 1);
        if host >= g.file_len {
            return Err(BlockError::corrupt(format!(
                "compressed cluster at host offset {host} lies beyond the end of the file ({} bytes)",
                g.file_len
            )));
        }
        // The count covers whole 512-byte sectors from the one holding `host`; QEMU may end
        // the file inside the last of them, so clip at EOF.
        let len = ((extra_sectors + 1) * 512 - (host & 511)).min(g.file_len - host);
        return Ok(Mapping::Compressed { host, len });
    }
    if g.version >= 3 && entry & ZERO != 0 {
        return Ok(Mapping::Zero);
    }
    let host = entry & OFFSET_MASK;
    if host == 0 {
        return Ok(Mapping::Unallocated);
    }
    if !host.is_multiple_of(1u64 << cb) {
        return Err(BlockError::corrupt(format!(
            "data cluster offset {host} is not cluster aligned"
        )));
    }
    if host >= g.file_len {
        return Err(BlockError::corrupt(format!(
            "data cluster at host offset {host} lies beyond the end of the file ({} bytes)",
            g.file_len
        )));
    }
    Ok(Mapping::Data(host))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BlockErrorKind;

    const GIB: u64 = 1 << 30;

    fn g(cluster_bits: u32, version: u32) -> Geometry {
        Geometry {
            cluster_bits,
            version,
            file_len: GIB,
        }
    }

    #[test]
    fn compressed_field_split_follows_cluster_bits() {
        // (cluster_bits, offset bits x): x = 62 - (cluster_bits - 8).
        for (cb, x) in [(9u32, 61u32), (16, 54), (21, 49)] {
            let host = 0x1234_5678u64;
            // The largest count the field holds, so a wrong split would spill into the offset.
            let sectors = (1u64 << (cb - 8)) - 1;
            let entry = COMPRESSED | (sectors << x) | host;
            let m = decode_l2(entry, &g(cb, 3)).unwrap();
            assert_eq!(
                m,
                Mapping::Compressed {
                    host,
                    len: (sectors + 1) * 512 - (host & 511)
                },
                "cluster_bits {cb}"
            );
        }
    }

    #[test]
    fn compressed_length_is_clipped_at_eof() {
        let geo = Geometry {
            cluster_bits: 16,
            version: 3,
            file_len: 10_000,
        };
        let entry = COMPRESSED | (7u64 << 54) | 9_000;
        assert_eq!(
            decode_l2(entry, &geo).unwrap(),
            Mapping::Compressed {
                host: 9_000,
                len: 1_000
            }
        );
    }

    #[test]
    fn standard_entries() {
        let v3 = g(16, 3);
        assert_eq!(decode_l2(0, &v3).unwrap(), Mapping::Unallocated);
        assert_eq!(decode_l2(ZERO, &v3).unwrap(), Mapping::Zero);
        // Preallocated zero cluster: the flag wins over the offset.
        assert_eq!(
            decode_l2((1 << 63) | 0x30000 | ZERO, &v3).unwrap(),
            Mapping::Zero
        );
        assert_eq!(
            decode_l2((1 << 63) | 0x30000, &v3).unwrap(),
            Mapping::Data(0x30000)
        );
        // In version 2 bit 0 is not a zero flag.
        assert_eq!(
            decode_l2(0x30000 | ZERO, &g(16, 2)).unwrap(),
            Mapping::Data(0x30000)
        );
        let err = decode_l2(0x30200, &v3).unwrap_err();
        assert_eq!(err.kind(), BlockErrorKind::Corrupt);
        let err = decode_l2(GIB, &v3).unwrap_err();
        assert!(err.to_string().contains("beyond the end"), "{err}");
    }
}
