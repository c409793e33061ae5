//! Committing header updates. Order matters for crash safety: the primary copy is written and
//! synced before the secondary is touched, so an interrupted update leaves one intact copy
//! (the old or the new state) for readers to pick by seqid.
use super::binary::{compute_checksum, BinaryHeader, HeaderCopy, BINARY_SIZE, CSUM_LEN};
use super::validate::validate_placed;
use super::Luks2Header;
use crate::io::HeaderIo;
use crate::{HashAlg, LuksError, Result};
use base64::Engine as _;
use cryptblk_crypto::SecretKey;

/// Keyslot and digest salt length (cryptsetup's LUKS_SALTSIZE).
pub(super) const SALT_BYTES: usize = 32;

pub(super) fn random_bytes(n: usize) -> crate::Result<Vec<u8>> {
    // Salts are public; SecretKey is just the crate's handle on the OS RNG.
    Ok(SecretKey::random(n)?.as_bytes().to_vec())
}

pub(super) fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub(super) fn round_up(n: u64, to: u64) -> Option<u64> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

impl Luks2Header {
    /// Serialize one copy: binary header, JSON padded with NULs, checksum over both.
    pub(super) fn encode_copy(&self, copy: HeaderCopy) -> Result<Vec<u8>> {
        let json = serde_json::to_vec(&self.meta)
            .map_err(|e| LuksError::InvalidArgument(format!("JSON: {e}")))?;
        let hdr_size = usize::try_from(self.bin.hdr_size)
            .map_err(|_| LuksError::InvalidArgument("header size".into()))?;
        // The JSON must leave room for at least one terminating NUL.
        if json.len() >= hdr_size - BINARY_SIZE {
            return Err(LuksError::InvalidArgument(format!(
                "metadata JSON ({} bytes) does not fit the {} byte JSON area",
                json.len(),
                hdr_size - BINARY_SIZE
            )));
        }
        let idx = match copy {
            HeaderCopy::Primary => 0,
            HeaderCopy::Secondary => 1,
        };
        let mut bin = BinaryHeader {
            hdr_offset: if idx == 0 { 0 } else { self.bin.hdr_size },
            salt: self.salts[idx],
            checksum: [0; CSUM_LEN],
            ..self.bin.clone()
        };
        let alg = HashAlg::parse(&bin.checksum_alg)?;
        let mut area = vec![0u8; hdr_size];
        area[..BINARY_SIZE]
            .copy_from_slice(&bin.serialize(copy).map_err(LuksError::InvalidArgument)?);
        area[BINARY_SIZE..BINARY_SIZE + json.len()].copy_from_slice(&json);
        bin.checksum = compute_checksum(alg, &area).map_err(LuksError::InvalidArgument)?;
        area[..BINARY_SIZE]
            .copy_from_slice(&bin.serialize(copy).map_err(LuksError::InvalidArgument)?);
        Ok(area)
    }

    /// Write one copy and sync it. Exposed for crash-simulation tests.
    #[doc(hidden)]
    pub fn write_copy(&self, file: &dyn HeaderIo, copy: HeaderCopy) -> Result<()> {
        let area = self.encode_copy(copy)?;
        let offset = if copy == HeaderCopy::Primary {
            0
        } else {
            self.bin.hdr_size
        };
        file.write_all_at(&area, offset)?;
        file.sync_data()?;
        Ok(())
    }

    /// Commit the in-memory metadata: bump seqid, primary, sync, secondary, sync. The metadata
    /// is validated first so we never write a header we would refuse to read.
    pub(super) fn commit(&mut self, file: &dyn HeaderIo) -> Result<()> {
        validate_placed(&self.meta, self.bin.hdr_size, self.placement).map_err(|e| {
            LuksError::InvalidArgument(format!("refusing to write invalid metadata: {e}"))
        })?;
        self.bin.seqid = self
            .bin
            .seqid
            .checked_add(1)
            .ok_or_else(|| LuksError::Corrupt("seqid overflow".into()))?;
        self.write_copy(file, HeaderCopy::Primary)?;
        self.write_copy(file, HeaderCopy::Secondary)
    }
}
