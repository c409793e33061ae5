//! The hand-scheduled AES-XTS loops on 256-bit registers (VAES + VPCLMULQDQ + AVX2).
//!
//! Why assembly: with intrinsics the compiler hoists the round keys out of the loop, runs
//! out of the 16 YMM registers and spills them to the stack: slower (about 20 % in the issue's
//! prototype), and it copies key material into memory that is neither locked nor wiped. Here
//! the round keys are read from their locked pages, one broadcast load per round, and the only
//! memory written besides the output is the caller's `Scratch` (the encrypted IVs), wiped when
//! it is dropped.
//!
//! One iteration transforms 8 blocks (128 bytes): four data registers of two blocks each go
//! through the rounds side by side. Successive iterations are independent except for the
//! tweaks, so the CPU overlaps the next iteration's loads and first rounds with this one's
//! last rounds; measured on Zen 4 (AMD EPYC, no AVX-512), this runs as fast as eight data
//! registers per iteration with the tweaks kept in memory (same-run A/B, within noise), and
//! keeps every tweak in a register.
//!
//! Tweaks: register pair (2v, 2v+1) of an iteration holds the tweaks of its blocks 2v and
//! 2v+1. The next iteration's tweaks are these times x^8 in GF(2^128) (XTS order: little
//! endian, bit 0 of byte 0 is the constant term), which is a shift left by one whole byte
//! whose top byte comes back multiplied by 0x87 (x^7 + x^2 + x + 1, the polynomial's part
//! below x^128) with one carry-less multiply: no branch, no table, no secret-dependent
//! address. The shifts and multiplies are spread between the AES rounds.
//!
//! Registers in the loops: ymm0..3 data; ymm4 the round key of the current round; ymm5
//! last-round key ^ tweak; ymm6..9 the tweaks; ymm10..13 the next tweaks' reductions; ymm14
//! the constant 0x87 in every 64-bit lane; ymm15 the first round key.

use super::schedule::Schedule;
use std::arch::asm;

/// Sectors whose tweaks are encrypted together: 16 blocks, eight registers, one pass.
pub(super) const BATCH_SECTORS: usize = 16;
/// Bytes of data one loop iteration transforms.
pub(super) const ITERATION_BYTES: usize = 128;

/// The per-call state that derives from the key: each sector's first tweak (its encrypted
/// IV). 32-byte aligned for the aligned YMM loads and stores; wiped on drop.
#[repr(C, align(32))]
pub(super) struct Scratch {
    /// The IVs of up to `BATCH_SECTORS` sectors, encrypted in place into their first tweaks
    /// by `encrypt_tweaks_*`.
    pub(super) tweaks: [[u8; 16]; BATCH_SECTORS],
}

impl Scratch {
    /// A zeroed scratch. Dropping it runs the AVX wipe, so it is made only where AVX is
    /// enabled: this function can be called without `unsafe` only from code compiled for AVX.
    #[target_feature(enable = "avx")]
    pub(super) fn new() -> Scratch {
        Scratch {
            tweaks: [[0; 16]; BATCH_SECTORS],
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: the CPU has AVX: a `Scratch` is made only by `Scratch::new`, which enables
        // it. `self` is a whole, aligned `Scratch` that we own exclusively.
        unsafe { wipe(self) }
    }
}

/// Round keys a `Schedule` holds: the most any variant here reads (AES-256: 0..=14).
const SCHEDULE_KEYS: usize = 15;
const _: () = assert!(std::mem::size_of::<Schedule>() >= 16 * SCHEDULE_KEYS);

const SCRATCH_CHUNKS: usize = std::mem::size_of::<Scratch>() / 32;
const _: () = assert!(std::mem::size_of::<Scratch>().is_multiple_of(32));

/// Zeroes the scratch with stores the compiler cannot remove, and clears every YMM register
/// (they held key-derived tweaks, round keys and plaintext).
#[target_feature(enable = "avx")]
unsafe fn wipe(s: &mut Scratch) {
    // SAFETY: writes exactly `size_of::<Scratch>()` bytes at `s`, a 32-byte aligned struct of
    // whole 32-byte chunks that the exclusive borrow gives us. `vzeroall` changes ymm0..15,
    // all declared clobbered.
    unsafe {
        asm!(
            "vpxor xmm0, xmm0, xmm0",
            "2:",
            "vmovdqa ymmword ptr [{p}], ymm0",
            "add {p}, 32",
            "dec {n}",
            "jnz 2b",
            "vzeroall",
            p = inout(reg) std::ptr::from_mut(s) => _,
            n = inout(reg) SCRATCH_CHUNKS => _,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nostack),
        );
    }
}

