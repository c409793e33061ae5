//! The encrypted volume: a payload region of a backend device, transformed sector by sector
//! with a `SectorCipher` on the crypto worker pool.
//!
//! Aligned I/O is the fast path: reads decrypt in place in the caller's buffer, writes encrypt
//! from the caller's buffer into a reused bounce buffer in one pass (the caller's data is never
//! modified). I/O that is not aligned to the encryption sector is served by read-modify-write
//! of the edge sectors; that is correct but slow, and concurrent RMW of one sector is
//! serialised by a striped lock so that two unaligned writes to different bytes of the same
//! sector cannot lose either update.

use crate::bounce::BouncePool;
use crate::device::check_range;
use crate::{BlockDevice, BlockError, BlockErrorKind, Extent, ExtentKind};
use cryptblk_crypto::{CryptoError, CryptoPool, Direction, SectorCipher};
use std::sync::{Arc, Mutex, MutexGuard};

/// Largest encryption sector (LUKS2 allows 512..=4096); edge sectors live on the stack.
const MAX_SECTOR: usize = 4096;
/// Writes are encrypted and written in pieces of at most this size, bounding bounce memory.
const WRITE_CHUNK: usize = 1024 * 1024;
/// Number of RMW lock stripes; a power of two well above the number of concurrent requests.
const RMW_STRIPES: usize = 64;

/// Where the encrypted payload lives on the backend and how its IVs are numbered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CryptLayout {
    /// Byte offset of the payload on the backend.
    pub data_offset: u64,
    /// Payload size in bytes; rounded down to a whole number of encryption sectors.
    pub payload_size: u64,
    /// Added to every IV sector number, in units of the encryption sector.
    pub iv_offset: u64,
    /// Refuse writes even if the backend accepts them.
    pub read_only: bool,
}

/// A decrypted view of an encrypted payload.
pub struct CryptDevice {
    backend: Arc<dyn BlockDevice>,
    cipher: Arc<dyn SectorCipher>,
    pool: Arc<CryptoPool>,
    layout: CryptLayout,
    size: u64,
    sector: u64,
    bounce: BouncePool,
    rmw_locks: Box<[Mutex<()>]>,
}

impl std::fmt::Debug for CryptDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the cipher itself: it holds key material.
        f.debug_struct("CryptDevice")
            .field("layout", &self.layout)
            .field("size", &self.size)
            .field("sector_size", &self.sector)
            .field("engine", &self.cipher.engine_name())
            .finish()
    }
}

impl CryptDevice {
    pub fn new(
        backend: Arc<dyn BlockDevice>,
        layout: CryptLayout,
        cipher: Arc<dyn SectorCipher>,
        pool: Arc<CryptoPool>,
    ) -> Result<Self, BlockError> {
        let ss = cipher.sector_size();
        if !(512..=MAX_SECTOR).contains(&ss) || !ss.is_power_of_two() {
            return Err(BlockError::unsupported(format!(
                "encryption sector size {ss}"
            )));
        }
        let sector = ss as u64;
        let size = layout.payload_size - layout.payload_size % sector;
        match layout.data_offset.checked_add(size) {
            Some(end) if end <= backend.size() => {}
            _ => {
                return Err(BlockError::new(
                    BlockErrorKind::OutOfRange,
                    format!(
                        "encrypted payload of {size} bytes at offset {} does not fit the {}-byte device",
                        layout.data_offset,
                        backend.size()
                    ),
                ))
            }
        }
        let threads = pool.threads();
        Ok(CryptDevice {
            backend,
            cipher,
            pool,
            layout,
            size,
            sector,
            // One spare buffer per worker-sized burst of concurrent writers is plenty.
            bounce: BouncePool::new(WRITE_CHUNK, threads.clamp(2, 16)),
            rmw_locks: (0..RMW_STRIPES).map(|_| Mutex::new(())).collect(),
        })
    }

    pub fn layout(&self) -> &CryptLayout {
        &self.layout
    }

    pub fn backend(&self) -> &Arc<dyn BlockDevice> {
        &self.backend
    }

    pub fn cipher(&self) -> &Arc<dyn SectorCipher> {
        &self.cipher
    }

    /// IV sector number of the sector starting at payload offset `off` (sector aligned).
    fn iv_sector(&self, off: u64) -> u64 {
        self.layout.iv_offset.wrapping_add(off / self.sector)
    }

    fn crypt(&self, dir: Direction, off: u64, data: &mut [u8]) -> Result<(), BlockError> {
        self.pool
            .crypt(&self.cipher, dir, self.iv_sector(off), data)
            .map_err(|e| crypto_error(dir, off, e))
    }

    /// Encrypts the plaintext `src` for payload offset `off` into `dst` in one pass.
    fn encrypt_into(&self, off: u64, src: &[u8], dst: &mut [u8]) -> Result<(), BlockError> {
        let dir = Direction::Encrypt;
        self.pool
            .crypt_into(&self.cipher, dir, self.iv_sector(off), src, dst)
            .map_err(|e| crypto_error(dir, off, e))
    }

