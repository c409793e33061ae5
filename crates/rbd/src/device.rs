//! An RBD image as a [`BlockDevice`], so every layer above (the LUKS volume, the frontends,
//! convert) runs on it unchanged. Its queues are librbd's own asynchronous calls
//! ([`RbdEngine`](crate::RbdEngine)); the synchronous methods serve one-off callers.

use crate::{Image, OpenMode, RbdEngine, RbdError, RbdSpec};
use cryptblk_block::aio::{Bounds, Pipeline, QueueOptions};
use cryptblk_block::{
    BlockDevice, BlockError, BlockErrorKind, Container, Extent, ExtentKind, SharedStorage,
};
use cryptblk_luks::HeaderIo;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A block device over an open RBD image.
#[derive(Debug)]
pub struct RbdDevice {
    // Shared with the device's queues, which may outlive a reference to the device.
    image: Arc<Image>,
    /// `rbd:POOL/IMAGE[@SNAP]`, how messages name it (never the conf or keyring options).
    name: PathBuf,
}

impl RbdDevice {
    pub fn new(image: Image) -> RbdDevice {
        let name = PathBuf::from(format!("rbd:{}", image.name()));
        RbdDevice {
            image: Arc::new(image),
            name,
        }
    }

    /// Opens the image an `rbd:...` name names: writable under the exclusive lock, or
    /// read-only (always, for a snapshot).
    pub fn open(name: &str, writable: bool) -> Result<RbdDevice, RbdError> {
        let spec = RbdSpec::parse(name)?;
        let mode = if writable {
            OpenMode::ReadWrite
        } else {
            OpenMode::ReadOnly
        };
        Ok(RbdDevice::new(Image::open(&spec, mode)?))
    }

    /// Opens the image an `rbd:...` name names for writing without taking its exclusive lock:
    /// the destination of a hand-off, which takes the lock ([`SharedStorage::acquire`]) once
    /// the current writer released it, and must not write before.
    pub fn open_for_hand_off(name: &str) -> Result<RbdDevice, RbdError> {
        let spec = RbdSpec::parse(name)?;
        if spec.snapshot.is_some() {
            return Err(RbdError::BadName {
                name: spec.display_name(),
                reason: "a snapshot is read-only and cannot be handed over".into(),
            });
        }
        Ok(RbdDevice::new(Image::open(
            &spec,
            OpenMode::ReadWriteUnlocked,
        )?))
    }

    pub fn image(&self) -> &Image {
        &self.image
    }

    fn check(&self, op: &'static str, offset: u64, len: u64) -> Result<(), BlockError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.image.size() => Ok(()),
            _ => Err(BlockError::out_of_range(op, offset, len, self.image.size())),
        }
    }

    fn writable(&self, op: &'static str) -> Result<(), BlockError> {
        if self.image.read_only() {
            Err(BlockError::read_only(op))
        } else {
            Ok(())
        }
    }
}

/// Opening (or creating) an image failed: a block error of the matching kind (a held lock is
/// `Locked`), the librbd message kept as source.
pub fn open_error(err: RbdError) -> BlockError {
    BlockError::new(error_kind(&err), "").with_source(err)
}

fn error_kind(err: &RbdError) -> BlockErrorKind {
    match err {
        RbdError::Locked { .. } => BlockErrorKind::Locked,
        RbdError::Call { errno, .. } if *errno == libc::EROFS => BlockErrorKind::ReadOnly,
        _ => BlockErrorKind::Io,
    }
}

/// A librbd error as a block error of the matching kind, the librbd message kept as source.
pub fn block_error(op: &'static str, offset: u64, err: RbdError) -> BlockError {
    BlockError::new(error_kind(&err), "")
        .with_op(op)
        .at(offset)
        .with_source(err)
}

impl BlockDevice for RbdDevice {
    fn size(&self) -> u64 {
        self.image.size()
    }

    fn read_only(&self) -> bool {
        self.image.read_only()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.check("read", offset, buf.len() as u64)?;
        self.image
            .read_at(buf, offset)
            .map_err(|e| block_error("read", offset, e))
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        self.writable("write")?;
        self.check("write", offset, buf.len() as u64)?;
        self.image
            .write_at(buf, offset)
            .map_err(|e| block_error("write", offset, e))
    }

