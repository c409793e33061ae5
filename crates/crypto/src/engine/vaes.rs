//! AES-XTS on 256-bit registers with VAES, for x86-64 CPUs that have VAES and VPCLMULQDQ but
//! where the libraries fall back to AES-NI's one block per instruction (no AVX-512: AMD Zen 3,
//! Intel client cores, cloud VMs that hide AVX-512). The loops are in `kernels.rs`, the key
//! schedules (locked pages) in `schedule.rs`.
//!
//! Per call, the IVs of up to 16 sectors are encrypted into their first tweaks in one pass
//! (16 blocks in flight, so a run of short sectors does not wait for the latency of each
//! sector's tweak encryption in turn), then each sector runs through the loop, 8 blocks per
//! iteration. Supports AES-128-XTS and AES-256-XTS (256- and 512-bit keys) with every IV
//! generator XTS allows (plain, plain64, plain64be), every sector size the trait allows
//! (powers of two from 512 to 4096 bytes: whole 128-byte iterations), and keys whose halves
//! are equal.
//!
//! Constant time by construction: AES rounds in hardware, tweak arithmetic without branches
//! or table lookups, no secret-dependent memory address.

mod kernels;
mod schedule;

use super::rustcrypto::check_key_len;
use super::{check_run, check_sector_size};
use crate::iv::IvGen;
use crate::{
    CipherSpec, CryptoError, Direction, Engine, Mode, RawSectors, SecretKey, SectorCipher,
};
use kernels::{Scratch, BATCH_SECTORS, ITERATION_BYTES};
use schedule::Schedules;
use std::sync::Arc;

pub(crate) const NAME: &str = "vaes";

/// The CPU features the kernels use, as `is_x86_feature_detected!` and /proc/cpuinfo name
/// them.
const NEEDED: [&str; 4] = ["aes", "avx2", "vaes", "vpclmulqdq"];

/// The features of `NEEDED` this CPU (and OS: YMM state must be enabled) lacks.
pub(crate) fn missing_cpu_features() -> Vec<&'static str> {
    let has = |f: &str| match f {
        "aes" => std::arch::is_x86_feature_detected!("aes"),
        "avx2" => std::arch::is_x86_feature_detected!("avx2"),
        "vaes" => std::arch::is_x86_feature_detected!("vaes"),
        "vpclmulqdq" => std::arch::is_x86_feature_detected!("vpclmulqdq"),
        _ => false,
    };
    NEEDED.into_iter().filter(|f| !has(f)).collect()
}

/// Proof that this CPU has the features of `NEEDED`: made only by `detect`, after checking
/// them, so code holding one may run the kernels and the AES-NI key expansion.
#[derive(Clone, Copy)]
struct VaesCpu {
    _detected: (),
}

impl VaesCpu {
    /// The proof, or the features this CPU lacks.
    fn detect() -> Result<VaesCpu, Vec<&'static str>> {
        let missing = missing_cpu_features();
        if missing.is_empty() {
            Ok(VaesCpu { _detected: () })
        } else {
            Err(missing)
        }
    }
}

pub(crate) struct VaesEngine;

fn spec_fits(spec: &CipherSpec) -> bool {
    spec.mode() == Mode::Xts
        && matches!(spec.key_bytes(), 32 | 64)
        && crate::iv::check_supported(spec).is_ok()
}

impl Engine for VaesEngine {
    fn name(&self) -> &'static str {
        NAME
    }

    fn supports(&self, spec: &CipherSpec) -> bool {
        spec_fits(spec) && missing_cpu_features().is_empty()
    }

    fn new_cipher(
        &self,
        spec: &CipherSpec,
        key: &SecretKey,
        sector_size: usize,
    ) -> Result<Arc<dyn SectorCipher>, CryptoError> {
        check_sector_size(sector_size)?;
        check_key_len(spec, key)?;
        if !spec_fits(spec) {
            return Err(CryptoError::Unsupported {
                what: "cipher for the vaes engine (it runs AES-128-XTS and AES-256-XTS)",
                name: format!("{spec}"),
            });
        }
        let cpu = VaesCpu::detect().map_err(|missing| CryptoError::Unsupported {
            what: "CPU for the vaes engine (it needs AES-NI, AVX2, VAES and VPCLMULQDQ; \
                   let cryptblk choose the engine, or force another); missing",
            name: missing.join(" "),
        })?;
        // Whole iterations per sector: sector sizes are powers of two from 512 bytes.
        debug_assert!(sector_size.is_multiple_of(ITERATION_BYTES));
        let iv = IvGen::new(spec, key, sector_size)?;
        // XTS keys here are 32 or 64 bytes (`spec_fits` and `check_key_len` above).
        let keys = Schedules::new(cpu, key.as_bytes());
        Ok(Arc::new(VaesCipher {
            cpu,
            keys,
            iv,
            sector_size,
        }))
    }
}

