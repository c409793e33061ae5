//! The 4096-byte binary LUKS2 header that starts each metadata copy, and the checksum that
//! covers it together with the JSON area behind it.
use crate::HashAlg;
use sha2::Digest;

/// Size of the binary part of each header copy; the JSON area follows it.
pub const BINARY_SIZE: usize = 4096;
pub const MAGIC_PRIMARY: [u8; 6] = *b"LUKS\xba\xbe";
pub const MAGIC_SECONDARY: [u8; 6] = *b"SKUL\xba\xbe";
pub const LABEL_LEN: usize = 48;
pub const SUBSYSTEM_LEN: usize = 48;
pub const CSUM_ALG_LEN: usize = 32;
pub const SALT_LEN: usize = 64;
pub const UUID_LEN: usize = 40;
pub const CSUM_LEN: usize = 64;

// Field offsets inside the binary header (the spec's `struct luks2_hdr_disk`).
const OFF_VERSION: usize = 6;
const OFF_HDR_SIZE: usize = 8;
const OFF_SEQID: usize = 16;
const OFF_LABEL: usize = 24;
const OFF_CSUM_ALG: usize = 72;
const OFF_SALT: usize = 104;
const OFF_UUID: usize = 168;
const OFF_SUBSYSTEM: usize = 208;
const OFF_HDR_OFFSET: usize = 256;
const OFF_CSUM: usize = 448;

/// Header copy sizes the spec allows (binary + JSON). The secondary copy sits at `hdr_size`,
/// so these are also the offsets probed for it when the primary is unreadable.
pub const VALID_HDR_SIZES: [u64; 9] = [
    0x4000, 0x8000, 0x10000, 0x20000, 0x40000, 0x80000, 0x10_0000, 0x20_0000, 0x40_0000,
];

/// Which of the two metadata copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderCopy {
    Primary,
    Secondary,
}

impl HeaderCopy {
    pub fn magic(self) -> [u8; 6] {
        match self {
            HeaderCopy::Primary => MAGIC_PRIMARY,
            HeaderCopy::Secondary => MAGIC_SECONDARY,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HeaderCopy::Primary => "primary",
            HeaderCopy::Secondary => "secondary",
        }
    }
}

/// Decoded fields of one binary header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinaryHeader {
    pub hdr_size: u64,
    pub seqid: u64,
    pub label: String,
    pub checksum_alg: String,
    pub salt: [u8; SALT_LEN],
    pub uuid: String,
    pub subsystem: String,
    pub hdr_offset: u64,
    pub checksum: [u8; CSUM_LEN],
}

fn be_u64(buf: &[u8; BINARY_SIZE], off: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[off..off + 8]);
    u64::from_be_bytes(b)
}

/// A NUL-terminated fixed-size text field. Bytes after the first NUL are ignored, as
/// cryptsetup does; the text itself must be UTF-8 so it can be shown and rewritten safely.
fn c_string(field: &[u8], name: &str) -> Result<String, String> {
    let end = field
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| format!("{name} is not NUL-terminated"))?;
    let text = field.get(..end).unwrap_or_default();
    String::from_utf8(text.to_vec()).map_err(|_| format!("{name} is not valid UTF-8"))
}

fn put_c_string(field: &mut [u8], value: &str, name: &str) -> Result<(), String> {
    let bytes = value.as_bytes();
    if bytes.len() >= field.len() {
        return Err(format!(
            "{name} '{value}' is longer than {} bytes",
            field.len() - 1
        ));
    }
    if bytes.contains(&0) {
        return Err(format!("{name} contains a NUL byte"));
    }
    field.fill(0);
    field[..bytes.len()].copy_from_slice(bytes);
    Ok(())
}

impl BinaryHeader {
    /// Decode one binary header expected to be the `copy` copy. The error says what is wrong,
    /// for the caller to combine into a warning or a `Corrupt` error.
    pub fn parse(buf: &[u8; BINARY_SIZE], copy: HeaderCopy) -> Result<Self, String> {
        if buf[..6] != copy.magic() {
            return Err("bad magic".to_string());
        }
        let version = u16::from_be_bytes([buf[OFF_VERSION], buf[OFF_VERSION + 1]]);
        if version != 2 {
            return Err(format!("version {version}, expected 2"));
        }
        let hdr_size = be_u64(buf, OFF_HDR_SIZE);
        if !VALID_HDR_SIZES.contains(&hdr_size) {
            return Err(format!("invalid header size {hdr_size}"));
        }
        let mut salt = [0u8; SALT_LEN];
        salt.copy_from_slice(&buf[OFF_SALT..OFF_SALT + SALT_LEN]);
        let mut checksum = [0u8; CSUM_LEN];
        checksum.copy_from_slice(&buf[OFF_CSUM..OFF_CSUM + CSUM_LEN]);
        Ok(BinaryHeader {
            hdr_size,
            seqid: be_u64(buf, OFF_SEQID),
            label: c_string(&buf[OFF_LABEL..OFF_LABEL + LABEL_LEN], "label")?,
            checksum_alg: c_string(
                &buf[OFF_CSUM_ALG..OFF_CSUM_ALG + CSUM_ALG_LEN],
                "checksum algorithm",
            )?,
            salt,
            uuid: c_string(&buf[OFF_UUID..OFF_UUID + UUID_LEN], "uuid")?,
            subsystem: c_string(
                &buf[OFF_SUBSYSTEM..OFF_SUBSYSTEM + SUBSYSTEM_LEN],
                "subsystem",
            )?,
            hdr_offset: be_u64(buf, OFF_HDR_OFFSET),
            checksum,
        })
    }

