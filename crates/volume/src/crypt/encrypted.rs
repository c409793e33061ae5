//! One encrypted part of the volume: a payload region of a backend device, transformed sector
//! by sector with a `SectorCipher` on the crypto worker pool; the crypto of both the
//! asynchronous path (`crypt/stage.rs`: `decrypt_iov`, `encrypt_iov`) and the synchronous one
//! (its `BlockDevice` methods).
//!
//! Aligned I/O is the fast path: reads decrypt in place in the caller's buffer, writes encrypt
//! from the caller's buffer into a bounce buffer from the process's cache in one pass (the
//! caller's data is never modified). I/O that is not aligned to the encryption sector is
//! served by read-modify-write of the edge sectors; that is correct but slow, and concurrent
//! RMW of one sector is serialised by a striped lock so that two unaligned writes to different
//! bytes of the same sector cannot lose either update.
use super::units::{BackendOffset, IvNumbering, IvSector, Placement, VolumeOffset};
use super::CryptLayout;
use cryptblk_block::aio::IoBuffers;
use cryptblk_block::check_range;
use cryptblk_block::{BlockDevice, BlockError, BlockErrorKind, Extent, ExtentKind};
use cryptblk_crypto::{CryptoError, CryptoPool, Direction, SectorCipher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Largest encryption sector (LUKS2 allows 512..=4096); edge sectors live on the stack.
const MAX_SECTOR: usize = 4096;
/// Writes are encrypted and written in pieces of at most this size, bounding bounce memory.
const WRITE_CHUNK: usize = 1024 * 1024;
/// Number of RMW lock stripes; a power of two well above the number of concurrent requests.
const RMW_STRIPES: usize = 64;

/// One encryption sector on the stack, aligned so that a direct-I/O backend can transfer it
/// without a bounce buffer (read-modify-write of partial sectors).
#[repr(C, align(4096))]
struct SectorBuf([u8; MAX_SECTOR]);

impl SectorBuf {
    fn new() -> Self {
        SectorBuf([0; MAX_SECTOR])
    }
}

impl std::ops::Deref for SectorBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl std::ops::DerefMut for SectorBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// The state of a volume, shared by the device and its asynchronous queues.
pub(crate) struct CryptCore {
    pub(super) backend: Arc<dyn BlockDevice>,
    pub(super) cipher: Arc<dyn SectorCipher>,
    pool: Arc<CryptoPool>,
    pub(super) layout: CryptLayout,
    /// The payload's size: `layout.payload_size` (in whole sectors) until a resize
    /// (`CryptDevice::set_size`). Read by every request's range check; shared by the cores
    /// of one payload under other ciphers (a reencryption's new segment) and its segment map.
    pub(super) size: Arc<AtomicU64>,
    /// The IV sector of each encryption sector, and the sector's size.
    pub(super) ivs: IvNumbering,
    rmw_locks: Box<[Mutex<()>]>,
}

impl std::fmt::Debug for CryptCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the cipher itself: it holds key material.
        f.debug_struct("CryptDevice")
            .field("layout", &self.layout)
            .field("size", &self.size())
            .field("sector_size", &self.sector())
            .field("engine", &self.cipher.engine_name())
            .finish()
    }
}

