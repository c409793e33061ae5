//! The decrypted volume (`CryptDevice`): a payload on a backend device, served in parts
//! (`segments.rs`, `routes.rs`), each encrypted (`encrypted.rs`) or plaintext (`plain.rs`) and
//! placed on the backend with its own offsets (`units.rs`); the per-queue stage that puts it
//! on the backend's pipeline (`stage.rs`).

mod drain;
mod encrypted;
mod follow;
mod membarrier;
mod plain;
mod routes;
mod segments;
mod stage;
mod units;
mod zero_holes;

pub use drain::DRAIN_TIMEOUT;
pub use follow::SegmentCiphers;
pub use segments::SegmentMap;
pub use units::{BackendOffset, IvSector, VolumeOffset};

pub(crate) use units::Placement;
pub use zero_holes::data_cipher;

use cryptblk_block::aio::{Pipeline, QueueOptions};
use cryptblk_block::{BlockDevice, BlockError, BlockErrorKind, Extent};
use cryptblk_crypto::{CryptoPool, SectorCipher};
use encrypted::CryptCore;
use routes::Storage;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Where the encrypted payload lives on the backend and how its IVs are numbered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CryptLayout {
    /// Where the payload starts on the backend (volume offset 0).
    pub data_offset: BackendOffset,
    /// Payload size in bytes; rounded down to a whole number of encryption sectors.
    pub payload_size: u64,
    /// The IV sector of the payload's first sector (added to every sector's number).
    pub iv_offset: IvSector,
    /// Refuse writes even if the backend accepts them.
    pub read_only: bool,
}

impl CryptLayout {
    /// Where the payload's volume offset `v` is stored on the backend.
    pub fn backend(&self, v: VolumeOffset) -> BackendOffset {
        self.placement().backend(v)
    }

    pub(crate) fn placement(&self) -> Placement {
        Placement::at(self.data_offset)
    }
}

/// A decrypted view of a payload: encrypted with one key, or plaintext (a raw disk served so
/// that it can be encrypted while it serves), or, during an online reencryption, in the parts
/// its LUKS2 header describes. Cheap to share and to clone: clones and the queues opened on
/// it (`pipeline`) hold the same state.
#[derive(Clone)]
pub struct CryptDevice {
    /// The storage the volume was opened with: its backend, and its layout when encrypted.
    opened: Storage,
    /// Which storage serves which part of the payload (several during a reencryption).
    segments: Arc<SegmentMap>,
}

impl std::fmt::Debug for CryptDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.opened {
            Storage::Encrypted(core) => core.fmt(f),
            Storage::Plain(plain) => plain.fmt(f),
        }
    }
}

impl CryptDevice {
    pub fn new(
        backend: Arc<dyn BlockDevice>,
        layout: CryptLayout,
        cipher: Arc<dyn SectorCipher>,
        pool: Arc<CryptoPool>,
    ) -> Result<Self, BlockError> {
        let core = Arc::new(CryptCore::new(backend, layout, cipher, pool)?);
        Ok(CryptDevice {
            segments: SegmentMap::new(Storage::Encrypted(core.clone()), core.size.clone()),
            opened: Storage::Encrypted(core),
        })
    }

    /// All of `backend` as plaintext, byte for byte: a raw disk, which an online encryption
    /// (`cryptblk ctl reencrypt-start --encrypt`) can then turn into a LUKS2 volume of the
    /// same size while it serves. The size is the backend's now; `set_size` moves it.
    pub fn plaintext(backend: Arc<dyn BlockDevice>, read_only: bool) -> CryptDevice {
        let size = Arc::new(AtomicU64::new(backend.size()));
        let plain = Arc::new(plain::PlainCore {
            backend,
            place: Placement::at(BackendOffset::new(0)),
            size: size.clone(),
            read_only,
        });
        CryptDevice {
            segments: SegmentMap::new(Storage::Plain(plain.clone()), size),
            opened: Storage::Plain(plain),
        }
    }

    /// The segment map, through which an online reencryption moves the payload from the old
    /// layout to the new one while the device serves.
    pub fn segments(&self) -> &Arc<SegmentMap> {
        &self.segments
    }

    pub fn backend(&self) -> &Arc<dyn BlockDevice> {
        self.opened.backend()
    }

    /// The cipher serving the volume (the new one once a reencryption finished); `None`
    /// while the volume is plaintext.
    pub fn cipher(&self) -> Option<Arc<dyn SectorCipher>> {
        self.segments.cipher()
    }

    /// Resizes the payload to `size` bytes (an online resize; the layout it opened with stays
    /// the size at open). The caller has already grown the backend when the payload grows,
    /// and cuts it only afterwards when the payload shrinks: requests are checked against the
    /// new size from the moment this returns, on every queue.
    pub fn set_size(&self, size: u64) -> Result<(), BlockError> {
        // Whole sectors of every cipher serving the payload (after a reencryption to larger
        // sectors, the new one's).
        let routes = self.segments.routes();
        let sector = routes
            .parts
            .iter()
            .fold(1, |s, part| s.max(part.storage.sector()));
        if !size.is_multiple_of(sector) {
            return Err(BlockError::new(
                BlockErrorKind::Unaligned,
                format!(
                    "{size} bytes is not a whole number of {sector}-byte encryption sectors: \
                     round it to a multiple of {sector}"
                ),
            ));
        }
        // The part the new end falls in must fit the backend (during a reencryption the
        // parts lie at different offsets; resizes are refused then, but the check holds).
        let backend = self.opened.backend().size();
        let end = VolumeOffset::new(size);
        let last = routes
            .parts
            .partition_point(|p| p.start < end)
            .saturating_sub(1);
        let data_offset = routes.parts[last].storage.placement().data_offset();
        if data_offset
            .checked_add(size)
            .is_none_or(|end| end.bytes() > backend)
        {
            return Err(BlockError::new(
                BlockErrorKind::OutOfRange,
                format!(
                    "a payload of {size} bytes at offset {} does not fit the \
                     {backend}-byte device",
                    data_offset.bytes()
                ),
            ));
        }
        self.segments.size_cell().store(size, Ordering::Release);
        Ok(())
    }
}

impl BlockDevice for CryptDevice {
    fn size(&self) -> u64 {
        self.segments.size()
    }
    fn logical_block_size(&self) -> u32 {
        BlockDevice::logical_block_size(self.segments.as_ref())
    }
    fn read_only(&self) -> bool {
        BlockDevice::read_only(self.segments.as_ref())
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.segments.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        if self.read_only() {
            return Err(BlockError::read_only("write").at(offset));
        }
        self.segments.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.opened.backend().flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        if self.read_only() {
            return Err(BlockError::read_only("discard").at(offset));
        }
        self.segments.discard(offset, len)
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        self.segments.block_status(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        if self.read_only() {
            return Err(BlockError::read_only("write").at(offset));
        }
        self.segments.write_zeroes(offset, len)
    }
    fn pipeline(&self, opts: &QueueOptions) -> Option<Result<Pipeline, BlockError>> {
        Some(stage::open(
            self.opened.backend(),
            self.segments.clone(),
            opts,
        ))
    }
}