    fn rmw_lock(&self, sector_off: u64) -> MutexGuard<'_, ()> {
        let idx = ((sector_off / self.sector) % RMW_STRIPES as u64) as usize;
        // The guarded value is `()`: a poisoned stripe carries no broken state.
        self.rmw_locks[idx]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Decrypts the whole sector at `sector_off` into `out[..sector]`.
    fn read_sector(&self, sector_off: u64, out: &mut [u8]) -> Result<(), BlockError> {
        let s = &mut out[..self.sector as usize];
        self.backend
            .read_at(s, self.layout.data_offset + sector_off)?;
        self.crypt(Direction::Decrypt, sector_off, s)
    }

    /// Replaces `data.len()` bytes at `within` inside the sector at `sector_off`.
    fn rmw(&self, sector_off: u64, within: usize, data: &[u8]) -> Result<(), BlockError> {
        let ss = self.sector as usize;
        let mut tmp = [0u8; MAX_SECTOR];
        let _guard = self.rmw_lock(sector_off);
        self.read_sector(sector_off, &mut tmp)?;
        let s = &mut tmp[..ss];
        s[within..within + data.len()].copy_from_slice(data);
        self.crypt(Direction::Encrypt, sector_off, s)?;
        self.backend
            .write_at(s, self.layout.data_offset + sector_off)
    }
}

fn crypto_error(dir: Direction, off: u64, e: CryptoError) -> BlockError {
    let op = match dir {
        Direction::Encrypt => "encrypt",
        Direction::Decrypt => "decrypt",
    };
    BlockError::new(BlockErrorKind::Crypto, "sector transform failed")
        .with_op(op)
        .at(off)
        .with_source(e)
}

impl BlockDevice for CryptDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_size(&self) -> u32 {
        self.sector as u32
    }

    fn read_only(&self) -> bool {
        self.layout.read_only || self.backend.read_only()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        check_range("read", offset, buf.len() as u64, self.size)?;
        let ss = self.sector as usize;
        let mut done = 0usize;
        let head = (offset % self.sector) as usize;
        if head != 0 && !buf.is_empty() {
            let n = (ss - head).min(buf.len());
            let mut tmp = [0u8; MAX_SECTOR];
            self.read_sector(offset - head as u64, &mut tmp)?;
            buf[..n].copy_from_slice(&tmp[head..head + n]);
            done = n;
        }
        let aligned = (buf.len() - done) / ss * ss;
        if aligned > 0 {
            let off = offset + done as u64;
            let mid = &mut buf[done..done + aligned];
            self.backend.read_at(mid, self.layout.data_offset + off)?;
            self.crypt(Direction::Decrypt, off, mid)?;
            done += aligned;
        }
        if done < buf.len() {
            let mut tmp = [0u8; MAX_SECTOR];
            self.read_sector(offset + done as u64, &mut tmp)?;
            let n = buf.len() - done;
            buf[done..].copy_from_slice(&tmp[..n]);
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        if self.read_only() {
            return Err(BlockError::read_only("write").at(offset));
        }
        check_range("write", offset, buf.len() as u64, self.size)?;
        let ss = self.sector as usize;
        let mut done = 0usize;
        let head = (offset % self.sector) as usize;
        if head != 0 && !buf.is_empty() {
            let n = (ss - head).min(buf.len());
            self.rmw(offset - head as u64, head, &buf[..n])?;
            done = n;
        }
        let aligned = (buf.len() - done) / ss * ss;
        let chunk_max = WRITE_CHUNK / ss * ss;
        let end = done + aligned;
        while done < end {
            let n = chunk_max.min(end - done);
            let off = offset + done as u64;
            let mut bounce = self.bounce.take(n);
            self.encrypt_into(off, &buf[done..done + n], &mut bounce)?;
            self.backend
                .write_at(&bounce, self.layout.data_offset + off)?;
            done += n;
        }
        if done < buf.len() {
            self.rmw(offset + done as u64, 0, &buf[done..])?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), BlockError> {
        self.backend.flush()
    }

    /// Discards the whole encryption sectors inside the range on the backend (partial sectors
    /// at either end are left alone: discarding them would destroy the neighbouring bytes).
    ///
    /// Like dm-crypt with `allow_discards`, a discarded range then reads back as garbage
    /// plaintext (the decryption of whatever the backend returns, zeros for a punched hole),
    /// not as zeros; and the backend's allocation map reveals which sectors were discarded.
    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        if self.read_only() {
            return Err(BlockError::read_only("discard").at(offset));
        }
        check_range("discard", offset, len, self.size)?;
        let start = offset.div_ceil(self.sector) * self.sector;
        let end = (offset + len) / self.sector * self.sector;
        if end <= start {
            return Ok(());
        }
        self.backend
            .discard(self.layout.data_offset + start, end - start)
    }

    /// Always data: a hole in the ciphertext does not decrypt to zeros, so nothing below this
    /// layer can tell us which plaintext ranges are zero.
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        check_range("block_status", offset, 0, self.size)?;
        Ok(Extent {
            len: len.min(self.size - offset),
            kind: ExtentKind::Data,
        })
    }
}
