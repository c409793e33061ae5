//! An RBD image as a [`BlockDevice`], so every layer above (the LUKS volume, the frontends,
//! convert) runs on it unchanged. Its queues are librbd's own asynchronous calls
//! ([`RbdQueue`](crate::RbdQueue)); the synchronous methods serve one-off callers.

use crate::{Image, RbdError, RbdQueue};
use cryptblk_block::aio::{IoQueue, QueueOptions};
use cryptblk_block::{BlockDevice, BlockError, BlockErrorKind, Extent, ExtentKind};
use std::sync::Arc;

/// A block device over an open RBD image.
#[derive(Debug)]
pub struct RbdDevice {
    // Shared with the device's queues, which may outlive a reference to the device.
    image: Arc<Image>,
}

impl RbdDevice {
    pub fn new(image: Image) -> RbdDevice {
        RbdDevice {
            image: Arc::new(image),
        }
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

/// A librbd error as a block error of the matching kind, the librbd message kept as source.
pub fn block_error(op: &'static str, offset: u64, err: RbdError) -> BlockError {
    let kind = match &err {
        RbdError::Locked { .. } => BlockErrorKind::Locked,
        RbdError::Call { errno, .. } if *errno == libc::EROFS => BlockErrorKind::ReadOnly,
        _ => BlockErrorKind::Io,
    };
    BlockError::new(kind, "")
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

    fn native_queue(&self, opts: &QueueOptions) -> Option<Result<Box<dyn IoQueue>, BlockError>> {
        Some(RbdQueue::new(self.image.clone(), opts.depth).map(|q| Box::new(q) as Box<dyn IoQueue>))
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
