//! Fast engine on OpenSSL 3 (vendored), which uses VAES/AVX-512 or AES-NI when the CPU has them.
//!
//! Cost model (measured, see ENGINES.md): keying an `EVP_CIPHER_CTX` costs several times more
//! than encrypting a 4 KiB sector, so a cipher keeps keyed contexts and only resets the IV per
//! sector. `crypt(&self)` runs on many threads at once, so the contexts live in a small array
//! of slots owned by the cipher: a caller takes the first free slot with `try_lock`, starting
//! from a per-thread position so that steady-state threads each keep "their" slot and never
//! contend. We chose slots over a `thread_local!` cache because the key schedules then die with
//! the cipher (OpenSSL cleanses them when a context is freed) instead of lingering in caches
//! of threads that outlive it, and nothing grows when many ciphers are created and dropped
//! (one per keyslot unlock attempt). If every slot is busy the call keys a temporary context.

use super::rustcrypto::check_key_len;
use super::{check_run, check_sector_size};
use crate::iv::IvGen;
use crate::{
    CipherSpec, CryptoError, Direction, Engine, Mode, RawSectors, SecretKey, SectorCipher,
};
use foreign_types::ForeignTypeRef;
use openssl::cipher::{Cipher, CipherRef};
use openssl::cipher_ctx::CipherCtx;
use openssl::error::ErrorStack;
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, TryLockError};

pub(crate) const NAME: &str = "openssl";

/// Largest supported sector size; the CBC tail path needs scratch room for one sector.
const MAX_SECTOR: usize = 4096;
const BLOCK: usize = 16;

pub(crate) struct OpensslEngine;

fn evp_cipher(spec: &CipherSpec) -> Option<&'static CipherRef> {
    match (spec.mode(), spec.key_bytes()) {
        (Mode::Xts, 32) => Some(Cipher::aes_128_xts()),
        (Mode::Xts, 64) => Some(Cipher::aes_256_xts()),
        (Mode::Cbc, 16) => Some(Cipher::aes_128_cbc()),
        (Mode::Cbc, 24) => Some(Cipher::aes_192_cbc()),
        (Mode::Cbc, 32) => Some(Cipher::aes_256_cbc()),
        // OpenSSL has no AES-192-XTS (384-bit XTS keys); the portable engine covers it.
        _ => None,
    }
}

impl Engine for OpensslEngine {
    fn name(&self) -> &'static str {
        NAME
    }

    fn supports(&self, spec: &CipherSpec) -> bool {
        evp_cipher(spec).is_some() && crate::iv::check_supported(spec).is_ok()
    }

    fn new_cipher(
        &self,
        spec: &CipherSpec,
        key: &SecretKey,
        sector_size: usize,
    ) -> Result<Arc<dyn SectorCipher>, CryptoError> {
        check_sector_size(sector_size)?;
        check_key_len(spec, key)?;
        let cipher = evp_cipher(spec).ok_or_else(|| CryptoError::Unsupported {
            what: "cipher for the openssl engine",
            name: format!("{spec}"),
        })?;
        if spec.mode() == Mode::Xts && halves_equal(key.as_bytes()) {
            // OpenSSL 3 refuses XTS keys with equal halves; dm-crypt and cryptsetup accept them
            // outside FIPS mode, so such volumes are served by the portable engine instead.
            return super::rustcrypto::RustCryptoEngine.new_cipher(spec, key, sector_size);
        }
        let iv = IvGen::new(spec, key, sector_size)?;
        let slots = (0..slot_count())
            .map(|_| Mutex::new(Contexts::default()))
            .collect();
        let c = OpensslCipher {
            cipher,
            cbc: spec.mode() == Mode::Cbc,
            key: key.clone(),
            iv,
            sector_size,
            slots,
        };
        // Key one context now so that a key OpenSSL refuses fails here, not on first I/O.
        c.with_contexts(|ctxs| ctxs.get(&c, Direction::Encrypt).map(|_| ()))?;
        Ok(Arc::new(c))
    }
}

/// Constant-time, because the halves are key material.
fn halves_equal(key: &[u8]) -> bool {
    let (a, b) = key.split_at(key.len() / 2);
    openssl::memcmp::eq(a, b)
}

/// Enough slots for every pool worker plus callers doing work inline.
fn slot_count() -> usize {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    (cores * 2 + 2).min(64)
}

/// Per-thread starting slot, so threads spread over the slots instead of all racing for slot 0.
fn thread_hint() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static HINT: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    HINT.with(|h| {
        if h.get() == usize::MAX {
            h.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        h.get()
    })
}

#[derive(Default)]
struct Contexts {
    enc: Option<CipherCtx>,
    dec: Option<CipherCtx>,
}

impl Contexts {
    /// The keyed context for `dir`, keying it on first use. Encryption and decryption need
    /// separate contexts because the AES key schedule differs per direction.
    fn get(&mut self, c: &OpensslCipher, dir: Direction) -> Result<&mut CipherCtx, CryptoError> {
        let slot = match dir {
            Direction::Encrypt => &mut self.enc,
            Direction::Decrypt => &mut self.dec,
        };
        if slot.is_none() {
            *slot = Some(c.keyed_ctx(dir).map_err(engine_err)?);
        }
        slot.as_mut()
            .ok_or_else(|| engine_err_msg("context missing after keying"))
    }
}

struct OpensslCipher {
    cipher: &'static CipherRef,
    cbc: bool,
    key: SecretKey,
    iv: IvGen,
    sector_size: usize,
    slots: Box<[Mutex<Contexts>]>,
}

