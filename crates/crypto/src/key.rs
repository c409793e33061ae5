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

    /// A fresh random key of `len` bytes from the OS RNG.
    pub fn random(len: usize) -> Self {
        let mut bytes = vec![0u8; len];
        openssl::rand::rand_bytes(&mut bytes).expect("OS random number generator failed");
        SecretKey(bytes)
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