    /// Encode with the checksum field as stored in `self.checksum`.
    pub fn serialize(&self, copy: HeaderCopy) -> Result<[u8; BINARY_SIZE], String> {
        let mut buf = [0u8; BINARY_SIZE];
        buf[..6].copy_from_slice(&copy.magic());
        buf[OFF_VERSION..OFF_VERSION + 2].copy_from_slice(&2u16.to_be_bytes());
        buf[OFF_HDR_SIZE..OFF_HDR_SIZE + 8].copy_from_slice(&self.hdr_size.to_be_bytes());
        buf[OFF_SEQID..OFF_SEQID + 8].copy_from_slice(&self.seqid.to_be_bytes());
        put_c_string(
            &mut buf[OFF_LABEL..OFF_LABEL + LABEL_LEN],
            &self.label,
            "label",
        )?;
        put_c_string(
            &mut buf[OFF_CSUM_ALG..OFF_CSUM_ALG + CSUM_ALG_LEN],
            &self.checksum_alg,
            "checksum algorithm",
        )?;
        buf[OFF_SALT..OFF_SALT + SALT_LEN].copy_from_slice(&self.salt);
        put_c_string(&mut buf[OFF_UUID..OFF_UUID + UUID_LEN], &self.uuid, "uuid")?;
        put_c_string(
            &mut buf[OFF_SUBSYSTEM..OFF_SUBSYSTEM + SUBSYSTEM_LEN],
            &self.subsystem,
            "subsystem",
        )?;
        buf[OFF_HDR_OFFSET..OFF_HDR_OFFSET + 8].copy_from_slice(&self.hdr_offset.to_be_bytes());
        buf[OFF_CSUM..OFF_CSUM + CSUM_LEN].copy_from_slice(&self.checksum);
        Ok(buf)
    }
}

/// Hash `area` (one whole header copy: binary header + JSON area) with its checksum field
/// treated as zero, as the spec defines the checksum. Returns the digest, zero-padded to 64.
pub fn compute_checksum(alg: HashAlg, area: &[u8]) -> Result<[u8; CSUM_LEN], String> {
    if area.len() < BINARY_SIZE {
        return Err("header area shorter than the binary header".to_string());
    }
    let zero = [0u8; CSUM_LEN];
    let parts: [&[u8]; 3] = [&area[..OFF_CSUM], &zero, &area[OFF_CSUM + CSUM_LEN..]];
    let digest: Vec<u8> = match alg {
        HashAlg::Sha1 => hash_parts::<sha1::Sha1>(&parts),
        HashAlg::Sha256 => hash_parts::<sha2::Sha256>(&parts),
        HashAlg::Sha512 => hash_parts::<sha2::Sha512>(&parts),
    };
    let mut out = [0u8; CSUM_LEN];
    let n = digest.len().min(CSUM_LEN);
    out[..n].copy_from_slice(&digest[..n]);
    Ok(out)
}

fn hash_parts<D: Digest>(parts: &[&[u8]]) -> Vec<u8> {
    let mut h = D::new();
    for p in parts {
        h.update(p);
    }
    h.finalize().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> BinaryHeader {
        BinaryHeader {
            hdr_size: 0x4000,
            seqid: 7,
            label: "data".into(),
            checksum_alg: "sha256".into(),
            salt: [0x5a; SALT_LEN],
            uuid: "282c4b68-edfe-4edc-b370-9e8dfd5d414e".into(),
            subsystem: String::new(),
            hdr_offset: 0x4000,
            checksum: [0; CSUM_LEN],
        }
    }

    #[test]
    fn round_trips_and_checks_magic() {
        let h = sample();
        let buf = h.serialize(HeaderCopy::Secondary).unwrap();
        assert_eq!(&buf[..6], b"SKUL\xba\xbe");
        assert_eq!(BinaryHeader::parse(&buf, HeaderCopy::Secondary).unwrap(), h);
        assert_eq!(
            BinaryHeader::parse(&buf, HeaderCopy::Primary).unwrap_err(),
            "bad magic"
        );
    }

    #[test]
    fn rejects_bad_sizes_and_unterminated_strings() {
        let mut buf = sample().serialize(HeaderCopy::Primary).unwrap();
        buf[OFF_HDR_SIZE + 7] = 1;
        assert!(BinaryHeader::parse(&buf, HeaderCopy::Primary)
            .unwrap_err()
            .contains("header size"));
        let mut buf = sample().serialize(HeaderCopy::Primary).unwrap();
        buf[OFF_UUID..OFF_UUID + UUID_LEN].fill(b'a');
        assert!(BinaryHeader::parse(&buf, HeaderCopy::Primary)
            .unwrap_err()
            .contains("uuid"));
        let mut long = sample();
        long.label = "x".repeat(48);
        assert!(long.serialize(HeaderCopy::Primary).is_err());
    }

    #[test]
    fn checksum_ignores_its_own_field() {
        let mut area = vec![0u8; 0x4000];
        area[..BINARY_SIZE].copy_from_slice(&sample().serialize(HeaderCopy::Primary).unwrap());
        let a = compute_checksum(HashAlg::Sha256, &area).unwrap();
        area[OFF_CSUM..OFF_CSUM + 32].copy_from_slice(&a[..32]);
        assert_eq!(compute_checksum(HashAlg::Sha256, &area).unwrap(), a);
        area[5000] ^= 1;
        assert_ne!(compute_checksum(HashAlg::Sha256, &area).unwrap(), a);
        assert_eq!(a[32..], [0u8; 32]);
    }
}
