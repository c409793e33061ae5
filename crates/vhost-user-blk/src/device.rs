//! Executing a parsed virtio-blk request against a `BlockDevice`, asynchronously: `start` turns
//! it into device I/O whose buffers are the guest's own (as raw pointers, never Rust
//! references), `finish` writes the status once the I/O completed.
//!
//! Reads land directly in the guest's buffers (and are decrypted there by an encrypting
//! device); writes go to the device straight from guest memory (an encrypting device encrypts
//! from there into its own bounce buffer, never in place in guest memory). Knows nothing about
//! vhost-user.
//!
//! Every guest byte written is marked in the memory's dirty bitmap (live migration): the
//! status byte and GET_ID through vm-memory's `Bytes` (which marks), read data explicitly.

use std::sync::Arc;

use cryptblk_block::aio::{IoBuffers, IoOp, IoQueue, IoRequest, QueueOptions};

use cryptblk_block::open_queue;
use cryptblk_block::{BlockDevice, BlockError, BlockErrorKind};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
};
use vm_memory::bitmap::Bitmap;
use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryMmap};

use crate::request::{
    Error as ParseError, Rejected, Request, RequestType, Segment, WriteZeroesRange, SECTOR_SIZE,
    WRITE_ZEROES_FLAG_UNMAP,
};
use crate::GuestRam;

/// Largest WRITE_ZEROES range accepted, in sectors (advertised as max_write_zeroes_sectors).
pub const MAX_WRITE_ZEROES_SECTORS: u32 = 64 * 1024;
/// Largest DISCARD range accepted, in sectors (advertised as max_discard_sectors); a multiple
/// of every logical block size (up to 4096 bytes).
pub const MAX_DISCARD_SECTORS: u32 = MAX_WRITE_ZEROES_SECTORS;

/// Status byte values.
pub const STATUS_OK: u8 = VIRTIO_BLK_S_OK as u8;
pub const STATUS_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
pub const STATUS_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;
/// Length of the GET_ID serial.
pub const ID_BYTES: usize = VIRTIO_BLK_ID_BYTES as usize;

/// What to do with a parsed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Answered without I/O: status byte and bytes written into guest buffers.
    Done(u8, u32),
    /// Submit this I/O (buffers in the `iov` passed to `VirtioBlkDevice::start`).
    Io(Planned),
}

/// Device I/O planned for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    pub op: IoOp,
    pub offset: u64,
    pub len: u64,
}

impl Planned {
    fn new(op: IoOp, offset: u64, len: u64) -> Self {
        Planned { op, offset, len }
    }

    /// The request for an `IoQueue`; `fua` for writes of a guest without a write cache.
    pub fn request<'a>(&self, buffers: &'a IoBuffers, fua: bool, tag: u64) -> IoRequest<'a> {
        IoRequest {
            op: self.op,
            offset: self.offset,
            len: self.len,
            buffers,
            fua: fua && self.op == IoOp::Write,
            tag,
        }
    }
}

/// The disk as the request executor sees it.
pub struct VirtioBlkDevice {
    device: Arc<dyn BlockDevice>,
    read_only: bool,
    /// DISCARD is offered and executed (only on a writable disk).
    discard: bool,
    serial: [u8; ID_BYTES],
}

impl VirtioBlkDevice {
    /// `serial` is cut to 20 bytes (zero-padded when shorter), as GET_ID returns it.
    pub fn new(device: Arc<dyn BlockDevice>, read_only: bool, serial: &str) -> Self {
        let mut id = [0u8; ID_BYTES];
        let n = serial.len().min(ID_BYTES);
        id[..n].copy_from_slice(&serial.as_bytes()[..n]);
        VirtioBlkDevice {
            read_only: read_only || device.read_only(),
            device,
            discard: false,
            serial: id,
        }
    }

    /// Passes guest discards to the device (like dm-crypt's `allow_discards`). Has no effect
    /// on a read-only disk: DISCARD is then neither offered nor executed.
    pub fn with_discard(mut self, enabled: bool) -> Self {
        self.discard = enabled && !self.read_only;
        self
    }

    /// True when DISCARD is offered to the guest.
    pub fn discard(&self) -> bool {
        self.discard
    }

    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.device
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Capacity in bytes, rounded down to whole 512-byte sectors.
    pub fn capacity(&self) -> u64 {
        self.device.size() / SECTOR_SIZE * SECTOR_SIZE
    }

