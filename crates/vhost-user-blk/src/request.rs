//! Parsing one virtio-blk request out of a descriptor chain.
//!
//! The guest is untrusted: every descriptor is checked (direction, length, that it lies inside
//! one guest memory region) before anything is read or written, and nothing outside the
//! descriptors is touched. This module knows nothing about vhost-user; it takes a descriptor
//! iterator and guest memory.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemory, GuestMemoryBackend};

/// Bytes in a virtio-blk sector (request offsets are always in these units).
pub const SECTOR_SIZE: u64 = 512;
/// Size of the request header the driver puts in the first descriptor.
pub const HEADER_SIZE: u32 = 16;

/// The most data bytes one request may carry, summed over its data descriptors: 4 MiB.
///
/// Descriptors may all point at the same guest buffer, so neither `seg_max` nor `size_max`
/// bounds what one request makes the daemon hold (a write's bounce buffer is as large as the
/// request): this does, whatever the guest sends. 4 MiB is what Linux guests send at most by
/// default (`max_sectors_kb` is capped at 4 MiB since 6.7, 1280 KiB before) and well above
/// where throughput stops growing with request size; a longer request is answered IOERR.
pub const MAX_REQUEST_BYTES: u64 = 4 << 20;

/// `seg_max` and `size_max` to advertise for a virtqueue of `queue_size` so that a guest that
/// follows them never builds a request above [`MAX_REQUEST_BYTES`]: as many segments as the
/// queue can chain (`queue_size - 2`, at most `MAX_REQUEST_BYTES / 4096`), each of the largest
/// 4 KiB multiple that keeps `seg_max * size_max` within the cap (never below a 4 KiB page,
/// the least a Linux guest accepts).
pub fn advertised_limits(queue_size: u16) -> (u32, u32) {
    const PAGE: u64 = 4096;
    let seg_max = u64::from(queue_size.saturating_sub(2)).clamp(1, MAX_REQUEST_BYTES / PAGE);
    let size_max = (MAX_REQUEST_BYTES / seg_max / PAGE * PAGE).max(PAGE);
    (seg_max as u32, size_max as u32)
}

/// The request header as the driver lays it out (little-endian on the wire).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
struct RawHeader {
    kind: u32,
    ioprio: u32,
    sector: u64,
}

// SAFETY: `RawHeader` is `repr(C)`, made only of integers, has no padding (4 + 4 + 8 bytes) and
// every bit pattern is a valid value.
unsafe impl ByteValued for RawHeader {}

/// Size of one DISCARD / WRITE_ZEROES range (`struct virtio_blk_discard_write_zeroes`).
pub const WRITE_ZEROES_RANGE_SIZE: u64 = 16;

/// One DISCARD / WRITE_ZEROES range as the driver lays it out (little-endian).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct WriteZeroesRange {
    pub sector: u64,
    pub num_sectors: u32,
    pub flags: u32,
}

// SAFETY: `repr(C)`, integers only, no padding (8 + 4 + 4 bytes), every bit pattern valid.
unsafe impl ByteValued for WriteZeroesRange {}

/// The only defined flag of a range: the device may deallocate the zeroed blocks.
pub const WRITE_ZEROES_FLAG_UNMAP: u32 = 1;

/// What the request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestType {
    In,
    Out,
    Flush,
    GetId,
    /// Zero a range: one 16-byte range descriptor in the data (see `WriteZeroesRange`).
    WriteZeroes,
    /// Discard a range: one 16-byte range descriptor in the data, like WRITE_ZEROES.
    Discard,
    /// A type this device does not implement; answered with UNSUPP.
    Unsupported(u32),
}