impl CryptCore {
    pub(super) fn new(
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
            Some(end) if end.bytes() <= backend.size() => {}
            _ => {
                return Err(BlockError::new(
                    BlockErrorKind::OutOfRange,
                    format!(
                        "encrypted payload of {size} bytes at offset {} does not fit the {}-byte device",
                        layout.data_offset.bytes(),
                        backend.size()
                    ),
                ))
            }
        }
        Ok(CryptCore {
            backend,
            cipher,
            pool,
            layout,
            size: Arc::new(AtomicU64::new(size)),
            ivs: IvNumbering::new(layout.iv_offset, sector),
            rmw_locks: (0..RMW_STRIPES).map(|_| Mutex::new(())).collect(),
        })
    }

    /// The same payload under another cipher (a reencryption's new segment).
    pub(super) fn with_cipher(
        &self,
        cipher: Arc<dyn SectorCipher>,
    ) -> Result<Arc<CryptCore>, BlockError> {
        let mut core =
            CryptCore::new(self.backend.clone(), self.layout, cipher, self.pool.clone())?;
        // The payload a resize may have moved since the open, not the layout's.
        core.size = self.size.clone();
        Ok(Arc::new(core))
    }

    /// One encrypted part of a payload whose parts lie at different places (a reencryption
    /// that moves data), stored at `place` with IVs numbered by `ivs` (whose sector must be
    /// the cipher's). Only the part's own range must fit the backend, which the LUKS2 metadata
    /// it comes from was checked for.
    pub(super) fn part(
        backend: Arc<dyn BlockDevice>,
        cipher: Arc<dyn SectorCipher>,
        pool: Arc<CryptoPool>,
        place: Placement,
        ivs: IvNumbering,
        size: Arc<AtomicU64>,
        read_only: bool,
    ) -> Result<Arc<CryptCore>, BlockError> {
        let layout = CryptLayout {
            data_offset: BackendOffset::new(0),
            payload_size: 0,
            iv_offset: ivs.first(),
            read_only,
        };
        let mut core = CryptCore::new(backend, layout, cipher, pool)?;
        if core.ivs != ivs {
            return Err(BlockError::unsupported(format!(
                "a {}-byte-sector part under a {}-byte-sector cipher",
                ivs.sector(),
                core.sector()
            )));
        }
        core.layout.data_offset = place.data_offset();
        core.size = size;
        Ok(Arc::new(core))
    }

    /// The encryption sector in bytes.
    #[inline]
    pub(super) fn sector(&self) -> u64 {
        self.ivs.sector()
    }

    /// The IV sector of the sector starting at volume offset `v` (sector aligned).
    #[inline]
    fn iv_sector(&self, v: VolumeOffset) -> IvSector {
        self.ivs.iv_sector(v)
    }

    /// Where volume offset `v` is stored on the backend.
    #[inline]
    pub(super) fn backend_offset(&self, v: VolumeOffset) -> BackendOffset {
        self.layout.backend(v)
    }

    /// Decrypts a request's buffers in place: `iov` holds the ciphertext of volume offset
    /// `off` onwards, whole sectors per segment. The one decryption of the asynchronous path,
    /// whichever thread runs it (the queue's, or the `threads` engine's that read it).
    pub(super) fn decrypt_iov(
        &self,
        off: VolumeOffset,
        buffers: &IoBuffers,
    ) -> Result<(), BlockError> {
        let mut at = off;
        for bytes in buffers.raw_in_place() {
            let len = bytes.len() as u64;
            self.pool
                .crypt_raw(
                    &self.cipher,
                    Direction::Decrypt,
                    self.iv_sector(at).get(),
                    bytes,
                )
                .map_err(|e| crypto_error(Direction::Decrypt, at, e))?;
            at = at + len;
        }
        Ok(())
    }

    /// Encrypts a request's plaintext buffers (volume offset `off` onwards) into `out`, which
    /// receives the whole request contiguously; the caller's buffers are left as they are.
    /// The one encryption of the asynchronous path.
    pub(super) fn encrypt_iov(
        &self,
        off: VolumeOffset,
        buffers: &IoBuffers,
        out: &mut [u8],
    ) -> Result<(), BlockError> {
        let out_len = out.len();
        let Some(runs) = buffers.raw_into(out) else {
            return Err(BlockError::new(
                BlockErrorKind::Io,
                format!(
                    "{} bytes to encrypt at {} into a buffer of {out_len}",
                    buffers.len(),
                    off.bytes(),
                ),
            ));
        };
        let mut at = off;
        for bytes in runs {
            let len = bytes.len() as u64;
            self.pool
                .crypt_raw(
                    &self.cipher,
                    Direction::Encrypt,
                    self.iv_sector(at).get(),
                    bytes,
                )
                .map_err(|e| crypto_error(Direction::Encrypt, at, e))?;
            at = at + len;
        }
        Ok(())
    }

    fn crypt(&self, dir: Direction, off: VolumeOffset, data: &mut [u8]) -> Result<(), BlockError> {
        self.pool
            .crypt(&self.cipher, dir, self.iv_sector(off).get(), data)
            .map_err(|e| crypto_error(dir, off, e))
    }

    /// Encrypts the plaintext `src` for volume offset `off` into `dst` in one pass.
    fn encrypt_into(
        &self,
        off: VolumeOffset,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<(), BlockError> {
        let dir = Direction::Encrypt;
        self.pool
            .crypt_into(&self.cipher, dir, self.iv_sector(off).get(), src, dst)
            .map_err(|e| crypto_error(dir, off, e))
    }

    fn rmw_lock(&self, sector_off: VolumeOffset) -> MutexGuard<'_, ()> {
        let idx = ((sector_off.bytes() / self.sector()) % RMW_STRIPES as u64) as usize;
        // The guarded value is `()`: a poisoned stripe carries no broken state.
        self.rmw_locks[idx]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Decrypts the whole sector at `sector_off` into `out[..sector]`.
    fn read_sector(&self, sector_off: VolumeOffset, out: &mut [u8]) -> Result<(), BlockError> {
        let s = &mut out[..self.sector() as usize];
        self.backend
            .read_at(s, self.backend_offset(sector_off).bytes())?;
        self.crypt(Direction::Decrypt, sector_off, s)
    }

    /// Replaces `data.len()` bytes at `within` inside the sector at `sector_off`.
    fn rmw(&self, sector_off: VolumeOffset, within: usize, data: &[u8]) -> Result<(), BlockError> {
        let ss = self.sector() as usize;
        let mut tmp = SectorBuf::new();
        let _guard = self.rmw_lock(sector_off);
        self.read_sector(sector_off, &mut tmp)?;
        let s = &mut tmp[..ss];
        s[within..within + data.len()].copy_from_slice(data);
        self.crypt(Direction::Encrypt, sector_off, s)?;
        self.backend
            .write_at(s, self.backend_offset(sector_off).bytes())
    }
}

