//! Reading the image file one piece ahead of the bulk sender: while the sender sends one
//! piece, the next is read through an asynchronous queue of the file's (io_uring, O_DIRECT
//! when the disk bypasses the page cache), so a real device's latency overlaps the network.

use cryptblk_block::aio::{IoBuffers, IoQueue, IoRequest, OwnedBuffer, QueueOptions};

use cryptblk_block::open_queue;
use cryptblk_block::{BlockDevice, BlockError, BlockErrorKind};
use std::sync::Arc;

/// Two piece buffers: one being sent, one being read into.
pub(super) struct ReadAhead {
    queue: Box<dyn IoQueue>,
    /// Held by the queue too while a read into it runs.
    bufs: [Arc<OwnedBuffer>; 2],
    /// The read being pushed (reused).
    request_buffers: IoBuffers,
    /// The read in flight: (buffer, length).
    in_flight: Option<(usize, usize)>,
}

impl ReadAhead {
    /// Pieces of at most `piece` bytes from `file`.
    pub(super) fn open(file: &Arc<dyn BlockDevice>, piece: usize) -> Result<Self, BlockError> {
        Ok(ReadAhead {
            queue: open_queue(file, &QueueOptions { depth: 2 })?,
            bufs: [
                Arc::new(OwnedBuffer::zeroed(piece)),
                Arc::new(OwnedBuffer::zeroed(piece)),
            ],
            request_buffers: IoBuffers::with_capacity(1),
            in_flight: None,
        })
    }

    pub(super) fn piece_size(&self) -> usize {
        self.bufs[0].len()
    }

    /// Starts reading `len` bytes at `offset` into buffer `which`. The previous read must
    /// have been collected (`finish`).
    pub(super) fn start(
        &mut self,
        which: usize,
        offset: u64,
        len: usize,
    ) -> Result<(), BlockError> {
        debug_assert!(self.in_flight.is_none() && len <= self.piece_size());
        let buffers = &mut self.request_buffers;
        buffers.set_owner(self.bufs[which].clone());
        buffers
            .add(0, len)
            .map_err(|e| BlockError::new(BlockErrorKind::Io, e.to_string()))?;
        let pushed = self
            .queue
            .push(&IoRequest::read(offset, buffers, which as u64));
        buffers.clear();
        pushed.map_err(|e| BlockError::new(BlockErrorKind::Io, e.to_string()))?;
        self.in_flight = Some((which, len));
        self.queue.submit()
    }

    /// Waits for the read in flight.
    pub(super) fn finish(&mut self) -> Result<(), BlockError> {
        if self.in_flight.is_none() {
            return Err(BlockError::new(BlockErrorKind::Io, "no read in flight"));
        }
        let mut result = None;
        while result.is_none() {
            self.queue.drain(&mut |c| result = Some(c.result));
            if result.is_none() {
                self.queue.wait();
            }
        }
        self.in_flight = None;
        result.unwrap_or(Ok(()))
    }

    /// Buffer `which` (what a finished read put there). The other buffer may meanwhile be
    /// read into by the kernel: they are separate allocations. An error while a read into
    /// `which` is still held by the queue.
    pub(super) fn buffer(&mut self, which: usize) -> Result<&[u8], BlockError> {
        match Arc::get_mut(&mut self.bufs[which]) {
            Some(buf) => Ok(buf.bytes_mut()),
            None => Err(BlockError::new(
                BlockErrorKind::Io,
                "read-ahead buffer read while a read into it is in flight",
            )),
        }
    }

    /// Waits for a read still in flight (after a chunk was broken off or failed), so the
    /// buffers may be read into again.
    pub(super) fn settle(&mut self) {
        if self.in_flight.is_some() {
            let _ = self.finish();
        }
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.settle();
    }
}
