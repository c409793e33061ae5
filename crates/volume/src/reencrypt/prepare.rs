//! What a new reencryption or encryption in place writes, decided from the caller's options in
//! one way for the CLI's offline `cryptblk reencrypt [--encrypt]` and the daemon's
//! `reencrypt-start`: the new cipher and key size (cryptsetup's defaults), the encryption
//! sector, the parameters of the header's reencryption or of the new header; and a LUKS1
//! header turned LUKS2 first, as both start a reencryption of one.
use cryptblk_crypto::{CipherSpec, CryptoError};
use cryptblk_luks::luks1::Luks1Header;
use cryptblk_luks::luks2::from_luks1::{convert_luks1, KeyslotPlacement};
use cryptblk_luks::luks2::reencrypt::{EncryptParams, InitParams, ResilienceChoice};
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{FormatOptions, HashAlg, HeaderIo, LuksError, PbkdfOptions, UnlockOptions};

/// cryptsetup's cipher for `--encrypt` unless told otherwise.
const DEFAULT_ENCRYPTION_CIPHER: &str = "aes-xts-plain64";
/// cryptsetup's encryption sector for `--encrypt` unless told otherwise, and what a raw
/// disk's guest was told its logical block is.
const DEFAULT_ENCRYPTION_SECTOR: u32 = 512;

/// Why the options of a new reencryption or encryption were refused, or the LUKS1 header
/// could not become LUKS2; the image is untouched. The texts name the options without the
/// CLI's dashes (`key-size`), as the control API spells them.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("key-size {bits} is not a whole number of bytes")]
    KeySize { bits: usize },
    #[error("sector-size {sector}: use a power of two from 512 to 4096")]
    SectorSize { sector: u32 },
    #[error("cipher {name}")]
    UnknownCipher {
        name: String,
        #[source]
        source: CryptoError,
    },
    #[error("cipher {name} with a {bits}-bit key")]
    Cipher {
        name: String,
        bits: usize,
        #[source]
        source: CryptoError,
    },
    #[error("reading the current cipher")]
    CurrentCipher(#[source] LuksError),
    #[error("unlocking the LUKS1 header of {image}")]
    Luks1Unlock {
        image: String,
        #[source]
        source: LuksError,
    },
    #[error("converting the LUKS1 header of {image} to LUKS2")]
    Luks1Convert {
        image: String,
        #[source]
        source: LuksError,
    },
}

impl PrepareError {
    /// An option's value is wrong (as opposed to a cipher this build lacks, or the image).
    pub fn is_bad_option(&self) -> bool {
        matches!(
            self,
            PrepareError::KeySize { .. } | PrepareError::SectorSize { .. }
        )
    }
}

/// The new layout as the caller's options give it; what is left out takes its default.
#[derive(Debug, Clone, Copy, Default)]
pub struct NewLayout<'a> {
    /// The cipher as LUKS2 names it (`aes-xts-plain64`).
    pub cipher: Option<&'a str>,
    /// Bits of the new key.
    pub key_bits: Option<usize>,
    /// Bytes of the new encryption sector.
    pub sector_size: Option<u32>,
}

/// The layout a run writes, its options checked.
#[derive(Debug, Clone)]
pub struct ChosenLayout {
    pub cipher: CipherSpec,
    /// `None` keeps the current sector size (a reencryption).
    pub sector_size: Option<u32>,
}

impl NewLayout<'_> {
    /// A reencryption of `header`: the cipher defaults to the current one (its key size too,
    /// unless another cipher is named), the sector size to the current one.
    pub fn for_reencryption(&self, header: &Luks2Header) -> Result<ChosenLayout, PrepareError> {
        let current = header.cipher_spec().map_err(PrepareError::CurrentCipher)?;
        let cipher = self.cipher(Some(&current))?;
        if let Some(sector) = self.sector_size {
            check_sector(sector)?;
        }
        Ok(ChosenLayout {
            cipher,
            sector_size: self.sector_size,
        })
    }

    /// An encryption in place: cryptsetup's `--encrypt` defaults (aes-xts-plain64, its
    /// default key size, 512-byte sectors).
    pub fn for_encryption(&self) -> Result<ChosenLayout, PrepareError> {
        let cipher = self.cipher(None)?;
        let sector = self.sector_size.unwrap_or(DEFAULT_ENCRYPTION_SECTOR);
        check_sector(sector)?;
        Ok(ChosenLayout {
            cipher,
            sector_size: Some(sector),
        })
    }

    /// The cipher: the one named (default: `current`'s, else aes-xts-plain64) with a key of
    /// the bits asked for (default: the current size when no cipher is named, else
    /// cryptsetup's: 512 for XTS and 256 for the others).
    fn cipher(&self, current: Option<&CipherSpec>) -> Result<CipherSpec, PrepareError> {
        let name = self
            .cipher
            .map(str::to_string)
            .or_else(|| current.map(CipherSpec::to_luks2_string))
            .unwrap_or_else(|| DEFAULT_ENCRYPTION_CIPHER.to_string());
        let bits = match (self.key_bits, current) {
            (Some(bits), _) => bits,
            (None, Some(c)) if self.cipher.is_none() => c.key_bytes() * 8,
            (None, _) => CipherSpec::default_key_bits(&name).map_err(|source| {
                PrepareError::UnknownCipher {
                    name: name.clone(),
                    source,
                }
            })?,
        };
        if !bits.is_multiple_of(8) {
            return Err(PrepareError::KeySize { bits });
        }
        CipherSpec::parse_luks2(&name, bits / 8).map_err(|source| PrepareError::Cipher {
            name,
            bits,
            source,
        })
    }
}