/// One AES round (`$op`: vaesenc, vaesenclast, vaesdec, vaesdeclast) over `ymm0..$n-1`
/// with the round key in `$key`.
macro_rules! round {
    (8, $op:literal, $key:literal) => {
        concat!(
            round!(4, $op, $key),
            $op,
            " ymm4, ymm4, ",
            $key,
            "\n",
            $op,
            " ymm5, ymm5, ",
            $key,
            "\n",
            $op,
            " ymm6, ymm6, ",
            $key,
            "\n",
            $op,
            " ymm7, ymm7, ",
            $key,
            "\n",
        )
    };
    (4, $op:literal, $key:literal) => {
        concat!(
            $op,
            " ymm0, ymm0, ",
            $key,
            "\n",
            $op,
            " ymm1, ymm1, ",
            $key,
            "\n",
            $op,
            " ymm2, ymm2, ",
            $key,
            "\n",
            $op,
            " ymm3, ymm3, ",
            $key,
            "\n",
        )
    };
}

/// Encrypts the 16 blocks of `s.tweaks` in place with the tweak key's schedule: the first
/// tweak of each of up to 16 sectors, all in flight at once.
macro_rules! encrypt_tweaks {
    ($name:ident, $nr:literal, [$($r:literal),*]) => {
        /// `keys` is the tweak key's encryption schedule; a schedule of the other round count
        /// gives wrong tweaks, never a read outside it.
        #[target_feature(enable = "avx2,vaes")]
        pub(super) fn $name(keys: &Schedule, s: &mut Scratch) {
            // SAFETY: reads round keys 0..=$nr, inside `keys` (`SCHEDULE_KEYS`); reads and
            // writes the 256 bytes of `s.tweaks`, 32-byte aligned (the struct's alignment; it
            // is the only field). Every register changed is declared.
            unsafe {
                asm!(
                    "vbroadcasti128 ymm8, xmmword ptr [{rk}]",
                    "vpxor ymm0, ymm8, ymmword ptr [{t} + 32*0]",
                    "vpxor ymm1, ymm8, ymmword ptr [{t} + 32*1]",
                    "vpxor ymm2, ymm8, ymmword ptr [{t} + 32*2]",
                    "vpxor ymm3, ymm8, ymmword ptr [{t} + 32*3]",
                    "vpxor ymm4, ymm8, ymmword ptr [{t} + 32*4]",
                    "vpxor ymm5, ymm8, ymmword ptr [{t} + 32*5]",
                    "vpxor ymm6, ymm8, ymmword ptr [{t} + 32*6]",
                    "vpxor ymm7, ymm8, ymmword ptr [{t} + 32*7]",
                    $(
                        concat!("vbroadcasti128 ymm8, xmmword ptr [{rk} + 16*", $r, "]"),
                        round!(8, "vaesenc", "ymm8"),
                    )*
                    concat!("vbroadcasti128 ymm8, xmmword ptr [{rk} + 16*", $nr, "]"),
                    round!(8, "vaesenclast", "ymm8"),
                    "vmovdqa ymmword ptr [{t} + 32*0], ymm0",
                    "vmovdqa ymmword ptr [{t} + 32*1], ymm1",
                    "vmovdqa ymmword ptr [{t} + 32*2], ymm2",
                    "vmovdqa ymmword ptr [{t} + 32*3], ymm3",
                    "vmovdqa ymmword ptr [{t} + 32*4], ymm4",
                    "vmovdqa ymmword ptr [{t} + 32*5], ymm5",
                    "vmovdqa ymmword ptr [{t} + 32*6], ymm6",
                    "vmovdqa ymmword ptr [{t} + 32*7], ymm7",
                    rk = in(reg) keys.as_ptr(),
                    t = in(reg) s.tweaks.as_mut_ptr(),
                    out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                    out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                    out("ymm8") _,
                    options(nostack, preserves_flags),
                );
            }
        }
    };
}