impl RequestType {
    /// For log lines.
    pub fn name(self) -> &'static str {
        match self {
            RequestType::In => "read",
            RequestType::Out => "write",
            RequestType::Flush => "flush",
            RequestType::GetId => "get-id",
            RequestType::WriteZeroes => "write-zeroes",
            RequestType::Discard => "discard",
            RequestType::Unsupported(_) => "unsupported request",
        }
    }

    fn from_raw(kind: u32) -> Self {
        match kind {
            VIRTIO_BLK_T_IN => RequestType::In,
            VIRTIO_BLK_T_OUT => RequestType::Out,
            VIRTIO_BLK_T_FLUSH => RequestType::Flush,
            VIRTIO_BLK_T_GET_ID => RequestType::GetId,
            VIRTIO_BLK_T_WRITE_ZEROES => RequestType::WriteZeroes,
            VIRTIO_BLK_T_DISCARD => RequestType::Discard,
            other => RequestType::Unsupported(other),
        }
    }
}

/// One data buffer of a request, already checked to lie inside one guest memory region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub addr: GuestAddress,
    pub len: u32,
    /// The descriptor is device-writable (the device fills it: IN, GET_ID).
    pub device_writable: bool,
}

/// A validated request. The data segments live in the caller's buffer (reused per queue).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub kind: RequestType,
    /// First sector (512-byte units) for IN/OUT.
    pub sector: u64,
    /// Sum of the data segment lengths.
    pub data_len: u64,
    /// Where the one status byte goes.
    pub status: GuestAddress,
}

/// Why a chain was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("descriptor chain has {0} descriptors; at least header and status are needed")]
    ChainTooShort(usize),
    #[error("descriptor chain longer than {0} descriptors")]
    ChainTooLong(usize),
    #[error("request header descriptor is write-only or shorter than 16 bytes")]
    BadHeader,
    #[error("status descriptor is not a writable 1-byte buffer")]
    BadStatus,
    #[error("data descriptor has the wrong direction for request type {0:?}")]
    WrongDirection(RequestType),
    #[error("descriptor at {0:#x} (+{1}) is not inside guest memory")]
    OutsideMemory(u64, u32),
    #[error("data descriptor of {0} bytes is longer than size_max ({1})")]
    SegmentTooLarge(u32, u32),
    #[error("request data of more than {0} bytes (the most one request may carry)")]
    RequestTooLarge(u64),
    #[error("data length {0} is not a multiple of 512")]
    Misaligned(u64),
    #[error("request at sector {sector} ({len} bytes) is beyond the capacity ({capacity} bytes)")]
    BeyondCapacity {
        sector: u64,
        len: u64,
        capacity: u64,
    },
    #[error("write-zeroes data is {0} bytes, not one 16-byte range in one descriptor")]
    BadRangeList(u64),
    /// Like `BadRangeList`, for a DISCARD (UNSUPP rather than IOERR when discard is off).
    #[error("discard data is {0} bytes, not one 16-byte range in one descriptor")]
    BadDiscardRangeList(u64),
    #[error("unsupported request type {0}")]
    Unsupported(u32),
}

/// A rejected request and, when its status descriptor is usable, where to report the error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub error: Error,
    pub status: Option<GuestAddress>,
}

/// Parses the descriptors of one chain into a request, collecting its data segments into
/// `segments` (cleared first; its capacity is reused). `max_descriptors` bounds the chain
/// (SEG_MAX + 2); `size_max` bounds each data descriptor (SIZE_MAX); `capacity` is the disk
/// size in bytes.
pub fn parse<M, I>(
    mem: &M,
    descriptors: I,
    max_descriptors: usize,
    size_max: u32,
    capacity: u64,
    segments: &mut Vec<Segment>,
) -> Result<Request, Rejected>
where
    M: GuestMemoryBackend + GuestMemory,
    I: IntoIterator<Item = Descriptor>,
{
    segments.clear();
    let mut header: Option<Descriptor> = None;
    let mut last: Option<Descriptor> = None;
    let mut count = 0usize;
    // Collect everything between the header and the last descriptor as data; the last one is
    // only known to be the status descriptor when the chain ends.
    for desc in descriptors {
        count += 1;
        if count > max_descriptors {
            return Err(Rejected {
                error: Error::ChainTooLong(max_descriptors),
                status: None,
            });
        }
        if header.is_none() {
            header = Some(desc);
            continue;
        }
        if let Some(prev) = last.replace(desc) {
            segments.push(Segment {
                addr: prev.addr(),
                len: prev.len(),
                device_writable: prev.is_write_only(),
            });
        }
    }
    let (header, status) = match (header, last) {
        (Some(h), Some(s)) => (h, s),
        _ => {
            return Err(Rejected {
                error: Error::ChainTooShort(count),
                status: None,
            })
        }
    };

    // Status: the last descriptor, device-writable, exactly one byte, inside memory.
    if !status.is_write_only() || status.len() != 1 || !in_memory(mem, status.addr(), 1) {
        return Err(Rejected {
            error: Error::BadStatus,
            status: None,
        });
    }
    let status_addr = status.addr();
    let reject = |error| Rejected {
        error,
        status: Some(status_addr),
    };

    if header.is_write_only() || header.len() < HEADER_SIZE {
        return Err(reject(Error::BadHeader));
    }
    let raw: RawHeader = mem
        .read_obj(header.addr())
        .map_err(|_| reject(Error::OutsideMemory(header.addr().0, header.len())))?;
    let kind = RequestType::from_raw(u32::from_le(raw.kind));
    let sector = u64::from_le(raw.sector);
    if let RequestType::Unsupported(t) = kind {
        return Err(reject(Error::Unsupported(t)));
    }
    let req = Request {
        kind,
        sector,
        data_len: 0,
        status: status_addr,
    };
    check_data(mem, req, segments, size_max, capacity).map_err(reject)
}

