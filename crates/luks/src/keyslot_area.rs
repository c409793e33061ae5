//! Keyslot areas hold AF-split key material encrypted with the keyslot cipher, 512-byte sectors
//! numbered from 0 at the start of the area.
use crate::{LuksError, Result};
use cryptblk_crypto::{CipherSpec, Direction, SecretKey};

/// Keyslot material is always encrypted in 512-byte sectors, whatever the data sector size.
pub const AREA_SECTOR: usize = 512;

pub fn encrypt_area(spec: &CipherSpec, key: &SecretKey, data: &mut [u8]) -> Result<()> {
    crypt(spec, key, Direction::Encrypt, data)
}

pub fn decrypt_area(spec: &CipherSpec, key: &SecretKey, data: &mut [u8]) -> Result<()> {
    crypt(spec, key, Direction::Decrypt, data)
}

/// Bytes the area occupies for `material_len` bytes of split key: whole sectors.
pub fn padded_len(material_len: usize) -> usize {
    material_len.div_ceil(AREA_SECTOR) * AREA_SECTOR
}

fn crypt(spec: &CipherSpec, key: &SecretKey, dir: Direction, data: &mut [u8]) -> Result<()> {
    if !data.len().is_multiple_of(AREA_SECTOR) {
        return Err(LuksError::InvalidArgument(format!(
            "keyslot area of {} bytes is not a whole number of {AREA_SECTOR}-byte sectors",
            data.len()
        )));
    }
    if key.len() != spec.key_bytes() {
        return Err(LuksError::InvalidArgument(format!(
            "keyslot key is {} bytes but {} needs {}",
            key.len(),
            spec.to_luks2_string(),
            spec.key_bytes()
        )));
    }
    // Keyslot areas are a few hundred KiB at most and processed once per unlock: the portable
    // engine is fast enough and avoids a measurement on the unlock path.
    let cipher = cryptblk_crypto::portable_engine().new_cipher(spec, key, AREA_SECTOR)?;
    cipher.crypt(dir, 0, data)?;
    Ok(())
}