/// `$dst = ymm6 * x^$k` in each 128-bit lane for 0 < k < 64: the bits shifted out of the
/// low qword move into the high one; those shifted out of the high one are multiplied by
/// 0x87 and XORed into the low one. Clobbers ymm10 and ymm11.
macro_rules! mul_xk {
    ($dst:literal, $k:literal, $back:literal) => {
        concat!(
            "vpsrlq ymm10, ymm6, ",
            $back,
            "\n",
            "vpclmulqdq ymm11, ymm10, ymm14, 0x01\n",
            "vpslldq ymm10, ymm10, 8\n",
            "vpsllq ",
            $dst,
            ", ymm6, ",
            $k,
            "\n",
            "vpxor ",
            $dst,
            ", ",
            $dst,
            ", ymm10\n",
            "vpxor ",
            $dst,
            ", ",
            $dst,
            ", ymm11\n",
        )
    };
}

/// The part of the next tweaks' computation placed after the round key load of round `r`:
/// each tweak register's top byte (rounds 1-4), multiplied by 0x87 (rounds 5-8). The
/// shift and the XOR that complete it follow the stores.
macro_rules! tweak_step {
    ("1") => {
        "vpsrldq ymm10, ymm6, 15"
    };
    ("2") => {
        "vpsrldq ymm11, ymm7, 15"
    };
    ("3") => {
        "vpsrldq ymm12, ymm8, 15"
    };
    ("4") => {
        "vpsrldq ymm13, ymm9, 15"
    };
    ("5") => {
        "vpclmulqdq ymm10, ymm10, ymm14, 0x00"
    };
    ("6") => {
        "vpclmulqdq ymm11, ymm11, ymm14, 0x00"
    };
    ("7") => {
        "vpclmulqdq ymm12, ymm12, ymm14, 0x00"
    };
    ("8") => {
        "vpclmulqdq ymm13, ymm13, ymm14, 0x00"
    };
    ($later:tt) => {
        ""
    };
}

