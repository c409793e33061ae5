//! The plaintext parts of a volume: a raw disk, which is served through the volume's segment
//! map so that it can be encrypted while it serves (`ctl reencrypt-start --encrypt`), and the
//! parts of such a disk an online encryption has not reached yet. Nothing is transformed:
//! requests only move by the part's data offset (an encryption moves the first bytes of the
//! disk to the image's end while its header takes their place).
use super::units::{Placement, VolumeOffset};
use cryptblk_block::check_range;
use cryptblk_block::{BlockDevice, BlockError, Extent};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub(crate) struct PlainCore {
    pub(super) backend: Arc<dyn BlockDevice>,
    /// Where this part's volume offsets are stored on the backend.
    pub(super) place: Placement,
    /// The volume's size, shared with every part of it.
    pub(super) size: Arc<AtomicU64>,
    pub(super) read_only: bool,
}

impl std::fmt::Debug for PlainCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlainCore")
            .field("data_offset", &self.place.data_offset())
            .field("size", &self.size())
            .finish()
    }
}

impl PlainCore {
    /// The backend's offset of volume offset `offset` (range-checked against the volume).
    fn at(&self, offset: u64) -> u64 {
        self.place.backend(VolumeOffset::new(offset)).bytes()
    }
}

impl BlockDevice for PlainCore {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn logical_block_size(&self) -> u32 {
        self.backend.logical_block_size()
    }

    fn read_only(&self) -> bool {
        self.read_only || self.backend.read_only()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        check_range("read", offset, buf.len() as u64, self.size())?;
        self.backend.read_at(buf, self.at(offset))
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        if self.read_only() {
            return Err(BlockError::read_only("write").at(offset));
        }
        check_range("write", offset, buf.len() as u64, self.size())?;
        self.backend.write_at(buf, self.at(offset))
    }

    fn flush(&self) -> Result<(), BlockError> {
        self.backend.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        if self.read_only() {
            return Err(BlockError::read_only("discard").at(offset));
        }
        check_range("discard", offset, len, self.size())?;
        self.backend.discard(self.at(offset), len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        if self.read_only() {
            return Err(BlockError::read_only("write").at(offset));
        }
        check_range("write zeroes", offset, len, self.size())?;
        self.backend.write_zeroes(self.at(offset), len)
    }

    /// The backend's allocation, clipped to the volume (a raw file's holes read as zeros).
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        check_range("block_status", offset, 0, self.size())?;
        let len = len.min(self.size() - offset);
        let mut extent = self.backend.block_status(self.at(offset), len)?;
        extent.len = extent.len.min(len);
        Ok(extent)
    }
}
