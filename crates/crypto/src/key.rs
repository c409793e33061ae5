use crate::locked::LockedBytes;
use crate::CryptoError;
use std::fmt;
use zeroize::{Zeroize, ZeroizeOnDrop};

/// Key bytes (a volume key or a derived keyslot key), in pages of their own that are locked
/// in memory and left out of core dumps (see `locked.rs`), wiped when dropped. `Debug` never
/// prints the bytes.
pub struct SecretKey(LockedBytes);

impl SecretKey {
    /// Takes `bytes` into locked pages; the vector given is wiped.
    pub fn new(mut bytes: Vec<u8>) -> Self {
        let key = SecretKey::from_slice(&bytes);
        bytes.zeroize();
        key
    }

    pub fn from_slice(bytes: &[u8]) -> Self {
        SecretKey(LockedBytes::copy_of(bytes))
    }

    /// A fresh random key of `len` bytes from the OS RNG (through OpenSSL's CSPRNG). Fails,
    /// rather than returning predictable bytes, when the RNG cannot be seeded or read.
    pub fn random(len: usize) -> Result<Self, CryptoError> {
        let mut key = SecretKey(LockedBytes::zeroed(len));
        openssl::rand::rand_bytes(key.0.as_mut_slice())
            .map_err(|e| CryptoError::Rng(e.to_string()))?;
        Ok(key)
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_slice()
    }

    pub fn len(&self) -> usize {
        self.0.as_slice().len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.as_slice().is_empty()
    }
}

impl Clone for SecretKey {
    fn clone(&self) -> Self {
        SecretKey::from_slice(self.as_bytes())
    }
}

impl PartialEq for SecretKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for SecretKey {}

impl Zeroize for SecretKey {
    fn zeroize(&mut self) {
        self.0.as_mut_slice().zeroize();
    }
}

/// `LockedBytes` wipes its pages when dropped.
impl ZeroizeOnDrop for SecretKey {}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretKey({} bytes, redacted)", self.len())
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
