//! dm-crypt IV generators, shared by every engine so that all of them derive the same IV for
//! the same sector number.

use crate::{CipherSpec, CryptoError, IvMode, SecretKey};
use aes::cipher::{BlockCipherEncrypt, KeyInit};
use aes::Aes256;
use sha2::Digest;
use zeroize::Zeroizing;

/// AES block and IV size.
pub(crate) const IV_LEN: usize = 16;

/// Derives the 16-byte IV (or XTS tweak) of a sector from its sector number.
pub(crate) struct IvGen {
    kind: IvKind,
    /// log2(sector size / 512): LUKS2 with 4096-byte sectors still numbers IVs in 512-byte
    /// units (cryptsetup never sets dm-crypt's `iv_large_sectors` for LUKS), so encryption
    /// sector N gets IV N * 8.
    iv_shift: u32,
}

enum IvKind {
    Plain,
    Plain64,
    Plain64Be,
    /// AES keyed with the hash of the volume key. Only SHA-256 gives a valid AES key size,
    /// so this is always AES-256 (the `aes` crate zeroizes its round keys on drop).
    Essiv(Box<Aes256>),
}

/// Refuses IV generators that the spec parser accepts but that cannot work with AES, so that
/// callers see the reason instead of a generic "no engine".
pub(crate) fn check_supported(spec: &CipherSpec) -> Result<(), CryptoError> {
    if let IvMode::Essiv(hash) = spec.iv_mode() {
        if hash != "sha256" {
            // dm-crypt keys the ESSIV cipher with the whole digest: 160 bits (sha1) and 512 bits
            // (sha512) are not AES key sizes, so the kernel refuses these too.
            return Err(CryptoError::Unsupported {
                what: "ESSIV hash (its digest size is not an AES key size)",
                name: hash.clone(),
            });
        }
    }
    Ok(())
}

impl IvGen {
    /// `sector_size` must already be validated (a power of two from 512 up).
    pub(crate) fn new(
        spec: &CipherSpec,
        key: &SecretKey,
        sector_size: usize,
    ) -> Result<Self, CryptoError> {
        check_supported(spec)?;
        let iv_shift = (sector_size / 512).trailing_zeros();
        let kind = match spec.iv_mode() {
            IvMode::Plain => IvKind::Plain,
            IvMode::Plain64 => IvKind::Plain64,
            IvMode::Plain64Be => IvKind::Plain64Be,
            IvMode::Essiv(_) => {
                let salt = Zeroizing::new(<[u8; 32]>::from(sha2::Sha256::digest(key.as_bytes())));
                let aes =
                    Aes256::new_from_slice(salt.as_slice()).map_err(|_| CryptoError::Engine {
                        engine: "essiv",
                        message: "SHA-256 digest rejected as an AES-256 key".into(),
                    })?;
                IvKind::Essiv(Box::new(aes))
            }
        };
        Ok(IvGen { kind, iv_shift })
    }

    /// The IV of `sector`, counted in units of the cipher's sector size.
    #[inline]
    pub(crate) fn iv(&self, sector: u64) -> [u8; IV_LEN] {
        let sector = sector << self.iv_shift;
        let mut iv = [0u8; IV_LEN];
        match &self.kind {
            IvKind::Plain => iv[..4].copy_from_slice(&(sector as u32).to_le_bytes()),
            IvKind::Plain64 => iv[..8].copy_from_slice(&sector.to_le_bytes()),
            // dm-crypt puts the big-endian number in the *last* 8 bytes of the IV.
            IvKind::Plain64Be => iv[IV_LEN - 8..].copy_from_slice(&sector.to_be_bytes()),
            IvKind::Essiv(aes) => {
                iv[..8].copy_from_slice(&sector.to_le_bytes());
                aes.encrypt_block((&mut iv).into());
            }
        }
        iv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_sectors_number_ivs_in_512_byte_units() {
        let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
        let key = SecretKey::from_slice(&[7u8; 64]);
        let small = IvGen::new(&spec, &key, 512).unwrap();
        let large = IvGen::new(&spec, &key, 4096).unwrap();
        assert_eq!(large.iv(1), small.iv(8));
        assert_eq!(large.iv(3), small.iv(24));
        assert_ne!(large.iv(1), small.iv(1));
    }

    fn gen(mode: &str, key: &[u8]) -> IvGen {
        let spec = CipherSpec::parse("aes", mode, 32).unwrap();
        IvGen::new(&spec, &SecretKey::from_slice(key), 512).unwrap()
    }

    #[test]
    fn plain_variants_layout() {
        let key = [7u8; 32];
        let n = 0x0102_0304_0506_0708u64;
        assert_eq!(
            gen("cbc-plain", &key).iv(n)[..],
            hex::decode("08070605000000000000000000000000").unwrap()
        );
        assert_eq!(
            gen("cbc-plain64", &key).iv(n)[..],
            hex::decode("08070605040302010000000000000000").unwrap()
        );
        assert_eq!(
            gen("cbc-plain64be", &key).iv(n)[..],
            hex::decode("00000000000000000102030405060708").unwrap()
        );
    }

    #[test]
    fn essiv_is_aes256_of_plain64_under_sha256_of_key() {
        // Independent computation with OpenSSL: AES-256-ECB keyed by SHA-256(key).
        let key = [0x11u8; 32];
        let salt = openssl::sha::sha256(&key);
        let mut block = [0u8; 16];
        block[..8].copy_from_slice(&5u64.to_le_bytes());
        let mut c = openssl::symm::Crypter::new(
            openssl::symm::Cipher::aes_256_ecb(),
            openssl::symm::Mode::Encrypt,
            &salt,
            None,
        )
        .unwrap();
        c.pad(false);
        let mut out = [0u8; 32];
        let n = c.update(&block, &mut out).unwrap();
        assert_eq!(n, 16);
        assert_eq!(gen("cbc-essiv:sha256", &key).iv(5), out[..16]);
    }

    #[test]
    fn essiv_with_non_aes_digest_is_refused_by_name() {
        for hash in ["sha1", "sha512"] {
            let spec = CipherSpec::parse("aes", &format!("cbc-essiv:{hash}"), 32).unwrap();
            let err = IvGen::new(&spec, &SecretKey::from_slice(&[1u8; 32]), 512)
                .err()
                .unwrap();
            assert!(matches!(err, CryptoError::Unsupported { .. }), "{err}");
            assert!(err.to_string().contains(hash), "{err}");
        }
    }
}
