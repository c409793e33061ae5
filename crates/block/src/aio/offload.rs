//! Data work a layered queue hands down to the threads that run its backend's requests.
//!
//! An engine that runs each request as a blocking call on a pool thread (`threads`) can do a
//! layer's per-request data work right there, before the completion is handed out: then the
//! work of a batch runs on as many threads as run its transfers, instead of on the one thread
//! that drives the queue. The encrypted volume offloads its crypto this way; on an engine
//! whose transfers complete in the kernel (io_uring) it keeps doing the work itself, in
//! batches over the crypto pool.

use super::IoVec;
use crate::BlockError;

/// Per-request data work, in the backend's offsets.
pub trait Offload: Send + Sync {
    /// Runs after a read of `iov` at `offset` succeeded: transforms the data in place.
    ///
    /// # Safety
    /// `iov`'s buffers are valid for reads and writes for the call.
    unsafe fn after_read(&self, offset: u64, iov: &[IoVec]) -> Result<(), BlockError>;

    /// Runs before a write of `iov` at `offset`: puts the bytes to write in `out` (as many as
    /// `iov` holds). The request's own buffers are not changed.
    ///
    /// # Safety
    /// `iov`'s buffers are valid for reads; `out` is valid for writes of their total length
    /// and overlaps none of them.
    unsafe fn before_write(
        &self,
        offset: u64,
        iov: &[IoVec],
        out: *mut u8,
    ) -> Result<(), BlockError>;
}
