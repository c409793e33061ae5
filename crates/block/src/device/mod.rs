//! The interface every layer (file backends, image formats, the encrypted volume) implements.

mod queue;
mod sync_engine;

pub use queue::{open_pipeline, open_queue};

use crate::error::check_range;
use crate::BlockError;

/// What a range of a device holds, as far as the device knows without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentKind {
    /// Allocated; must be read to know the contents.
    Data,
    /// Known to read as zeros (e.g. a qcow2 zero cluster).
    Zero,
    /// Not allocated at this layer and nothing beneath it: reads as zeros.
    Unallocated,
}

/// The first run of same-kind bytes starting at the queried offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes; never more than was asked for, and non-zero for a non-empty query.
    pub len: u64,
    pub kind: ExtentKind,
}

/// A random-access block device shared by many threads: all methods take `&self` so that
/// implementations can serve concurrent requests without a device-wide lock around I/O.
pub trait BlockDevice: Send + Sync {
    /// Size in bytes.
    fn size(&self) -> u64;

    /// The smallest I/O unit that needs no read-modify-write.
    fn logical_block_size(&self) -> u32 {
        512
    }

    fn read_only(&self) -> bool;

    /// Fills all of `buf` from `offset`; a range reaching beyond `size()` is an error.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError>;

    /// Writes all of `buf` at `offset`; a range reaching beyond `size()` is an error.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError>;

    /// Makes completed writes durable (fdatasync semantics).
    fn flush(&self) -> Result<(), BlockError>;

    /// Tells the device that `len` bytes at `offset` are no longer needed, so that it may
    /// deallocate them. What the range reads as afterwards depends on the device (zeros for a
    /// raw file, garbage for an encrypted volume). The default does not support discard.
    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        let _ = len;
        Err(
            BlockError::unsupported("discard is not supported by this device")
                .with_op("discard")
                .at(offset),
        )
    }

    /// Makes `len` bytes at `offset` read as zeros. The default writes zeros (on an encrypted
    /// volume: encrypted zeros, so the plaintext reads as zeros).
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        static ZEROES: [u8; 256 * 1024] = [0; 256 * 1024];
        check_range("write zeroes", offset, len, self.size())?;
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(ZEROES.len() as u64) as usize;
            self.write_at(&ZEROES[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }

    /// This device's own queue pipeline, if it has one: an asynchronous engine (io_uring for a
    /// raw file), or its backend's pipeline with this layer's stages in front (the encrypted
    /// volume). `None` (the default) means [`open_pipeline`] runs its synchronous methods
    /// on the I/O thread pool.
    fn pipeline(
        &self,
        opts: &crate::aio::QueueOptions,
    ) -> Option<Result<crate::aio::Pipeline, BlockError>> {
        let _ = opts;
        None
    }

    /// The extent starting at `offset`, at most `len` bytes long. The default knows nothing
    /// about allocation and reports the whole (clipped) range as data.
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        check_range("block_status", offset, 0, self.size())?;
        Ok(Extent {
            len: len.min(self.size() - offset),
            kind: ExtentKind::Data,
        })
    }
}
