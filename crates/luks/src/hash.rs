use crate::LuksError;
use sha2::Digest;

/// Hash functions LUKS uses for PBKDF2, the AF splitter's diffuser and digests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlg {
    Sha1,
    Sha256,
    Sha512,
}

impl HashAlg {
    pub fn parse(name: &str) -> Result<Self, LuksError> {
        match name.to_ascii_lowercase().as_str() {
            "sha1" => Ok(HashAlg::Sha1),
            "sha256" => Ok(HashAlg::Sha256),
            "sha512" => Ok(HashAlg::Sha512),
            _ => Err(LuksError::Unsupported {
                what: "hash",
                name: name.to_string(),
                hint: "cryptblk supports sha1, sha256 and sha512".to_string(),
            }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HashAlg::Sha1 => "sha1",
            HashAlg::Sha256 => "sha256",
            HashAlg::Sha512 => "sha512",
        }
    }

    pub fn digest_len(self) -> usize {
        match self {
            HashAlg::Sha1 => 20,
            HashAlg::Sha256 => 32,
            HashAlg::Sha512 => 64,
        }
    }

    /// Hash the concatenation of `parts`. The result may be key material (AF diffuser), so it
    /// is zeroized on drop.
    pub fn digest(self, parts: &[&[u8]]) -> zeroize::Zeroizing<Vec<u8>> {
        fn run<D: Digest>(parts: &[&[u8]]) -> Vec<u8> {
            let mut h = D::new();
            for p in parts {
                h.update(p);
            }
            h.finalize().to_vec()
        }
        zeroize::Zeroizing::new(match self {
            HashAlg::Sha1 => run::<sha1::Sha1>(parts),
            HashAlg::Sha256 => run::<sha2::Sha256>(parts),
            HashAlg::Sha512 => run::<sha2::Sha512>(parts),
        })
    }

    /// PBKDF2-HMAC with this hash.
    pub fn pbkdf2(self, password: &[u8], salt: &[u8], iterations: u32, out: &mut [u8]) {
        match self {
            HashAlg::Sha1 => pbkdf2::pbkdf2_hmac::<sha1::Sha1>(password, salt, iterations, out),
            HashAlg::Sha256 => pbkdf2::pbkdf2_hmac::<sha2::Sha256>(password, salt, iterations, out),
            HashAlg::Sha512 => pbkdf2::pbkdf2_hmac::<sha2::Sha512>(password, salt, iterations, out),
        }
    }
}
