//! Executing a parsed virtio-blk request against a `BlockDevice`.
//!
//! Reads land directly in the guest's buffers; writes are handed to the device straight from
//! guest memory (an encrypting device encrypts from there into its own bounce buffer, never in
//! place in guest memory). Knows nothing about vhost-user.
//!
//! Every guest byte written is marked in the memory's dirty bitmap (live migration): the
//! status byte and GET_ID through vm-memory's `Bytes` (which marks), read data explicitly.

use std::sync::Arc;

use cryptblk_block::BlockDevice;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
};
use vm_memory::bitmap::Bitmap;
use vm_memory::{Bytes, GuestMemoryBackend};

use crate::request::{
    Error as ParseError, Rejected, Request, RequestType, Segment, WriteZeroesRange, SECTOR_SIZE,
    WRITE_ZEROES_FLAG_UNMAP,
};

/// Largest WRITE_ZEROES range accepted, in sectors (advertised as max_write_zeroes_sectors).
pub const MAX_WRITE_ZEROES_SECTORS: u32 = 64 * 1024;
/// Largest DISCARD range accepted, in sectors (advertised as max_discard_sectors); a multiple
/// of every logical block size (up to 4096 bytes).
pub const MAX_DISCARD_SECTORS: u32 = MAX_WRITE_ZEROES_SECTORS;
/// Zeroes written per `write_at` call of a WRITE_ZEROES request (static: no allocation).
static ZEROES: [u8; 256 * 1024] = [0; 256 * 1024];

/// Status byte values.
pub const STATUS_OK: u8 = VIRTIO_BLK_S_OK as u8;
pub const STATUS_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
pub const STATUS_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;
/// Length of the GET_ID serial.
pub const ID_BYTES: usize = VIRTIO_BLK_ID_BYTES as usize;

/// The disk as the request executor sees it.
pub struct Disk {
    device: Arc<dyn BlockDevice>,
    read_only: bool,
    /// DISCARD is offered and executed (only on a writable disk).
    discard: bool,
    serial: [u8; ID_BYTES],
}

impl Disk {
    /// `serial` is cut to 20 bytes (zero-padded when shorter), as GET_ID returns it.
    pub fn new(device: Arc<dyn BlockDevice>, read_only: bool, serial: &str) -> Self {
        let mut id = [0u8; ID_BYTES];
        let n = serial.len().min(ID_BYTES);
        id[..n].copy_from_slice(&serial.as_bytes()[..n]);
        Disk {
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

    /// Runs one request and writes its status byte. Returns the number of bytes written into
    /// the guest's buffers (data + status), for the used ring.
    pub fn execute<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        req: &Request,
        segments: &[Segment],
    ) -> u32 {
        self.execute_with_status(mem, req, segments).1
    }

    /// Like `execute`, also returning the status byte written.
    pub fn execute_with_status<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        req: &Request,
        segments: &[Segment],
    ) -> (u8, u32) {
        let (status, data_written) = match req.kind {
            RequestType::In => match self.read(mem, req, segments) {
                Ok(()) => (STATUS_OK, req.data_len),
                Err(e) => {
                    tracing::debug!("read at sector {}: {e}", req.sector);
                    (STATUS_IOERR, 0)
                }
            },
            RequestType::Out => match self.write(mem, req, segments) {
                Ok(()) => (STATUS_OK, 0),
                Err(e) => {
                    tracing::debug!("write at sector {}: {e}", req.sector);
                    (STATUS_IOERR, 0)
                }
            },
            RequestType::Flush => match self.device.flush() {
                Ok(()) => (STATUS_OK, 0),
                Err(e) => {
                    tracing::warn!("flush: {e}");
                    (STATUS_IOERR, 0)
                }
            },
            RequestType::GetId => match self.get_id(mem, segments) {
                Some(n) => (STATUS_OK, n),
                None => (STATUS_IOERR, 0),
            },
            RequestType::WriteZeroes => (self.write_zeroes(mem, segments), 0),
            RequestType::Discard => (self.discard_range(mem, segments), 0),
            RequestType::Unsupported(_) => (STATUS_UNSUPP, 0),
        };
        if mem.write_obj(status, req.status).is_err() {
            // The parser checked the status byte lies in guest memory; a memory table change
            // in between is the only way here. Report nothing written.
            return (STATUS_IOERR, 0);
        }
        (status, u32::try_from(data_written + 1).unwrap_or(u32::MAX))
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

    fn read<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        req: &Request,
        segments: &[Segment],
    ) -> Result<(), String> {
        let mut offset = req.sector * SECTOR_SIZE;
        for seg in segments {
            let len = seg.len as usize;
            let slice = mem.get_slice(seg.addr, len).map_err(|e| e.to_string())?;
            let guard = slice.ptr_guard_mut();
            // SAFETY: `get_slice` checked that `len` bytes at this address lie inside one
            // mapped guest memory region, which stays mapped while `mem` (a snapshot of the
            // memory table) is alive. The guest may touch the buffer concurrently, as with any
            // DMA; the bytes written are plain data and this slice does not outlive the call.
            let buf = unsafe { std::slice::from_raw_parts_mut(guard.as_ptr(), len) };
            let result = self.device.read_at(buf, offset);
            // Writing through the raw pointer bypasses vm-memory's dirty tracking: mark the
            // pages for live migration (one call per segment; a no-op without a dirty log).
            // Also on error, as the device may have written part of the buffer.
            slice.bitmap().mark_dirty(0, len);
            result.map_err(|e| e.to_string())?;
            offset += u64::from(seg.len);
        }
        Ok(())
    }