/// Transforms one sector of `iters` iterations given its first tweak.
macro_rules! xts_sector {
    ($name:ident, $op:literal, $last:literal, $nr:literal, [$($r:tt),*]) => {
        /// `keys` is this direction's schedule (one of the other round count gives wrong
        /// output, never a read outside it); `t0` the sector's first tweak.
        ///
        /// # Safety
        /// `src` is readable and `dst` writable for `iters * ITERATION_BYTES` bytes, the same
        /// or disjoint ranges; `iters >= 1`; the CPU has AVX2, VAES and VPCLMULQDQ.
        #[target_feature(enable = "avx2,vaes,vpclmulqdq")]
        pub(super) unsafe fn $name(
            keys: &Schedule,
            t0: &[u8; 16],
            src: *const u8,
            dst: *mut u8,
            iters: usize,
        ) {
            debug_assert!(iters >= 1);
            // SAFETY: reads round keys 0..=$nr inside `keys` (`SCHEDULE_KEYS`), the 16 bytes
            // of `t0`, each of the `iters * 128` bytes at `src` once, and writes as many at
            // `dst` without reading them back, as the caller vouched for. Every register
            // changed is declared.
            unsafe {
                asm!(
                    "mov {tmp:e}, 0x87",
                    "vmovd xmm14, {tmp:e}",
                    "vpbroadcastq ymm14, xmm14",
                    "vbroadcasti128 ymm15, xmmword ptr [{rk}]",
                    // ymm6 = [T, T*x], then ymm7..9 = ymm6 * x^2, x^4, x^6.
                    "vbroadcasti128 ymm6, xmmword ptr [{t0}]",
                    mul_xk!("ymm13", "1", "63"),
                    "vpblendd ymm6, ymm6, ymm13, 0xf0",
                    mul_xk!("ymm7", "2", "62"),
                    mul_xk!("ymm8", "4", "60"),
                    mul_xk!("ymm9", "6", "58"),
                    "2:",
                    "vpxor ymm0, ymm15, ymmword ptr [{src}]",
                    "vpxor ymm1, ymm15, ymmword ptr [{src} + 32]",
                    "vpxor ymm2, ymm15, ymmword ptr [{src} + 64]",
                    "vpxor ymm3, ymm15, ymmword ptr [{src} + 96]",
                    "vpxor ymm0, ymm0, ymm6",
                    "vpxor ymm1, ymm1, ymm7",
                    "vpxor ymm2, ymm2, ymm8",
                    "vpxor ymm3, ymm3, ymm9",
                    $(
                        concat!("vbroadcasti128 ymm4, xmmword ptr [{rk} + 16*", $r, "]"),
                        tweak_step!($r),
                        round!(4, $op, "ymm4"),
                    )*
                    // The last round's key operand is XORed into its result: key ^ tweak
                    // applies the output tweak in the same instruction.
                    concat!("vbroadcasti128 ymm4, xmmword ptr [{rk} + 16*", $nr, "]"),
                    "vpxor ymm5, ymm6, ymm4",
                    concat!($last, " ymm0, ymm0, ymm5"),
                    "vpxor ymm5, ymm7, ymm4",
                    concat!($last, " ymm1, ymm1, ymm5"),
                    "vpxor ymm5, ymm8, ymm4",
                    "vpxor ymm4, ymm9, ymm4",
                    concat!($last, " ymm2, ymm2, ymm5"),
                    concat!($last, " ymm3, ymm3, ymm4"),
                    "vmovdqu ymmword ptr [{dst}], ymm0",
                    "vmovdqu ymmword ptr [{dst} + 32], ymm1",
                    "vmovdqu ymmword ptr [{dst} + 64], ymm2",
                    "vmovdqu ymmword ptr [{dst} + 96], ymm3",
                    "vpslldq ymm6, ymm6, 1",
                    "vpslldq ymm7, ymm7, 1",
                    "vpslldq ymm8, ymm8, 1",
                    "vpslldq ymm9, ymm9, 1",
                    "vpxor ymm6, ymm6, ymm10",
                    "vpxor ymm7, ymm7, ymm11",
                    "vpxor ymm8, ymm8, ymm12",
                    "vpxor ymm9, ymm9, ymm13",
                    "add {src}, 128",
                    "add {dst}, 128",
                    "dec {n}",
                    "jnz 2b",
                    rk = in(reg) keys.as_ptr(),
                    t0 = in(reg) t0.as_ptr(),
                    src = inout(reg) src => _,
                    dst = inout(reg) dst => _,
                    n = inout(reg) iters => _,
                    tmp = out(reg) _,
                    out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                    out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                    out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                    out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                    options(nostack),
                );
            }
        }
    };
}

encrypt_tweaks!(
    encrypt_tweaks_128,
    "10",
    ["1", "2", "3", "4", "5", "6", "7", "8", "9"]
);
encrypt_tweaks!(
    encrypt_tweaks_256,
    "14",
    ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13"]
);
xts_sector!(
    encrypt_128,
    "vaesenc",
    "vaesenclast",
    "10",
    ["1", "2", "3", "4", "5", "6", "7", "8", "9"]
);
xts_sector!(
    decrypt_128,
    "vaesdec",
    "vaesdeclast",
    "10",
    ["1", "2", "3", "4", "5", "6", "7", "8", "9"]
);
xts_sector!(
    encrypt_256,
    "vaesenc",
    "vaesenclast",
    "14",
    ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13"]
);
xts_sector!(
    decrypt_256,
    "vaesdec",
    "vaesdeclast",
    "14",
    ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13"]
);
