//! Keyslot areas hold AF-split key material encrypted with the keyslot cipher, 512-byte sectors
//! numbered from 0 at the start of the area.
use crate::Result;
use cryptblk_crypto::{CipherSpec, SecretKey};

pub fn encrypt_area(spec: &CipherSpec, key: &SecretKey, data: &mut [u8]) -> Result<()> {
    let _ = (spec, key, data);
    todo!()
}

pub fn decrypt_area(spec: &CipherSpec, key: &SecretKey, data: &mut [u8]) -> Result<()> {
    let _ = (spec, key, data);
    todo!()
}
