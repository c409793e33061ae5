//! XTS over a RustCrypto block cipher, batched per sector.
//!
//! The `xts-mode` crate encrypts one block per cipher call. With `aes` 0.9 every call goes
//! through run-time backend dispatch and, on VAES machines, round-key broadcasts (its speed:
//! `ENGINES.md`). Here all tweaks of a batch are XORed in first, the whole batch goes
//! through `encrypt_blocks` (which the `aes` crate pipelines 8-32 blocks wide), and the tweaks
//! are XORed again. Sectors are whole blocks (512..4096 bytes), so ciphertext stealing is never
//! needed. The `xts-mode` crate stays as the test reference for this code.

use aes::cipher::array::Array;
use aes::cipher::consts::U16;
use aes::cipher::{BlockCipherDecrypt, BlockCipherEncrypt, BlockSizeUser};
use zeroize::Zeroize;

use crate::Direction;

/// Blocks per cipher call: a whole 4 KiB sector. Each `encrypt_blocks` call re-broadcasts the
/// round keys on VAES, so fewer, larger calls win (profiled); the 4 KiB tweak buffer stays in L1.
const BATCH: usize = 256;

pub(crate) struct Xts<C> {
    data: C,
    tweak: C,
}

impl<C> Xts<C>
where
    C: BlockCipherEncrypt + BlockCipherDecrypt + BlockSizeUser<BlockSize = U16>,
{
    pub(crate) fn new(data: C, tweak: C) -> Self {
        Xts { data, tweak }
    }

    /// Transforms whole sectors of `sector_size` bytes; `iv(i)` gives the IV of the i-th.
    pub(crate) fn crypt_sectors(
        &self,
        dir: Direction,
        data: &mut [u8],
        sector_size: usize,
        mut iv: impl FnMut(usize) -> [u8; 16],
    ) {
        // Tweak values derive from the tweak key; wiped when the call ends.
        let mut tweaks = [0u128; BATCH];
        for (i, sector) in data.chunks_exact_mut(sector_size).enumerate() {
            let mut t = Array(iv(i));
            self.tweak.encrypt_block(&mut t);
            let t0 = u128::from_le_bytes(t.0);
            // Four interleaved tweak chains, each advanced by alpha^4: the serial
            // multiply-by-alpha chain was as costly as the AES rounds themselves (profiled).
            let t1 = mul_alpha(t0);
            let t2 = mul_alpha(t1);
            let mut lanes = [t0, t1, t2, mul_alpha(t2)];
            let (blocks, _) = Array::<u8, U16>::slice_as_chunks_mut(sector);
            for batch in blocks.chunks_mut(BATCH) {
                // BATCH is a multiple of 4, so lane `j & 3` stays in step across batches.
                for (j, (block, slot)) in batch.iter_mut().zip(tweaks.iter_mut()).enumerate() {
                    let lane = &mut lanes[j & 3];
                    *slot = *lane;
                    xor_in(block, *lane);
                    *lane = mul_alpha4(*lane);
                }
                match dir {
                    Direction::Encrypt => self.data.encrypt_blocks(batch),
                    Direction::Decrypt => self.data.decrypt_blocks(batch),
                }
                for (block, &t) in batch.iter_mut().zip(tweaks.iter()) {
                    xor_in(block, t);
                }
            }
            lanes.zeroize();
            t.0.zeroize();
        }
        tweaks.zeroize();
    }
}

#[inline(always)]
fn xor_in(block: &mut Array<u8, U16>, tweak: u128) {
    block.0 = (u128::from_le_bytes(block.0) ^ tweak).to_le_bytes();
}

/// Multiplication by x in GF(2^128) with the XTS little-endian convention.
#[inline(always)]
fn mul_alpha(t: u128) -> u128 {
    let carry = (t >> 127) as u8;
    (t << 1) ^ u128::from(0x87 * carry)
}

/// Multiplication by x^4: the four bits shifted out of the top are reduced with the
/// carry-less products of 0x87 in `ALPHA4_REDUCE`.
#[inline(always)]
fn mul_alpha4(t: u128) -> u128 {
    (t << 4) ^ u128::from(ALPHA4_REDUCE[(t >> 124) as usize])
}

const ALPHA4_REDUCE: [u16; 16] = {
    let mut table = [0u16; 16];
    let mut x = 0;
    while x < 16 {
        let mut r = 0u16;
        let mut bit = 0;
        while bit < 4 {
            if (x >> bit) & 1 == 1 {
                r ^= 0x87 << bit;
            }
            bit += 1;
        }
        table[x] = r;
        x += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;
    use aes::cipher::KeyInit;
    use aes::Aes256;
    use rand::{RngCore, SeedableRng};

    #[test]
    fn alpha4_is_four_alphas() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for _ in 0..1000 {
            let t = (u128::from(rng.next_u64()) << 64) | u128::from(rng.next_u64());
            assert_eq!(mul_alpha4(t), mul_alpha(mul_alpha(mul_alpha(mul_alpha(t)))));
        }
        assert_eq!(
            mul_alpha4(u128::MAX),
            mul_alpha(mul_alpha(mul_alpha(mul_alpha(u128::MAX))))
        );
    }

    #[test]
    fn matches_xts_mode_crate() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let mut key = [0u8; 64];
        rng.fill_bytes(&mut key);
        let ours = Xts::new(
            Aes256::new_from_slice(&key[..32]).unwrap(),
            Aes256::new_from_slice(&key[32..]).unwrap(),
        );
        let theirs = xts_mode::Xts128::new(
            Aes256::new_from_slice(&key[..32]).unwrap(),
            Aes256::new_from_slice(&key[32..]).unwrap(),
        );
        for ss in [512usize, 1024, 4096] {
            let mut plain = vec![0u8; 3 * ss];
            rng.fill_bytes(&mut plain);
            let mut a = plain.clone();
            ours.crypt_sectors(Direction::Encrypt, &mut a, ss, |i| {
                ((77 + i) as u128).to_le_bytes()
            });
            let mut b = plain.clone();
            theirs.encrypt_area(&mut b, ss, 77, xts_mode::get_tweak_default);
            assert!(a == b, "sector size {ss}");
            ours.crypt_sectors(Direction::Decrypt, &mut a, ss, |i| {
                ((77 + i) as u128).to_le_bytes()
            });
            assert!(a == plain);
        }
    }
}
