//! Data work a layered queue hands down to the threads that run its backend's requests.
//!
//! An engine that runs each request as a blocking call on a pool thread (`threads`) can do a
//! layer's per-request data work right there, before the completion is handed out: then the
//! work of a batch runs on as many threads as run its transfers, instead of on the one thread
//! that drives the queue. The encrypted volume offloads its crypto this way; on an engine
//! whose transfers complete in the kernel (io_uring) it keeps doing the work itself, in
//! batches over the crypto pool.

use super::IoBuffers;
use crate::BlockError;

/// Per-request data work, in the backend's offsets.
pub trait Offload: Send + Sync {
    /// Runs after a read into `buffers` at `offset` succeeded: transforms the data in place.
    fn after_read(&self, offset: u64, buffers: &IoBuffers) -> Result<(), BlockError>;

    /// Runs before a write of `buffers` at `offset`: puts the bytes to write in `out` (as many
    /// as `buffers` holds). The request's own buffers are not changed.
    fn before_write(
        &self,
        offset: u64,
        buffers: &IoBuffers,
        out: &mut [u8],
    ) -> Result<(), BlockError>;
}