/// Checks the data segments: direction, size_max, memory bounds, the request's total against
/// [`MAX_REQUEST_BYTES`], alignment, capacity.
fn check_data<M>(
    mem: &M,
    mut req: Request,
    segments: &[Segment],
    size_max: u32,
    capacity: u64,
) -> Result<Request, Error>
where
    M: GuestMemoryBackend,
{
    let want_writable = match req.kind {
        RequestType::In | RequestType::GetId => Some(true),
        RequestType::Out | RequestType::WriteZeroes | RequestType::Discard => Some(false),
        RequestType::Flush | RequestType::Unsupported(_) => None,
    };
    let mut total = 0u64;
    for seg in segments {
        if want_writable.is_some_and(|w| w != seg.device_writable) {
            return Err(Error::WrongDirection(req.kind));
        }
        if seg.len > size_max {
            return Err(Error::SegmentTooLarge(seg.len, size_max));
        }
        if !in_memory(mem, seg.addr, seg.len) {
            return Err(Error::OutsideMemory(seg.addr.0, seg.len));
        }
        total += u64::from(seg.len);
        // Aliased descriptors make any total cheap for the guest; stop at the cap.
        if total > MAX_REQUEST_BYTES {
            return Err(Error::RequestTooLarge(MAX_REQUEST_BYTES));
        }
    }
    req.data_len = total;
    match req.kind {
        RequestType::In | RequestType::Out => {
            if !total.is_multiple_of(SECTOR_SIZE) {
                return Err(Error::Misaligned(total));
            }
            let end = req
                .sector
                .checked_mul(SECTOR_SIZE)
                .and_then(|start| start.checked_add(total));
            match end {
                Some(end) if end <= capacity => {}
                _ => {
                    return Err(Error::BeyondCapacity {
                        sector: req.sector,
                        len: total,
                        capacity,
                    })
                }
            }
        }
        RequestType::WriteZeroes | RequestType::Discard => {
            // One range per request (max_write_zeroes_seg = max_discard_seg = 1), in one
            // descriptor.
            if segments.len() != 1 || total != WRITE_ZEROES_RANGE_SIZE {
                if req.kind == RequestType::Discard {
                    return Err(Error::BadDiscardRangeList(total));
                }
                return Err(Error::BadRangeList(total));
            }
        }
        RequestType::Flush | RequestType::GetId | RequestType::Unsupported(_) => {}
    }
    Ok(req)
}

/// True when `[addr, addr + len)` lies inside one guest memory region (so it can be accessed
/// as one contiguous host slice).
fn in_memory<M: GuestMemoryBackend>(mem: &M, addr: GuestAddress, len: u32) -> bool {
    len == 0 || mem.get_slice(addr, len as usize).is_ok()
}

#[cfg(test)]
mod tests;