/// The whole sectors of `len` bytes at `offset`, as (offset, len); `None` when there are none.
pub(super) fn whole_sectors(
    offset: VolumeOffset,
    len: u64,
    sector: u64,
) -> Option<(VolumeOffset, u64)> {
    let start = offset.round_up(sector);
    let end = (offset + len).round_down(sector);
    (end > start).then(|| (start, end - start))
}

fn crypto_error(dir: Direction, off: VolumeOffset, e: CryptoError) -> BlockError {
    let op = match dir {
        Direction::Encrypt => "encrypt",
        Direction::Decrypt => "decrypt",
    };
    BlockError::new(BlockErrorKind::Crypto, "sector transform failed")
        .with_op(op)
        .at(off.bytes())
        .with_source(e)
}

impl BlockDevice for CryptCore {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// The encryption sector, or the backend's block when that is larger (a direct-I/O file
    /// on a 4 KiB device under 512-byte sectors), so clients send only whole blocks of both.
    fn logical_block_size(&self) -> u32 {
        (self.sector() as u32).max(self.backend.logical_block_size())
    }

    fn read_only(&self) -> bool {
        self.layout.read_only || self.backend.read_only()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        check_range("read", offset, buf.len() as u64, self.size())?;
        let offset = VolumeOffset::new(offset);
        let ss = self.sector() as usize;
        let mut done = 0usize;
        let head = offset.within(self.sector()) as usize;
        if head != 0 && !buf.is_empty() {
            let n = (ss - head).min(buf.len());
            let mut tmp = SectorBuf::new();
            self.read_sector(offset - head as u64, &mut tmp)?;
            buf[..n].copy_from_slice(&tmp[head..head + n]);
            done = n;
        }
        let aligned = (buf.len() - done) / ss * ss;
        if aligned > 0 {
            let off = offset + done as u64;
            let mid = &mut buf[done..done + aligned];
            self.backend
                .read_at(mid, self.backend_offset(off).bytes())?;
            self.crypt(Direction::Decrypt, off, mid)?;
            done += aligned;
        }
        if done < buf.len() {
            let mut tmp = SectorBuf::new();
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
        check_range("write", offset, buf.len() as u64, self.size())?;
        let offset = VolumeOffset::new(offset);
        let ss = self.sector() as usize;
        let mut done = 0usize;
        let head = offset.within(self.sector()) as usize;
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
            let mut bounce = cryptblk_block::buffers::take(n);
            let bounce = &mut bounce[..n];
            self.encrypt_into(off, &buf[done..done + n], bounce)?;
            self.backend
                .write_at(bounce, self.backend_offset(off).bytes())?;
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
        check_range("discard", offset, len, self.size())?;
        match whole_sectors(VolumeOffset::new(offset), len, self.sector()) {
            Some((start, len)) => self
                .backend
                .discard(self.backend_offset(start).bytes(), len),
            None => Ok(()),
        }
    }

    /// Always data: a hole in the ciphertext does not decrypt to zeros, so nothing below this
    /// layer can tell us which plaintext ranges are zero.
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        check_range("block_status", offset, 0, self.size())?;
        Ok(Extent {
            len: len.min(self.size() - offset),
            kind: ExtentKind::Data,
        })
    }
}
