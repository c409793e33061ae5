//! AES key schedules for the `vaes` engine, expanded with AES-NI straight into locked pages
//! (`LockedBytes`: never swapped, not in core dumps, wiped on drop).
//!
//! One page holds three schedules of `rounds + 1` round keys of 16 bytes each: encryption
//! with the data key, decryption with the data key (the "equivalent inverse cipher" that
//! `vaesdec` runs: the encryption keys in reverse order, the inner ones through
//! InvMixColumns), and encryption with the tweak key. The kernels broadcast each 16-byte key
//! to both halves of a YMM register as they load it.

use super::VaesCpu;
use crate::locked::LockedBytes;
use std::arch::x86_64::{
    __m128i, _mm_aesimc_si128, _mm_aeskeygenassist_si128, _mm_cvtsi128_si64, _mm_set_epi64x,
    _mm_shuffle_epi32, _mm_slli_si128, _mm_unpackhi_epi64, _mm_xor_si128,
};

/// Room for one schedule of the longest key (AES-256: 15 round keys).
const SLOT: usize = 15 * 16;

/// One key schedule: 11 (AES-128) or 15 (AES-256) round keys of 16 bytes, the rest zero.
pub(super) type Schedule = [u8; SLOT];

/// The three schedules of an XTS key.
pub(super) struct Schedules {
    pages: LockedBytes,
    rounds: usize,
}

impl Schedules {
    /// Expands an XTS key: the first half is the data key, the second the tweak key, each 16
    /// (AES-128) or 32 (AES-256) bytes. Panics on another length (the engine checks it first).
    pub(super) fn new(cpu: VaesCpu, xts_key: &[u8]) -> Schedules {
        assert!(
            matches!(xts_key.len(), 32 | 64),
            "an XTS key for the vaes engine has 32 or 64 bytes, not {}",
            xts_key.len()
        );
        let _ = cpu;
        // SAFETY: `cpu` proves the CPU has AES-NI (a `VaesCpu` exists only after detection).
        unsafe { Self::expand_all(xts_key) }
    }

    #[target_feature(enable = "aes")]
    fn expand_all(xts_key: &[u8]) -> Schedules {
        let half = xts_key.len() / 2;
        let (data, tweak) = xts_key.split_at(half);
        let rounds = if half == 16 { 10 } else { 14 };
        let mut pages = LockedBytes::zeroed(3 * SLOT);
        let (enc, rest) = pages.as_mut_slice()[..3 * SLOT].split_at_mut(SLOT);
        let (dec, twk) = rest.split_at_mut(SLOT);
        let (enc, dec, twk) = (slot_mut(enc), slot_mut(dec), slot_mut(twk));
        expand(data, enc);
        invert(enc, dec, rounds);
        expand(tweak, twk);
        Schedules { pages, rounds }
    }

    pub(super) fn rounds(&self) -> usize {
        self.rounds
    }

    /// The data key's encryption schedule.
    pub(super) fn encrypt(&self) -> &Schedule {
        self.slot(0)
    }

    /// The data key's decryption schedule (equivalent inverse cipher).
    pub(super) fn decrypt(&self) -> &Schedule {
        self.slot(1)
    }

    /// The tweak key's encryption schedule.
    pub(super) fn tweak(&self) -> &Schedule {
        self.slot(2)
    }

    fn slot(&self, index: usize) -> &Schedule {
        self.pages.as_slice()[index * SLOT..(index + 1) * SLOT]
            .try_into()
            .expect("a slot is SLOT bytes")
    }
}

fn slot_mut(bytes: &mut [u8]) -> &mut Schedule {
    bytes.try_into().expect("a slot is SLOT bytes")
}

/// 16 bytes as a register, byte 0 in the lowest lane (as `movdqu` loads them).
#[inline]
#[target_feature(enable = "sse2")]
fn load(bytes: &[u8; 16]) -> __m128i {
    let v = u128::from_le_bytes(*bytes);
    _mm_set_epi64x((v >> 64) as i64, v as i64)
}

/// A register's 16 bytes, lowest lane first (as `movdqu` stores them).
#[inline]
#[target_feature(enable = "sse2")]
fn store(k: __m128i, out: &mut [u8; 16]) {
    let lo = _mm_cvtsi128_si64(k) as u64;
    let hi = _mm_cvtsi128_si64(_mm_unpackhi_epi64(k, k)) as u64;
    *out = (u128::from(hi) << 64 | u128::from(lo)).to_le_bytes();
}

