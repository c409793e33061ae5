//! The LUKS anti-forensic splitter (AFsplit / AFmerge with the hash diffuser).
use crate::HashAlg;
use cryptblk_crypto::SecretKey;

/// Split `key` into `stripes` stripes (returns key.len() * stripes bytes of key material).
pub fn af_split(key: &SecretKey, stripes: u32, hash: HashAlg) -> zeroize::Zeroizing<Vec<u8>> {
    let _ = (key, stripes, hash);
    todo!()
}

/// Merge `material` (key_len * stripes bytes) back into the key.
pub fn af_merge(material: &[u8], key_len: usize, stripes: u32, hash: HashAlg) -> SecretKey {
    let _ = (material, key_len, stripes, hash);
    todo!()
}