    /// Opens the asynchronous queue the requests of one virtqueue run on (one per queue
    /// thread), deep enough for every request the virtqueue can hold.
    pub fn open_queue(&self, depth: usize) -> Result<Box<dyn IoQueue>, BlockError> {
        open_queue(&self.device, &QueueOptions { depth })
    }

    /// Turns a parsed request into device I/O, or answers it at once. For I/O, `buffers`
    /// (owned by `mem`'s [`GuestRam`], set by the caller) receive the
    /// request's segments, each checked to lie in one mapped region; they keep the memory
    /// mapped until the queue hands the completion out.
    pub fn start<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        req: &Request,
        segments: &[Segment],
        buffers: &mut IoBuffers,
    ) -> Start {
        buffers.clear_list();
        match req.kind {
            RequestType::In | RequestType::Out => {
                if req.kind == RequestType::Out && self.read_only {
                    return Start::Done(STATUS_IOERR, 0);
                }
                for seg in segments {
                    if let Err(e) = buffers.add(seg.addr.0, seg.len as usize) {
                        // The parser checked every segment against `mem`; only a memory
                        // table change in between, or buffers owned by other memory, gets
                        // here.
                        tracing::debug!("request segment refused: {e}");
                        return Start::Done(STATUS_IOERR, 0);
                    }
                }
                let offset = req.sector * SECTOR_SIZE;
                Start::Io(if req.kind == RequestType::In {
                    Planned::new(IoOp::Read, offset, req.data_len)
                } else {
                    Planned::new(IoOp::Write, offset, req.data_len)
                })
            }
            RequestType::Flush => Start::Io(Planned::new(IoOp::Flush, 0, 0)),
            RequestType::GetId => match self.get_id(mem, segments) {
                Some(n) => Start::Done(STATUS_OK, n as u32),
                None => Start::Done(STATUS_IOERR, 0),
            },
            RequestType::WriteZeroes => self.range(mem, segments, IoOp::WriteZeroes),
            RequestType::Discard => self.range(mem, segments, IoOp::Discard),
            RequestType::Unsupported(_) => Start::Done(STATUS_UNSUPP, 0),
        }
    }

    /// Completes a request whose I/O finished: marks the guest pages a read filled (live
    /// migration's dirty log) and writes the status byte. Returns the status and the used
    /// length (data written into guest buffers + the status byte).
    pub fn finish<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        req: &Request,
        segments: &[Segment],
        result: &Result<(), BlockError>,
    ) -> (u8, u32) {
        let (status, data_len) = match (req.kind, result) {
            (RequestType::In, Ok(())) => (STATUS_OK, req.data_len),
            (_, Ok(())) => (STATUS_OK, 0),
            (_, Err(e)) if e.kind() == BlockErrorKind::Unsupported => (STATUS_UNSUPP, 0),
            (_, Err(_)) => (STATUS_IOERR, 0),
        };
        if req.kind == RequestType::In {
            // The kernel and the crypto engine wrote through raw pointers, past vm-memory's
            // dirty tracking: mark the pages (a no-op without a dirty log). Also on error,
            // as part of the buffer may have been written.
            for seg in segments {
                if let Ok(slice) = mem.get_slice(seg.addr, seg.len as usize) {
                    slice.bitmap().mark_dirty(0, seg.len as usize);
                }
            }
        }
        self.answer(mem, req, status, data_len as u32)
    }

    /// Writes the status byte of a request answered without I/O (`Start::Done`).
    pub fn answer<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        req: &Request,
        status: u8,
        data_len: u32,
    ) -> (u8, u32) {
        if mem.write_obj(status, req.status).is_err() {
            // The parser checked the status byte lies in guest memory; a memory table change
            // in between is the only way here. Report nothing written.
            return (STATUS_IOERR, 0);
        }
        (status, data_len.saturating_add(1))
    }

    /// Runs one request to completion on `queue` and answers it; returns the used length. A
    /// queue worker overlaps many requests with `start`/`finish`; the fuzz target and the
    /// randomized chain test run one at a time through this.
    pub fn execute_one<B: Bitmap + Send + Sync + 'static>(
        &self,
        queue: &mut dyn IoQueue,
        mem: &Arc<GuestMemoryMmap<B>>,
        req: &Request,
        segments: &[Segment],
    ) -> u32 {
        let mut buffers = IoBuffers::new();
        buffers.set_owner(GuestRam::owner(mem.clone()));
        let mem = &**mem;
        match self.start(mem, req, segments, &mut buffers) {
            Start::Done(status, len) => self.answer(mem, req, status, len).1,
            Start::Io(planned) => {
                let result =
                    cryptblk_block::aio::run_one(queue, &planned.request(&buffers, false, 0));
                self.finish(mem, req, segments, &result).1
            }
        }
    }

    /// Answers a request the parser rejected: the right status when the status descriptor is
    /// usable, otherwise nothing. Returns the used length.
    pub fn reject<M: GuestMemoryBackend>(&self, mem: &M, rejected: &Rejected) -> u32 {
        let Some(status_addr) = rejected.status else {
            return 0;
        };
        let status = match rejected.error {
            ParseError::Unsupported(_) => STATUS_UNSUPP,
            // A disk without discard answers every DISCARD with UNSUPP, well-formed or not.
            ParseError::BadDiscardRangeList(_) if !self.discard => STATUS_UNSUPP,
            _ => STATUS_IOERR,
        };
        match mem.write_obj(status, status_addr) {
            Ok(()) => 1,
            Err(_) => 0,
        }
    }

    /// Plans the one WRITE_ZEROES or DISCARD range the request carries. Anything but one
    /// range inside the disk (DISCARD: aligned to the logical block, advertised as
    /// discard_sector_alignment; both: within the advertised maximum) is an I/O error; flags
    /// other than UNMAP (write zeroes only) are unsupported, as is DISCARD when not enabled.
    fn range<M: GuestMemoryBackend>(&self, mem: &M, segments: &[Segment], op: IoOp) -> Start {
        if op == IoOp::Discard && !self.discard {
            return Start::Done(STATUS_UNSUPP, 0);
        }
        let Some(seg) = segments.first() else {
            return Start::Done(STATUS_IOERR, 0);
        };
        let Ok(range) = mem.read_obj::<WriteZeroesRange>(seg.addr) else {
            return Start::Done(STATUS_IOERR, 0);
        };
        let (sector, num, flags) = (
            u64::from_le(range.sector),
            u32::from_le(range.num_sectors),
            u32::from_le(range.flags),
        );
        let (allowed_flags, max) = match op {
            IoOp::WriteZeroes => (WRITE_ZEROES_FLAG_UNMAP, MAX_WRITE_ZEROES_SECTORS),
            // The spec defines no flag for discard (UNMAP is only for write zeroes).
            _ => (0, MAX_DISCARD_SECTORS),
        };
        if flags & !allowed_flags != 0 {
            return Start::Done(STATUS_UNSUPP, 0);
        }
        if self.read_only || num > max {
            return Start::Done(STATUS_IOERR, 0);
        }
        let len = u64::from(num) * SECTOR_SIZE;
        let Some(start) = sector.checked_mul(SECTOR_SIZE) else {
            return Start::Done(STATUS_IOERR, 0);
        };
        if start
            .checked_add(len)
            .is_none_or(|end| end > self.capacity())
        {
            return Start::Done(STATUS_IOERR, 0);
        }
        if op == IoOp::Discard {
            let block = u64::from(self.device.logical_block_size()).max(SECTOR_SIZE);
            if !start.is_multiple_of(block) || !len.is_multiple_of(block) {
                tracing::debug!("discard at sector {sector} (+{num}) not aligned to {block} bytes");
                return Start::Done(STATUS_IOERR, 0);
            }
        }
        if len == 0 {
            return Start::Done(STATUS_OK, 0);
        }
        Start::Io(Planned::new(op, start, len))
    }

    /// Writes the serial into the first data segments; returns the bytes written.
    fn get_id<M: GuestMemoryBackend>(&self, mem: &M, segments: &[Segment]) -> Option<u64> {
        let mut done = 0usize;
        for seg in segments {
            if done == ID_BYTES {
                break;
            }
            let n = (seg.len as usize).min(ID_BYTES - done);
            mem.write_slice(&self.serial[done..done + n], seg.addr)
                .ok()?;
            done += n;
        }
        Some(done as u64)
    }
}