/// Expands a 16- or 32-byte AES key into 11 or 15 round keys in `out`.
#[target_feature(enable = "aes")]
fn expand(key: &[u8], out: &mut Schedule) {
    let (round_keys, _) = out.as_chunks_mut::<16>();
    let (halves, _) = key.as_chunks::<16>();
    let mut put = |i: usize, k: __m128i| store(k, &mut round_keys[i]);
    if key.len() == 16 {
        let mut k = load(&halves[0]);
        put(0, k);
        macro_rules! step {
            ($i:literal, $rcon:literal) => {
                k = mix(
                    k,
                    _mm_shuffle_epi32::<0xff>(_mm_aeskeygenassist_si128::<$rcon>(k)),
                );
                put($i, k);
            };
        }
        step!(1, 0x01);
        step!(2, 0x02);
        step!(3, 0x04);
        step!(4, 0x08);
        step!(5, 0x10);
        step!(6, 0x20);
        step!(7, 0x40);
        step!(8, 0x80);
        step!(9, 0x1b);
        step!(10, 0x36);
    } else {
        let (mut a, mut b) = (load(&halves[0]), load(&halves[1]));
        put(0, a);
        put(1, b);
        // Even round keys take the rotated, substituted last word of the previous odd key
        // and a round constant; odd ones the substituted (not rotated) last word of the
        // previous even key.
        macro_rules! pair {
            ($i:literal, $rcon:literal) => {
                a = mix(
                    a,
                    _mm_shuffle_epi32::<0xff>(_mm_aeskeygenassist_si128::<$rcon>(b)),
                );
                put($i, a);
                b = mix(
                    b,
                    _mm_shuffle_epi32::<0xaa>(_mm_aeskeygenassist_si128::<0>(a)),
                );
                put($i + 1, b);
            };
        }
        pair!(2, 0x01);
        pair!(4, 0x02);
        pair!(6, 0x04);
        pair!(8, 0x08);
        pair!(10, 0x10);
        pair!(12, 0x20);
        a = mix(
            a,
            _mm_shuffle_epi32::<0xff>(_mm_aeskeygenassist_si128::<0x40>(b)),
        );
        put(14, a);
    }
}

/// w0..w3 of the next key from the previous key's words and the word `t` derived from the
/// key before: each word is the XOR of all earlier words of the previous key and `t`.
#[inline]
#[target_feature(enable = "aes")]
fn mix(prev: __m128i, t: __m128i) -> __m128i {
    let mut k = prev;
    k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
    k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
    k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
    _mm_xor_si128(k, t)
}

/// The decryption schedule for `vaesdec` from the encryption schedule of `rounds + 1` keys.
#[target_feature(enable = "aes")]
fn invert(enc: &Schedule, dec: &mut Schedule, rounds: usize) {
    let (enc, _) = enc.as_chunks::<16>();
    let (dec, _) = dec.as_chunks_mut::<16>();
    for i in 0..=rounds {
        let k = load(&enc[rounds - i]);
        let k = if i == 0 || i == rounds {
            k
        } else {
            _mm_aesimc_si128(k)
        };
        store(k, &mut dec[i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_key(s: &Schedules, which: &Schedule, i: usize) -> String {
        assert!(i <= s.rounds());
        hex::encode(&which[16 * i..16 * (i + 1)])
    }

    /// FIPS-197 Appendix A.1 and A.3: the expansions of the standard's example keys.
    #[test]
    fn expansions_match_fips_197() {
        let Ok(cpu) = VaesCpu::detect() else {
            eprintln!("not a CPU for the vaes engine: nothing to test");
            return;
        };
        let k128 = hex::decode("2b7e151628aed2a6abf7158809cf4f3c").unwrap();
        let k256 = hex::decode("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
            .unwrap();
        let key: Vec<u8> = [k128.clone(), k128].concat();
        let s = Schedules::new(cpu, &key);
        assert_eq!(s.rounds(), 10);
        assert_eq!(
            round_key(&s, s.encrypt(), 1),
            "a0fafe1788542cb123a339392a6c7605"
        );
        assert_eq!(
            round_key(&s, s.encrypt(), 10),
            "d014f9a8c9ee2589e13f0cc8b6630ca6"
        );
        assert_eq!(round_key(&s, s.tweak(), 10), round_key(&s, s.encrypt(), 10));
        // The decryption schedule starts with the last encryption key and ends with the key.
        assert_eq!(
            round_key(&s, s.decrypt(), 0),
            "d014f9a8c9ee2589e13f0cc8b6630ca6"
        );
        assert_eq!(
            round_key(&s, s.decrypt(), 10),
            "2b7e151628aed2a6abf7158809cf4f3c"
        );

        let key: Vec<u8> = [k256.clone(), k256].concat();
        let s = Schedules::new(cpu, &key);
        assert_eq!(s.rounds(), 14);
        assert_eq!(
            round_key(&s, s.encrypt(), 2),
            "9ba354118e6925afa51a8b5f2067fcde"
        );
        assert_eq!(
            round_key(&s, s.encrypt(), 13),
            "cafaaae3e4d59b349adf6acebd10190d"
        );
        assert_eq!(
            round_key(&s, s.encrypt(), 14),
            "fe4890d1e6188d0b046df344706c631e"
        );
    }
}
