use crate::CryptoError;
use std::fmt;
use zeroize::{Zeroize, ZeroizeOnDrop};

/// Key bytes (a volume key or a derived keyslot key). Zeroized on drop; `Debug` never prints
/// the bytes.
#[derive(Clone, Zeroize, ZeroizeOnDrop, PartialEq, Eq)]
pub struct SecretKey(Vec<u8>);

impl SecretKey {
    pub fn new(bytes: Vec<u8>) -> Self {
        SecretKey(bytes)
    }

    pub fn from_slice(bytes: &[u8]) -> Self {
        SecretKey(bytes.to_vec())
    }

    /// A fresh random key of `len` bytes from the OS RNG (through OpenSSL's CSPRNG). Fails,
    /// rather than returning predictable bytes, when the RNG cannot be seeded or read.
    pub fn random(len: usize) -> Result<Self, CryptoError> {
        let mut key = SecretKey(vec![0u8; len]);
        openssl::rand::rand_bytes(&mut key.0).map_err(|e| CryptoError::Rng(e.to_string()))?;
        Ok(key)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretKey({} bytes, redacted)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_keys_have_the_length_asked_and_differ() {
        let a = SecretKey::random(64).unwrap();
        let b = SecretKey::random(64).unwrap();
        assert_eq!(a.len(), 64);
        assert_ne!(a, b, "two 512-bit random keys collided");
        assert!(a.as_bytes().iter().any(|&x| x != 0));
        assert!(SecretKey::random(0).unwrap().is_empty());
    }
}
