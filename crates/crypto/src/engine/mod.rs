//! The engines: our own VAES AES-XTS on x86-64, OpenSSL, and a portable one on RustCrypto.

pub(crate) mod openssl;
pub(crate) mod rustcrypto;
#[cfg(target_arch = "x86_64")]
pub(crate) mod vaes;
mod xts;

use crate::CryptoError;

/// dm-crypt accepts encryption sector sizes from 512 to 4096 bytes, powers of two.
pub(crate) fn check_sector_size(sector_size: usize) -> Result<(), CryptoError> {
    if (512..=4096).contains(&sector_size) && sector_size.is_power_of_two() {
        Ok(())
    } else {
        Err(CryptoError::InvalidLength(format!(
            "sector size {sector_size} is not a power of two between 512 and 4096"
        )))
    }
}

/// A run must be whole sectors; an empty run is a no-op, not an error.
pub(crate) fn check_run(sector_size: usize, len: usize) -> Result<(), CryptoError> {
    if len.is_multiple_of(sector_size) {
        Ok(())
    } else {
        Err(CryptoError::InvalidLength(format!(
            "{len} bytes is not a whole number of {sector_size}-byte sectors"
        )))
    }
}
