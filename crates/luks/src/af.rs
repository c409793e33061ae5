//! The LUKS anti-forensic splitter (AFsplit / AFmerge with the hash diffuser).
//!
//! A key is spread over `stripes` blocks so that destroying any one block of the on-disk
//! material makes the key unrecoverable. Blocks 0..stripes-1 are random; the running value
//! `d = diffuse(d ^ block)` is folded over them, and the last block is `d ^ key`. Merging
//! recomputes `d` from the first stripes-1 blocks and XORs it with the last one.
use crate::{HashAlg, Result};
use cryptblk_crypto::SecretKey;
use zeroize::Zeroizing;

/// Stripes of every keyslot cryptblk writes, as cryptsetup and QEMU use for LUKS1 and LUKS2.
pub const STRIPES: u32 = 4000;

/// Split `key` into `stripes` stripes (returns key.len() * stripes bytes of key material).
///
/// `stripes` of 0 is treated as 1 (the material is then the key itself); callers validate
/// stripe counts read from headers before getting here. Fails only if the OS RNG does.
pub fn af_split(key: &SecretKey, stripes: u32, hash: HashAlg) -> Result<Zeroizing<Vec<u8>>> {
    let key = key.as_bytes();
    let block_len = key.len();
    let stripes = stripes.max(1) as usize;
    let mut out = Zeroizing::new(vec![0u8; block_len * stripes]);
    if block_len == 0 {
        return Ok(out);
    }
    let mut acc = Zeroizing::new(vec![0u8; block_len]);
    let (random_part, last) = out.split_at_mut(block_len * (stripes - 1));
    fill_random(random_part)?;
    for block in random_part.chunks_exact(block_len) {
        xor_into(&mut acc, block);
        diffuse(&mut acc, hash);
    }
    for ((o, a), k) in last.iter_mut().zip(acc.iter()).zip(key.iter()) {
        *o = a ^ k;
    }
    Ok(out)
}

/// Merge `material` (key_len * stripes bytes) back into the key.
///
/// Material shorter than `key_len * stripes` is merged as if zero-padded, so a caller bug or a
/// damaged header yields a wrong key (caught by the digest check), never a panic.
pub fn af_merge(material: &[u8], key_len: usize, stripes: u32, hash: HashAlg) -> SecretKey {
    let stripes = stripes.max(1) as usize;
    let mut acc = Zeroizing::new(vec![0u8; key_len]);
    if key_len == 0 {
        return SecretKey::new(Vec::new());
    }
    for i in 0..stripes - 1 {
        xor_into(&mut acc, block_at(material, i, key_len));
        diffuse(&mut acc, hash);
    }
    xor_into(&mut acc, block_at(material, stripes - 1, key_len));
    SecretKey::from_slice(&acc)
}

fn block_at(material: &[u8], index: usize, len: usize) -> &[u8] {
    let start = index.saturating_mul(len).min(material.len());
    let end = start.saturating_add(len).min(material.len());
    material.get(start..end).unwrap_or(&[])
}

fn xor_into(acc: &mut [u8], block: &[u8]) {
    for (a, b) in acc.iter_mut().zip(block.iter()) {
        *a ^= b;
    }
}

/// The LUKS diffuser: each digest-sized piece `p_i` (the last one possibly shorter) becomes
/// the first `len(p_i)` bytes of `hash(be32(i) || p_i)`.
fn diffuse(buf: &mut [u8], hash: HashAlg) {
    let dlen = hash.digest_len();
    for (i, piece) in buf.chunks_mut(dlen).enumerate() {
        let index = (i as u32).to_be_bytes();
        let digest = hash.digest(&[&index, piece]);
        let n = piece.len();
        piece.copy_from_slice(&digest[..n]);
    }
}

/// The stripes only need to be unpredictable, the same requirement as a fresh volume key, so
/// they come from the same OS RNG `SecretKey::random` uses.
fn fill_random(buf: &mut [u8]) -> Result<()> {
    for chunk in buf.chunks_mut(4096) {
        let r = SecretKey::random(chunk.len())?;
        chunk.copy_from_slice(r.as_bytes());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_merge_round_trip_all_hashes() {
        for hash in [HashAlg::Sha1, HashAlg::Sha256, HashAlg::Sha512] {
            for len in [16usize, 32, 33, 64, 70] {
                let key = SecretKey::random(len).unwrap();
                let m = af_split(&key, 4000, hash).unwrap();
                assert_eq!(m.len(), len * 4000);
                assert_eq!(af_merge(&m, len, 4000, hash), key);
            }
        }
    }

    #[test]
    fn damaging_one_stripe_destroys_key() {
        let key = SecretKey::random(32).unwrap();
        let mut m = af_split(&key, 10, HashAlg::Sha256).unwrap();
        m[40] ^= 1;
        assert_ne!(af_merge(&m, 32, 10, HashAlg::Sha256), key);
    }

    #[test]
    fn short_material_does_not_panic() {
        let k = af_merge(&[1, 2, 3], 32, 4000, HashAlg::Sha1);
        assert_eq!(k.len(), 32);
    }
}