    fn write<M: GuestMemoryBackend>(
        &self,
        mem: &M,
        req: &Request,
        segments: &[Segment],
    ) -> Result<(), String> {
        if self.read_only {
            return Err("write to a read-only disk".into());
        }
        let mut offset = req.sector * SECTOR_SIZE;
        for seg in segments {
            let len = seg.len as usize;
            let slice = mem.get_slice(seg.addr, len).map_err(|e| e.to_string())?;
            let guard = slice.ptr_guard();
            // SAFETY: as in `read`: the range lies inside one mapped region kept alive by
            // `mem`. The device only reads it (an encrypting device reads it once, encrypting
            // into its own bounce buffer), so a concurrent guest write can only change the data
            // written, never memory safety of this process.
            let buf = unsafe { std::slice::from_raw_parts(guard.as_ptr(), len) };
            self.device
                .write_at(buf, offset)
                .map_err(|e| e.to_string())?;
            offset += u64::from(seg.len);
        }
        Ok(())
    }

    /// Writes zeroes over the one range the request carries (encrypted zeroes on a LUKS
    /// volume, so the range reads back as zeroes). Returns the status byte.
    fn write_zeroes<M: GuestMemoryBackend>(&self, mem: &M, segments: &[Segment]) -> u8 {
        let Some(seg) = segments.first() else {
            return STATUS_IOERR;
        };
        let Ok(range) = mem.read_obj::<WriteZeroesRange>(seg.addr) else {
            return STATUS_IOERR;
        };
        let (sector, num, flags) = (
            u64::from_le(range.sector),
            u32::from_le(range.num_sectors),
            u32::from_le(range.flags),
        );
        if flags & !WRITE_ZEROES_FLAG_UNMAP != 0 {
            return STATUS_UNSUPP;
        }
        if self.read_only || num > MAX_WRITE_ZEROES_SECTORS {
            return STATUS_IOERR;
        }
        let len = u64::from(num) * SECTOR_SIZE;
        let Some(start) = sector.checked_mul(SECTOR_SIZE) else {
            return STATUS_IOERR;
        };
        if start
            .checked_add(len)
            .is_none_or(|end| end > self.capacity())
        {
            return STATUS_IOERR;
        }
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(ZEROES.len() as u64) as usize;
            if let Err(e) = self.device.write_at(&ZEROES[..n], start + done) {
                tracing::debug!("write zeroes at sector {sector}: {e}");
                return STATUS_IOERR;
            }
            done += n as u64;
        }
        STATUS_OK
    }

    /// Discards the one range the request carries. Start and length must be multiples of
    /// the logical block size (advertised as discard_sector_alignment); anything else, a
    /// range beyond the capacity or larger than max_discard_sectors is an I/O error. Returns
    /// the status byte; UNSUPP when discard is not enabled.
    fn discard_range<M: GuestMemoryBackend>(&self, mem: &M, segments: &[Segment]) -> u8 {
        if !self.discard {
            return STATUS_UNSUPP;
        }
        let Some(seg) = segments.first() else {
            return STATUS_IOERR;
        };
        let Ok(range) = mem.read_obj::<WriteZeroesRange>(seg.addr) else {
            return STATUS_IOERR;
        };
        let (sector, num, flags) = (
            u64::from_le(range.sector),
            u32::from_le(range.num_sectors),
            u32::from_le(range.flags),
        );
        // The spec defines no flag for discard (UNMAP is only for write zeroes).
        if flags != 0 {
            return STATUS_UNSUPP;
        }
        if num > MAX_DISCARD_SECTORS {
            return STATUS_IOERR;
        }
        let len = u64::from(num) * SECTOR_SIZE;
        let Some(start) = sector.checked_mul(SECTOR_SIZE) else {
            return STATUS_IOERR;
        };
        if start
            .checked_add(len)
            .is_none_or(|end| end > self.capacity())
        {
            return STATUS_IOERR;
        }
        let block = u64::from(self.device.logical_block_size()).max(SECTOR_SIZE);
        if !start.is_multiple_of(block) || !len.is_multiple_of(block) {
            tracing::debug!("discard at sector {sector} (+{num}) not aligned to {block} bytes");
            return STATUS_IOERR;
        }
        if len == 0 {
            return STATUS_OK;
        }
        match self.device.discard(start, len) {
            Ok(()) => STATUS_OK,
            Err(e) => {
                tracing::debug!("discard at sector {sector}: {e}");
                STATUS_IOERR
            }
        }
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
