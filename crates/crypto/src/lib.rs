//! Sector crypto for cryptblk: cipher specs as LUKS names them, engines that encrypt runs of
//! sectors in place, and the worker pool that spreads one caller's runs over every core.
//!
//! CONTRACT (other crates build on exactly these names; keep them stable):
//! - `CipherSpec::parse(cipher_name, cipher_mode, key_bytes)` e.g. ("aes", "xts-plain64", 64)
//!   and `CipherSpec::parse_luks2("aes-xts-plain64", key_bytes)`; `spec.to_luks2_string()`,
//!   `spec.cipher_name()`, `spec.cipher_mode()`, `spec.key_bytes()`.
//! - `SecretKey`: zeroized key bytes.
//! - `trait Engine` / `trait SectorCipher` / `Direction`.
//! - `engines()`, `default_engine_for(&spec)` (measured choice, cached), `portable_engine()`,
//!   `force_engine(Some(name))` (what `CRYPTBLK_ENGINE` does, from a program).
//! - `CryptoPool::new(threads)`, `CryptoPool::with_default_threads()`,
//!   `pool.crypt(&cipher, dir, first_sector, &mut data)`, out of place
//!   `pool.crypt_into(&cipher, dir, first_sector, &src, &mut dst)`, for memory that must not
//!   become a Rust reference (guest RAM) `pool.crypt_raw(&cipher, dir, first, bytes)` (and
//!   `SectorCipher::crypt_raw`), where `bytes: RawSectors` is built by whoever can vouch for
//!   the memory (`unsafe RawSectors::new(src_ptr, dst_ptr, len)`, or a safe constructor).
//! - `bench::run_bench(&BenchOptions) -> BenchReport` for `cryptblk bench`.
//!
//! Engines: `vaes` (ours: AES-128/256-XTS on 256-bit VAES registers, x86-64 CPUs with VAES
//! and VPCLMULQDQ), `openssl` (vendored OpenSSL 3, AVX-512 VAES or AES-NI; AES-128/256-XTS and
//! AES-CBC) and `rustcrypto` (portable; everything incl. AES-192-XTS). `default_engine_for`
//! measures them once per spec shape; `CRYPTBLK_ENGINE=vaes|openssl|rustcrypto` overrides.
//! See ENGINES.md.

use std::sync::Arc;

pub mod bench;
mod engine;
mod error;
mod iv;
mod key;
pub mod locked;
mod raw;
mod select;
mod spec;

pub use error::CryptoError;
pub use key::SecretKey;
pub use raw::RawSectors;
pub use select::{
    default_engine_for, engines, force_engine, portable_engine, ENGINE_ENV, ENGINE_NAMES,
};
pub use spec::{CipherSpec, IvMode, Mode};

/// Which way a run of sectors is transformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Encrypt,
    Decrypt,
}

/// A keyed sector cipher. Implementations keep keyed cipher contexts internally so that
/// `crypt` only re-initialises the IV per sector (never a key schedule per call), and may be
/// called from many threads at once.
pub trait SectorCipher: Send + Sync {
    /// Encryption sector size in bytes (512..=4096, power of two).
    fn sector_size(&self) -> usize;
    /// Name of the engine that made this cipher, e.g. "openssl" or "rustcrypto".
    fn engine_name(&self) -> &'static str;
    /// Transform `data` in place. `data.len()` must be a multiple of `sector_size()`;
    /// `first_sector` numbers `data[0..sector_size]` in units of `sector_size`. The IV itself
    /// counts 512-byte units, as dm-crypt does for LUKS: sector N of a 4096-byte-sector
    /// cipher is encrypted with IV N * 8.
    fn crypt(&self, dir: Direction, first_sector: u64, data: &mut [u8]) -> Result<(), CryptoError>;

