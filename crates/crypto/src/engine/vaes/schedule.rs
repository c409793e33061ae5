//! AES key schedules for the `vaes` engine, expanded with AES-NI straight into locked pages
//! (`LockedBytes`: never swapped, not in core dumps, wiped on drop).
//!
//! One page holds three schedules of `rounds + 1` round keys of 16 bytes each: encryption
//! with the data key, decryption with the data key (the "equivalent inverse cipher" that
//! `vaesdec` runs: the encryption keys in reverse order, the inner ones through
//! InvMixColumns), and encryption with the tweak key. The kernels broadcast each 16-byte key
//! to both halves of a YMM register as they load it.

use crate::locked::LockedBytes;
use std::arch::x86_64::{
    __m128i, _mm_aesimc_si128, _mm_aeskeygenassist_si128, _mm_loadu_si128, _mm_shuffle_epi32,
    _mm_slli_si128, _mm_storeu_si128, _mm_xor_si128,
};

/// Room for one schedule of the longest key (AES-256: 15 round keys).
const SLOT: usize = 15 * 16;

/// The three schedules of an XTS key.
pub(super) struct Schedules {
    pages: LockedBytes,
    rounds: usize,
}

impl Schedules {
    /// Expands an XTS key: the first half is the data key, the second the tweak key, each 16
    /// (AES-128) or 32 (AES-256) bytes.
    ///
    /// # Safety
    /// The CPU has AES-NI. `xts_key` is 32 or 64 bytes long.
    pub(super) unsafe fn new(xts_key: &[u8]) -> Schedules {
        let half = xts_key.len() / 2;
        let (data, tweak) = xts_key.split_at(half);
        let rounds = if half == 16 { 10 } else { 14 };
        let mut pages = LockedBytes::zeroed(3 * SLOT);
        let base = pages.as_mut_slice().as_mut_ptr();
        // SAFETY: each slot is SLOT bytes inside `pages`, which holds 3 * SLOT; expanding
        // writes `rounds + 1 <= 15` round keys of 16 bytes into a slot. The CPU has AES-NI.
        unsafe {
            let enc = base;
            let dec = base.add(SLOT);
            let twk = base.add(2 * SLOT);
            expand(data, enc);
            invert(enc, dec, rounds);
            expand(tweak, twk);
        }
        Schedules { pages, rounds }
    }

    pub(super) fn rounds(&self) -> usize {
        self.rounds
    }

    /// The data key's encryption schedule.
    pub(super) fn encrypt(&self) -> *const u8 {
        self.pages.as_slice().as_ptr()
    }

    /// The data key's decryption schedule (equivalent inverse cipher).
    pub(super) fn decrypt(&self) -> *const u8 {
        self.pages.as_slice()[SLOT..].as_ptr()
    }

    /// The tweak key's encryption schedule.
    pub(super) fn tweak(&self) -> *const u8 {
        self.pages.as_slice()[2 * SLOT..].as_ptr()
    }
}

/// Expands a 16- or 32-byte AES key into 11 or 15 round keys at `out`.
///
/// # Safety
/// `out` is writable for 176 (AES-128) or 240 (AES-256) bytes; the CPU has AES-NI.
#[target_feature(enable = "aes")]
unsafe fn expand(key: &[u8], out: *mut u8) {
    let put = |i: usize, k: __m128i| {
        // SAFETY: `i` is at most 14 and the caller made `out` writable for that many keys.
        unsafe { _mm_storeu_si128(out.add(16 * i).cast(), k) }
    };
    if key.len() == 16 {
        // SAFETY: `key` has 16 bytes.
        let mut k = unsafe { _mm_loadu_si128(key.as_ptr().cast()) };
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
        // SAFETY: `key` has 32 bytes.
        let (mut a, mut b) = unsafe {
            (
                _mm_loadu_si128(key.as_ptr().cast()),
                _mm_loadu_si128(key.as_ptr().add(16).cast()),
            )
        };
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

/// The decryption schedule for `vaesdec` from the encryption schedule at `enc`.
///
/// # Safety
/// `enc` readable and `dec` writable for `rounds + 1` round keys, not overlapping; AES-NI.
#[target_feature(enable = "aes")]
unsafe fn invert(enc: *const u8, dec: *mut u8, rounds: usize) {
    for i in 0..=rounds {
        // SAFETY: `i` and `rounds - i` index round keys inside both schedules.
        unsafe {
            let k = _mm_loadu_si128(enc.add(16 * (rounds - i)).cast());
            let k = if i == 0 || i == rounds {
                k
            } else {
                _mm_aesimc_si128(k)
            };
            _mm_storeu_si128(dec.add(16 * i).cast(), k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_key(s: &Schedules, which: *const u8, i: usize) -> String {
        assert!(i <= s.rounds());
        // SAFETY: `which` is one of `s`'s schedules, which hold `rounds + 1` keys.
        let bytes = unsafe { std::slice::from_raw_parts(which.add(16 * i), 16) };
        hex::encode(bytes)
    }

    /// FIPS-197 Appendix A.1 and A.3: the expansions of the standard's example keys.
    #[test]
    fn expansions_match_fips_197() {
        if !std::arch::is_x86_feature_detected!("aes") {
            eprintln!("no AES-NI on this CPU: nothing to test");
            return;
        }
        let k128 = hex::decode("2b7e151628aed2a6abf7158809cf4f3c").unwrap();
        let k256 = hex::decode("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
            .unwrap();
        let key: Vec<u8> = [k128.clone(), k128].concat();
        // SAFETY: AES-NI detected above; a 32-byte XTS key.
        let s = unsafe { Schedules::new(&key) };
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
        // SAFETY: as above, a 64-byte XTS key.
        let s = unsafe { Schedules::new(&key) };
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
