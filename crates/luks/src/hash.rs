use crate::LuksError;

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
}