    /// Transform `src` into `dst` (the same length), leaving `src` untouched: one pass over
    /// the data where a copy followed by `crypt` would make two. The default does exactly that
    /// copy; engines that read and write separate buffers natively override it.
    fn crypt_into(
        &self,
        dir: Direction,
        first_sector: u64,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_same_len(src, dst)?;
        dst.copy_from_slice(src);
        self.crypt(dir, first_sector, dst)
    }

    /// Transform the bytes of `bytes` (read at its source, written at its destination: in
    /// place when the two are the same) through raw pointers: for memory that must never
    /// become a Rust reference because another party may write it at any moment, such as a
    /// guest's RAM under a virtio request. `bytes.len()` must be a multiple of
    /// `sector_size()`. The engine treats the input as untrusted bytes, reads each of them
    /// once per sector it produces and never reads back what it wrote, so a concurrent writer
    /// can only change which bytes come out: it corrupts its own data, nothing of this
    /// process. Whoever built `bytes` vouched for the memory ([`RawSectors`]' invariant).
    ///
    /// The default copies each sector into a scratch buffer on the stack, transforms it there
    /// with `crypt` and copies it out; engines that can read and write the memory natively
    /// override it.
    fn crypt_raw(
        &self,
        dir: Direction,
        first_sector: u64,
        mut bytes: RawSectors<'_>,
    ) -> Result<(), CryptoError> {
        let ss = self.sector_size();
        let len = bytes.len();
        if ss == 0 || ss > MAX_SECTOR_SIZE || !len.is_multiple_of(ss) {
            return Err(CryptoError::InvalidLength(format!(
                "{len} bytes is not a whole number of {ss}-byte sectors"
            )));
        }
        let mut scratch = [0u8; MAX_SECTOR_SIZE];
        for (i, at) in (0..len).step_by(ss).enumerate() {
            bytes.read_into(at, &mut scratch[..ss]);
            self.crypt(dir, first_sector.wrapping_add(i as u64), &mut scratch[..ss])?;
            bytes.write_from(at, &scratch[..ss]);
        }
        Ok(())
    }
}

/// Largest encryption sector LUKS allows.
pub const MAX_SECTOR_SIZE: usize = 4096;

/// `crypt_into` needs a destination exactly as long as its source.
pub(crate) fn check_same_len(src: &[u8], dst: &[u8]) -> Result<(), CryptoError> {
    if src.len() == dst.len() {
        Ok(())
    } else {
        Err(CryptoError::InvalidLength(format!(
            "source of {} bytes but destination of {} bytes",
            src.len(),
            dst.len()
        )))
    }
}

/// `SectorCipher::crypt` for a cipher whose `crypt_raw` reads and writes memory natively (an
/// engine, or a wrapper that overrides `crypt_raw`): the slice goes in as one run, in place.
pub fn crypt_via_raw(
    cipher: &(impl SectorCipher + ?Sized),
    dir: Direction,
    first_sector: u64,
    data: &mut [u8],
) -> Result<(), CryptoError> {
    cipher.crypt_raw(dir, first_sector, RawSectors::from_mut(data))
}

/// `SectorCipher::crypt_into` for a cipher whose `crypt_raw` reads and writes memory
/// natively: one pass from `src` to `dst`.
pub fn crypt_into_via_raw(
    cipher: &(impl SectorCipher + ?Sized),
    dir: Direction,
    first_sector: u64,
    src: &[u8],
    dst: &mut [u8],
) -> Result<(), CryptoError> {
    cipher.crypt_raw(dir, first_sector, RawSectors::between(src, dst)?)
}

/// A provider of sector ciphers.
pub trait Engine: Send + Sync {
    fn name(&self) -> &'static str;
    fn supports(&self, spec: &CipherSpec) -> bool;
    fn new_cipher(
        &self,
        spec: &CipherSpec,
        key: &SecretKey,
        sector_size: usize,
    ) -> Result<Arc<dyn SectorCipher>, CryptoError>;
}

mod pool;
pub use pool::{CryptoPool, DEFAULT_INLINE_THRESHOLD};