/// Only made by `VaesEngine::new_cipher`, with the proof that the CPU has the kernels'
/// features.
struct VaesCipher {
    cpu: VaesCpu,
    keys: Schedules,
    iv: IvGen,
    sector_size: usize,
}

impl VaesCipher {
    /// Transforms `len` bytes (whole sectors) from `src` to `dst`.
    ///
    /// # Safety
    /// `src`/`dst`/`len` as a live `RawSectors` holds them (its invariant), and `len` is a
    /// multiple of the sector size. The CPU has the features of `NEEDED` (`self.cpu`).
    #[target_feature(enable = "aes,avx2,vaes,vpclmulqdq")]
    unsafe fn run(&self, dir: Direction, first: u64, src: *const u8, dst: *mut u8, len: usize) {
        let ss = self.sector_size;
        let iters = ss / ITERATION_BYTES;
        let sectors = len / ss;
        let aes256 = self.keys.rounds() == 14;
        let keys = match dir {
            Direction::Encrypt => self.keys.encrypt(),
            Direction::Decrypt => self.keys.decrypt(),
        };
        let mut s = Scratch::new();
        let mut done = 0;
        while done < sectors {
            let batch = (sectors - done).min(BATCH_SECTORS);
            for (k, iv) in s.tweaks[..batch].iter_mut().enumerate() {
                *iv = self.iv.iv(first.wrapping_add((done + k) as u64));
            }
            if aes256 {
                kernels::encrypt_tweaks_256(self.keys.tweak(), &mut s)
            } else {
                kernels::encrypt_tweaks_128(self.keys.tweak(), &mut s)
            }
            for (k, t0) in s.tweaks[..batch].iter().enumerate() {
                let at = (done + k) * ss;
                // SAFETY: `at + ss <= len`, so the sector lies inside the ranges the caller
                // vouched for (same or disjoint); `iters >= 4` whole iterations make it up;
                // CPU features as this function's contract.
                unsafe {
                    let (from, to) = (src.add(at), dst.add(at));
                    match (aes256, dir) {
                        (true, Direction::Encrypt) => {
                            kernels::encrypt_256(keys, t0, from, to, iters)
                        }
                        (true, Direction::Decrypt) => {
                            kernels::decrypt_256(keys, t0, from, to, iters)
                        }
                        (false, Direction::Encrypt) => {
                            kernels::encrypt_128(keys, t0, from, to, iters)
                        }
                        (false, Direction::Decrypt) => {
                            kernels::decrypt_128(keys, t0, from, to, iters)
                        }
                    }
                }
            }
            done += batch;
        }
    }
}

impl SectorCipher for VaesCipher {
    fn sector_size(&self) -> usize {
        self.sector_size
    }

    fn engine_name(&self) -> &'static str {
        NAME
    }

    fn crypt(&self, dir: Direction, first_sector: u64, data: &mut [u8]) -> Result<(), CryptoError> {
        crate::crypt_via_raw(self, dir, first_sector, data)
    }

    fn crypt_into(
        &self,
        dir: Direction,
        first_sector: u64,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<(), CryptoError> {
        crate::crypt_into_via_raw(self, dir, first_sector, src, dst)
    }

    fn crypt_raw(
        &self,
        dir: Direction,
        first_sector: u64,
        bytes: RawSectors<'_>,
    ) -> Result<(), CryptoError> {
        check_run(self.sector_size, bytes.len())?;
        let _ = self.cpu;
        // SAFETY: whole sectors (checked); the ranges are valid while `bytes` lives, to the
        // end of this call (`RawSectors`' invariant); `self.cpu` proves the CPU has the
        // features `run` needs.
        unsafe { self.run(dir, first_sector, bytes.src(), bytes.dst(), bytes.len()) };
        Ok(())
    }
}
