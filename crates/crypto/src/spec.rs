use crate::CryptoError;
use std::fmt;

/// Block cipher chaining mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Xts,
    Cbc,
}

/// How a sector's IV is derived from its sector number (dm-crypt's IV generators).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IvMode {
    /// Low 32 bits of the sector number, little-endian.
    Plain,
    /// 64-bit sector number, little-endian.
    Plain64,
    /// 64-bit sector number, big-endian.
    Plain64Be,
    /// ESSIV: the plain64 IV encrypted with AES keyed by hash(volume key); the IV cipher's key
    /// size is the hash's digest size, as in dm-crypt. Holds the hash name ("sha256").
    Essiv(String),
}

/// A LUKS cipher specification: cipher name, chaining mode, IV generator and key length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CipherSpec {
    cipher: String,
    mode: Mode,
    iv: IvMode,
    key_bytes: usize,
}

impl CipherSpec {
    /// From LUKS1-style split names: `("aes", "xts-plain64", 64)`.
    pub fn parse(
        cipher_name: &str,
        cipher_mode: &str,
        key_bytes: usize,
    ) -> Result<Self, CryptoError> {
        let cipher = cipher_name.to_ascii_lowercase();
        if cipher != "aes" {
            return Err(CryptoError::Unsupported {
                what: "cipher",
                name: cipher_name.to_string(),
            });
        }
        let mode_lc = cipher_mode.to_ascii_lowercase();
        let (chain, iv) = mode_lc.split_once('-').unwrap_or((mode_lc.as_str(), ""));
        let mode = match chain {
            "xts" => Mode::Xts,
            "cbc" => Mode::Cbc,
            _ => {
                return Err(CryptoError::Unsupported {
                    what: "cipher mode",
                    name: cipher_mode.to_string(),
                })
            }
        };
        let iv = match iv {
            "plain" => IvMode::Plain,
            "plain64" => IvMode::Plain64,
            "plain64be" => IvMode::Plain64Be,
            essiv if essiv.starts_with("essiv:") => {
                let hash = &essiv["essiv:".len()..];
                if !matches!(hash, "sha1" | "sha256" | "sha512") {
                    return Err(CryptoError::Unsupported {
                        what: "ESSIV hash",
                        name: hash.to_string(),
                    });
                }
                IvMode::Essiv(hash.to_string())
            }
            _ => {
                return Err(CryptoError::Unsupported {
                    what: "IV generator",
                    name: cipher_mode.to_string(),
                })
            }
        };
        if mode == Mode::Xts && matches!(iv, IvMode::Essiv(_)) {
            // xts-essiv exists in dm-crypt but no LUKS tool creates it by default; refuse clearly.
            return Err(CryptoError::Unsupported {
                what: "cipher mode",
                name: cipher_mode.to_string(),
            });
        }
        let spec = CipherSpec {
            cipher,
            mode,
            iv,
            key_bytes,
        };
        spec.check_key_size()?;
        Ok(spec)
    }

    /// From a LUKS2 / cryptsetup-style joined name: `"aes-xts-plain64"`.
    pub fn parse_luks2(joined: &str, key_bytes: usize) -> Result<Self, CryptoError> {
        match joined.split_once('-') {
            Some((cipher, mode)) => Self::parse(cipher, mode, key_bytes),
            None => Err(CryptoError::Unsupported {
                what: "cipher",
                name: joined.to_string(),
            }),
        }
    }

    /// cryptsetup's default key size for a joined cipher name, in bits: 512 for XTS (two
    /// 256-bit keys), 256 for the other modes.
    pub fn default_key_bits(joined: &str) -> Result<usize, CryptoError> {
        let probe = Self::parse_luks2(joined, 32).or_else(|_| Self::parse_luks2(joined, 64))?;
        Ok(if probe.mode == Mode::Xts { 512 } else { 256 })
    }

    fn check_key_size(&self) -> Result<(), CryptoError> {
        let (ok, expected) = match self.mode {
            Mode::Xts => (
                matches!(self.key_bytes, 32 | 48 | 64),
                "256, 384 or 512 bits for XTS",
            ),
            Mode::Cbc => (
                matches!(self.key_bytes, 16 | 24 | 32),
                "128, 192 or 256 bits for CBC",
            ),
        };
        if ok {
            Ok(())
        } else {
            Err(CryptoError::InvalidKeySize {
                bits: self.key_bytes * 8,
                spec: self.to_luks2_string(),
                expected,
            })
        }
    }

    pub fn cipher_name(&self) -> &str {
        &self.cipher
    }

    /// The mode string as LUKS1 stores it, e.g. "xts-plain64", "cbc-essiv:sha256".
    pub fn cipher_mode(&self) -> String {
        let chain = match self.mode {
            Mode::Xts => "xts",
            Mode::Cbc => "cbc",
        };
        let iv = match &self.iv {
            IvMode::Plain => "plain".to_string(),
            IvMode::Plain64 => "plain64".to_string(),
            IvMode::Plain64Be => "plain64be".to_string(),
            IvMode::Essiv(h) => format!("essiv:{h}"),
        };
        format!("{chain}-{iv}")
    }

    /// "aes-xts-plain64" as LUKS2 and cryptsetup write it.
    pub fn to_luks2_string(&self) -> String {
        format!("{}-{}", self.cipher, self.cipher_mode())
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn iv_mode(&self) -> &IvMode {
        &self.iv
    }

    /// Volume key length in bytes (both XTS halves together).
    pub fn key_bytes(&self) -> usize {
        self.key_bytes
    }
}

impl fmt::Display for CipherSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} bits)",
            self.to_luks2_string(),
            self.key_bytes * 8
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_key_sizes_are_cryptsetups() {
        assert_eq!(
            CipherSpec::default_key_bits("aes-xts-plain64").unwrap(),
            512
        );
        assert_eq!(
            CipherSpec::default_key_bits("aes-cbc-essiv:sha256").unwrap(),
            256
        );
        assert!(CipherSpec::default_key_bits("serpent-xts-plain64").is_err());
    }

    #[test]
    fn parses_luks_names() {
        let s = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
        assert_eq!(s.mode(), Mode::Xts);
        assert_eq!(s.to_luks2_string(), "aes-xts-plain64");
        let s = CipherSpec::parse("aes", "cbc-essiv:sha256", 32).unwrap();
        assert_eq!(s.iv_mode(), &IvMode::Essiv("sha256".into()));
        assert_eq!(s.cipher_mode(), "cbc-essiv:sha256");
    }

    #[test]
    fn refuses_unsupported_with_name() {
        let e = CipherSpec::parse("serpent", "xts-plain64", 64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("serpent"), "{e}");
        let e = CipherSpec::parse("aes", "lrw-benbi", 48)
            .unwrap_err()
            .to_string();
        assert!(e.contains("lrw-benbi"), "{e}");
        let e = CipherSpec::parse("aes", "xts-plain64", 20)
            .unwrap_err()
            .to_string();
        assert!(e.contains("160 bits"), "{e}");
    }
}
