//! The device a backup export serves: the image file's bytes as they were when the backup
//! started, whatever the disk was written since (the regions changed since come from the
//! copy-before-write scratch). Read-only; a discard releases what the backup's client has
//! stored. It reports its reads' times to the schedule that
//! makes a backup yield to the disk's users ([`BackupView::yielding`]).

use super::background::BackgroundReads;
use super::CopyBeforeWrite;
use cryptblk_block::{BlockDevice, BlockError, Extent, ExtentKind};
use std::sync::Arc;
use std::time::Instant;

/// A point-in-time, read-only view of an image file during a backup.
pub struct BackupView {
    source: Arc<dyn BlockDevice>,
    cbw: Arc<CopyBeforeWrite>,
    yielding: Option<Arc<BackgroundReads>>,
}

impl BackupView {
    /// `source` is the image file the copy-before-write state `cbw` copies from.
    pub fn new(source: Arc<dyn BlockDevice>, cbw: Arc<CopyBeforeWrite>) -> Self {
        BackupView {
            source,
            cbw,
            yielding: None,
        }
    }

    /// Reports every read's time to `reads`, whose [`admit`](BackgroundReads::admit) the
    /// export's read gate asks.
    pub fn yielding(mut self, reads: Arc<BackgroundReads>) -> Self {
        self.yielding = Some(reads);
        self
    }

    pub fn copy_before_write(&self) -> &Arc<CopyBeforeWrite> {
        &self.cbw
    }
}

impl BlockDevice for BackupView {
    fn size(&self) -> u64 {
        self.cbw.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.source.logical_block_size()
    }
    fn read_only(&self) -> bool {
        true
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        let Some(yielding) = &self.yielding else {
            return self.cbw.read_at(buf, offset);
        };
        yielding.read_started();
        let start = Instant::now();
        let read = self.cbw.read_at(buf, offset);
        yielding.read_took(buf.len() as u64, start.elapsed());
        read
    }
    fn write_at(&self, _buf: &[u8], _offset: u64) -> Result<(), BlockError> {
        Err(BlockError::read_only("write"))
    }
    fn flush(&self) -> Result<(), BlockError> {
        Ok(())
    }
    /// Not a change of the image: the client's word that it has stored the range, which the
    /// backup then stops keeping ([`CopyBeforeWrite::release`]). A zero-length discard
    /// succeeds, so an NBD export knows it may offer TRIM.
    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.cbw.release(offset, len)
    }
    fn write_zeroes(&self, _offset: u64, _len: u64) -> Result<(), BlockError> {
        Err(BlockError::read_only("write zeroes"))
    }
    /// The image's allocation, except that a region copied to the scratch is data (the image
    /// may have been discarded there since). Like a read, it may say data where the backup's
    /// moment had a hole (a region copied while this was asked): never the other way round.
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        cryptblk_block::check_range("block_status", offset, 0, self.size())?;
        let len = len.min(self.size() - offset);
        let region = super::copy_before_write::COPY_REGION;
        let region_end = (offset / region + 1) * region;
        let copied = Extent {
            len: len.min(region_end - offset),
            kind: ExtentKind::Data,
        };
        if self.cbw.is_copied(offset) {
            return Ok(copied);
        }
        let extent = self.source.block_status(offset, len)?;
        if extent.kind == ExtentKind::Data {
            return Ok(extent);
        }
        // Copied (and maybe discarded) while the image was asked: the old bytes are data.
        if self.cbw.is_copied(offset) {
            return Ok(copied);
        }
        // A hole reported up to the first region copied since (checked after the image was).
        let mut end = offset + extent.len;
        let mut at = region_end;
        while at < end {
            if self.cbw.is_copied(at) {
                end = at;
                break;
            }
            at += region;
        }
        Ok(Extent {
            len: end - offset,
            kind: extent.kind,
        })
    }
}