fn engine_err(e: ErrorStack) -> CryptoError {
    CryptoError::Engine {
        engine: NAME,
        message: e.to_string(),
    }
}

fn engine_err_msg(m: &str) -> CryptoError {
    CryptoError::Engine {
        engine: NAME,
        message: m.to_string(),
    }
}

impl OpensslCipher {
    fn keyed_ctx(&self, dir: Direction) -> Result<CipherCtx, ErrorStack> {
        let mut ctx = CipherCtx::new()?;
        match dir {
            Direction::Encrypt => {
                ctx.encrypt_init(Some(self.cipher), Some(self.key.as_bytes()), None)?
            }
            Direction::Decrypt => {
                ctx.decrypt_init(Some(self.cipher), Some(self.key.as_bytes()), None)?
            }
        }
        // Sectors are whole blocks; padding would add or hold back a block.
        ctx.set_padding(false);
        Ok(ctx)
    }

    fn with_contexts<R>(
        &self,
        f: impl FnOnce(&mut Contexts) -> Result<R, CryptoError>,
    ) -> Result<R, CryptoError> {
        let n = self.slots.len();
        let start = thread_hint() % n;
        for i in 0..n {
            let slot = &self.slots[(start + i) % n];
            match slot.try_lock() {
                Ok(mut guard) => return f(&mut guard),
                Err(TryLockError::Poisoned(p)) => {
                    // A panic mid-update may have left a context half-way through a sector;
                    // drop both and re-key rather than trust them.
                    let mut guard = p.into_inner();
                    *guard = Contexts::default();
                    slot.clear_poison();
                    return f(&mut guard);
                }
                Err(TryLockError::WouldBlock) => continue,
            }
        }
        f(&mut Contexts::default())
    }

    /// Transforms the sectors of `bytes` (whole sectors) with `ctx` keyed for `dir`.
    fn crypt_sectors_raw(
        &self,
        ctx: &mut CipherCtx,
        dir: Direction,
        first: u64,
        bytes: RawSectors<'_>,
    ) -> Result<(), CryptoError> {
        let ss = self.sector_size;
        // CBC only: OpenSSL is told the output may be one block longer than the input (it
        // writes exactly the input length with padding off), so CBC output goes through a
        // buffer with that slack. XTS needs none: clearing (and zeroizing) 4 KiB per call
        // would cost more than decrypting a 4 KiB request.
        let mut scratch = self
            .cbc
            .then(|| zeroize::Zeroizing::new([0u8; MAX_SECTOR + BLOCK]));
        let mut rest = bytes;
        for i in 0..rest.len() / ss {
            let (mut sector, tail) = rest.split_at(ss);
            rest = tail;
            let iv = self.iv.iv(first.wrapping_add(i as u64));
            match dir {
                Direction::Encrypt => ctx.encrypt_init(None, None, Some(&iv)),
                Direction::Decrypt => ctx.decrypt_init(None, None, Some(&iv)),
            }
            .map_err(engine_err)?;
            let out = if let Some(scratch) = scratch.as_mut() {
                // SAFETY: the sector's source is readable for `ss` bytes (`RawSectors`'
                // invariant); the scratch buffer is ours and has `ss + BLOCK` bytes of room.
                let n = unsafe { cipher_update_raw(ctx, sector.src(), scratch.as_mut_ptr(), ss)? };
                if n == ss {
                    sector.write_from(0, &scratch[..ss]);
                }
                n
            } else {
                // SAFETY: XTS reports a block size of 1, so OpenSSL is told (and writes) at
                // most `ss` bytes at the sector's destination, valid for writes of `ss` bytes
                // as its source for reads (`RawSectors`' invariant), the same or disjoint.
                unsafe { cipher_update_raw(ctx, sector.src(), sector.dst(), ss)? }
            };
            if out != ss {
                return Err(engine_err_msg(&format!(
                    "update produced {out} bytes for a {ss}-byte sector"
                )));
            }
        }
        Ok(())
    }
}

/// `EVP_CipherUpdate` on raw pointers; returns the number of bytes written.
///
/// # Safety
/// `src` readable for `len` bytes; `dst` writable for as many bytes as OpenSSL may write for
/// this cipher (`len` for XTS, `len + 16` for CBC); the ranges are the same or disjoint.
unsafe fn cipher_update_raw(
    ctx: &mut CipherCtx,
    src: *const u8,
    dst: *mut u8,
    len: usize,
) -> Result<usize, CryptoError> {
    let inl = std::ffi::c_int::try_from(len)
        .map_err(|_| engine_err_msg("sector run too long for OpenSSL"))?;
    let mut outl: std::ffi::c_int = 0;
    // SAFETY: `ctx` is a live, keyed context borrowed mutably for the call; the buffers are
    // valid as the caller promised; `outl` is a valid place for the output length.
    let rc = unsafe { openssl_sys::EVP_CipherUpdate(ctx.as_ptr(), dst, &mut outl, src, inl) };
    if rc != 1 {
        return Err(engine_err(ErrorStack::get()));
    }
    usize::try_from(outl).map_err(|_| engine_err_msg("negative output length from OpenSSL"))
}

impl SectorCipher for OpensslCipher {
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
        let len = bytes.len();
        check_run(self.sector_size, len)?;
        if len == 0 {
            return Ok(());
        }
        self.with_contexts(|ctxs| {
            let ctx = ctxs.get(self, dir)?;
            self.crypt_sectors_raw(ctx, dir, first_sector, bytes)
        })
    }
}
