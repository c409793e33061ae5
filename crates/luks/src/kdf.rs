//! Passphrase key derivation: PBKDF2 and argon2i/argon2id, plus the cost benchmark.
use crate::{HashAlg, Result};
use cryptblk_crypto::SecretKey;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Argon2Variant {
    Argon2i,
    Argon2id,
}

/// A fully specified KDF, as stored in a keyslot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kdf {
    Pbkdf2 { hash: HashAlg, iterations: u32 },
    Argon2 { variant: Argon2Variant, time: u32, memory_kib: u32, parallel: u32 },
}

/// Derive `out_len` bytes from `passphrase` and `salt`.
pub fn derive(kdf: &Kdf, passphrase: &[u8], salt: &[u8], out_len: usize) -> Result<SecretKey> {
    let _ = (kdf, passphrase, salt, out_len);
    todo!()
}