    fn flush(&self) -> Result<(), BlockError> {
        if self.image.read_only() {
            return Ok(());
        }
        self.image.flush().map_err(|e| block_error("flush", 0, e))
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.writable("discard")?;
        self.check("discard", offset, len)?;
        self.image
            .discard(offset, len)
            .map_err(|e| block_error("discard", offset, e))
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.writable("write zeroes")?;
        self.check("write zeroes", offset, len)?;
        self.image
            .write_zeroes(offset, len)
            .map_err(|e| block_error("write zeroes", offset, e))
    }

    fn pipeline(&self, opts: &QueueOptions) -> Option<Result<Pipeline, BlockError>> {
        let image = self.image.clone();
        // The image may grow (a resize seen by the refresh): its size is read per request.
        let size = image.clone();
        let bounds = Bounds::live(Arc::new(move || size.size()), image.read_only());
        Some(Pipeline::new(opts, bounds, |notifier, capacity| {
            Ok(Box::new(RbdEngine::new(image, capacity, notifier)?))
        }))
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        self.check("block_status", offset, 0)?;
        let len = len.min(self.image.size() - offset);
        if len == 0 {
            return Ok(Extent {
                len: 0,
                kind: ExtentKind::Data,
            });
        }
        let runs = self
            .image
            .allocated(offset, len)
            .map_err(|e| block_error("block_status", offset, e))?;
        Ok(match runs.first() {
            Some(run) if run.offset <= offset => Extent {
                len: (run.offset + run.len - offset).min(len),
                kind: ExtentKind::Data,
            },
            Some(run) => Extent {
                len: run.offset - offset,
                kind: ExtentKind::Unallocated,
            },
            None => Extent {
                len,
                kind: ExtentKind::Unallocated,
            },
        })
    }
}

/// A LUKS header on an RBD image is read and written through librbd like any data (librbd's
/// own encryption keeps it at the same place: the image's first bytes).
impl Container for RbdDevice {
    fn name(&self) -> &Path {
        &self.name
    }
    fn header_io(&self) -> &dyn HeaderIo {
        self
    }
    /// librbd's encryption reads unwritten areas as zeros; images it shares must match.
    fn unwritten_reads_as_zeros(&self) -> bool {
        true
    }
    fn shared_storage(&self) -> Option<&dyn SharedStorage> {
        Some(self)
    }
    /// `rbd resize`: the cluster may refuse (a pool quota, a full cluster), leaving the image
    /// as it was.
    fn set_len(&self, len: u64) -> Result<(), BlockError> {
        if self.image.read_only() {
            return Err(BlockError::read_only("resize").with_path(&self.name));
        }
        self.image
            .resize(len)
            .map_err(|e| block_error("resize", len, e))
    }
}

/// Every daemon of the cluster reaches the same image; its exclusive lock says which writes.
impl SharedStorage for RbdDevice {
    fn identity(&self) -> Result<String, BlockError> {
        self.image
            .identity()
            .map_err(|e| block_error("identify", 0, e))
    }
    fn release(&self) -> Result<(), BlockError> {
        self.image
            .flush()
            .and_then(|()| self.image.release_lock())
            .map_err(|e| block_error("release the lock", 0, e))
    }
    fn acquire(&self) -> Result<(), BlockError> {
        self.image
            .acquire_lock()
            .map_err(|e| block_error("take the lock", 0, e))
    }
}

impl HeaderIo for RbdDevice {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.image.read_exact_at(buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.image.write_all_at(buf, offset)
    }
    fn size(&self) -> std::io::Result<u64> {
        HeaderIo::size(&*self.image)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.image.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.image.sync_data()
    }
}

impl HeaderIo for Image {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|end| end > self.size())
        {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        self.read_at(buf, offset).map_err(std::io::Error::other)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        // librbd refuses writes past the end; a file would grow, so grow the image alike.
        let end = offset
            .checked_add(buf.len() as u64)
            .ok_or(std::io::ErrorKind::InvalidInput)?;
        if end > Image::size(self) {
            self.resize(end).map_err(std::io::Error::other)?;
        }
        self.write_at(buf, offset).map_err(std::io::Error::other)
    }
    fn size(&self) -> std::io::Result<u64> {
        Ok(Image::size(self))
    }
    /// Formatting a new image sizes it to hold the header and the payload.
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        if len == Image::size(self) {
            return Ok(());
        }
        self.resize(len).map_err(std::io::Error::other)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.flush().map_err(std::io::Error::other)
    }
}