impl ChosenLayout {
    /// The header's reencryption to this layout: the new keyslot's KDF, the resilience of
    /// its hotzones, and the keyslot the passphrase opens (`None`: any).
    pub fn init_params(
        self,
        resilience: ResilienceChoice,
        pbkdf: PbkdfOptions,
        keyslot: Option<usize>,
    ) -> InitParams {
        InitParams {
            cipher: Some(self.cipher),
            sector_size: self.sector_size,
            resilience,
            pbkdf,
            keyslot,
        }
    }

    /// The new header of an encryption in place, with `reduce` bytes for the header and the
    /// data shift (cryptsetup's `--reduce-device-size`).
    pub fn encrypt_params(self, hash: HashAlg, pbkdf: PbkdfOptions, reduce: u64) -> EncryptParams {
        let sector = self.sector_size.unwrap_or(DEFAULT_ENCRYPTION_SECTOR);
        let mut format = FormatOptions::luks2(self.cipher, sector);
        format.hash = hash;
        format.pbkdf = pbkdf;
        EncryptParams { format, reduce }
    }
}

fn check_sector(sector: u32) -> Result<(), PrepareError> {
    if !(512..=4096).contains(&sector) || !sector.is_power_of_two() {
        return Err(PrepareError::SectorSize { sector });
    }
    Ok(())
}

/// A LUKS1 header becomes LUKS2 before its reencryption, as `cryptblk convert-header` does
/// it: the same volume key, data offset and 512-byte sectors, so a disk being served sees no
/// change. The passphrase is checked first, so a wrong one leaves the image LUKS1. `image`
/// names it in the errors.
pub fn convert_luks1_first(
    io: &dyn HeaderIo,
    v1: &Luks1Header,
    passphrase: &[u8],
    unlock: &UnlockOptions,
    image: &str,
) -> Result<(Luks2Header, KeyslotPlacement), PrepareError> {
    v1.unlock(io, passphrase, unlock)
        .map_err(|source| PrepareError::Luks1Unlock {
            image: image.to_string(),
            source,
        })?;
    convert_luks1(io, v1).map_err(|source| PrepareError::Luks1Convert {
        image: image.to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_encryption_takes_cryptsetups_defaults() {
        let chosen = NewLayout::default().for_encryption().unwrap();
        assert_eq!(chosen.cipher.to_luks2_string(), "aes-xts-plain64");
        assert_eq!(chosen.cipher.key_bytes(), 64);
        assert_eq!(chosen.sector_size, Some(512));
        let named = NewLayout {
            cipher: Some("aes-cbc-essiv:sha256"),
            ..NewLayout::default()
        };
        assert_eq!(named.for_encryption().unwrap().cipher.key_bytes(), 32);
    }

    #[test]
    fn options_off_the_grid_are_refused_by_name() {
        let odd_key = NewLayout {
            key_bits: Some(255),
            ..NewLayout::default()
        };
        let e = odd_key.for_encryption().unwrap_err();
        assert!(e.is_bad_option());
        assert_eq!(e.to_string(), "key-size 255 is not a whole number of bytes");
        for sector in [256, 1000, 8192] {
            let layout = NewLayout {
                sector_size: Some(sector),
                ..NewLayout::default()
            };
            let e = layout.for_encryption().unwrap_err();
            assert!(matches!(e, PrepareError::SectorSize { sector: s } if s == sector));
        }
        let unknown = NewLayout {
            cipher: Some("rot13-ecb"),
            ..NewLayout::default()
        };
        let e = unknown.for_encryption().unwrap_err();
        assert!(!e.is_bad_option());
        assert!(matches!(e, PrepareError::UnknownCipher { .. }), "{e:?}");
    }
}
