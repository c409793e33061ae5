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
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use vm_memory::GuestMemoryMmap;

    const NEXT: u16 = VRING_DESC_F_NEXT as u16;
    const WRITE: u16 = VRING_DESC_F_WRITE as u16;
    const CAP: u64 = 1 << 20;
    const SIZE_MAX: u32 = 4096;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    fn header(mem: &GuestMemoryMmap, at: u64, kind: u32, sector: u64) {
        let h = RawHeader {
            kind: kind.to_le(),
            ioprio: 0,
            sector: sector.to_le(),
        };
        mem.write_obj(h, GuestAddress(at)).unwrap();
    }

    fn d(addr: u64, len: u32, flags: u16) -> Descriptor {
        Descriptor::new(addr, len, flags, 0)
    }

    fn parse_descs(
        mem: &GuestMemoryMmap,
        descs: &[Descriptor],
    ) -> (Result<Request, Rejected>, Vec<Segment>) {
        let mut segs = Vec::new();
        let r = parse(mem, descs.iter().copied(), 8, SIZE_MAX, CAP, &mut segs);
        (r, segs)
    }

    #[test]
    fn read_request_with_two_segments() {
        let m = mem();
        header(&m, 0x100, VIRTIO_BLK_T_IN, 10);
        let (r, segs) = parse_descs(
            &m,
            &[
                d(0x100, 16, NEXT),
                d(0x1000, 512, NEXT | WRITE),
                d(0x2000, 1024, NEXT | WRITE),
                d(0x300, 1, WRITE),
            ],
        );
        let r = r.unwrap();
        assert_eq!(r.kind, RequestType::In);
        assert_eq!(r.sector, 10);
        assert_eq!(r.data_len, 1536);
        assert_eq!(r.status, GuestAddress(0x300));
        assert_eq!(segs.len(), 2);
        assert!(segs.iter().all(|s| s.device_writable));
    }

    #[test]
    fn rejections() {
        let m = mem();
        header(&m, 0x100, VIRTIO_BLK_T_OUT, 0);
        let status = Some(GuestAddress(0x300));
        let cases: Vec<(Vec<Descriptor>, Error, Option<GuestAddress>)> = vec![
            (vec![d(0x100, 16, 0)], Error::ChainTooShort(1), None),
            (
                vec![d(0x100, 16, NEXT), d(0x300, 1, 0)],
                Error::BadStatus,
                None,
            ),
            (
                vec![d(0x100, 16, NEXT), d(0x300, 2, WRITE)],
                Error::BadStatus,
                None,
            ),
            (
                vec![d(0x100, 16, NEXT), d(0x10_0000, 1, WRITE)],
                Error::BadStatus,
                None,
            ),
            (
                vec![d(0x100, 8, NEXT), d(0x300, 1, WRITE)],
                Error::BadHeader,
                status,
            ),
            (
                vec![d(0x100, 16, NEXT | WRITE), d(0x300, 1, WRITE)],
                Error::BadHeader,
                status,
            ),
            (
                vec![
                    d(0x100, 16, NEXT),
                    d(0x1000, 512, NEXT | WRITE),
                    d(0x300, 1, WRITE),
                ],
                Error::WrongDirection(RequestType::Out),
                status,
            ),
            (
                vec![d(0x100, 16, NEXT), d(0x1000, 100, NEXT), d(0x300, 1, WRITE)],
                Error::Misaligned(100),
                status,
            ),
            (
                vec![
                    d(0x100, 16, NEXT),
                    d(0xf_ff00, 512, NEXT),
                    d(0x300, 1, WRITE),
                ],
                Error::OutsideMemory(0xf_ff00, 512),
                status,
            ),
            (
                vec![
                    d(0x100, 16, NEXT),
                    d(0x1000, 4096 + 512, NEXT),
                    d(0x300, 1, WRITE),
                ],
                Error::SegmentTooLarge(4096 + 512, SIZE_MAX),
                status,
            ),
        ];
        for (descs, error, status) in cases {
            let (r, _) = parse_descs(&m, &descs);
            assert_eq!(r.unwrap_err(), Rejected { error, status }, "{descs:?}");
        }
        // Too many descriptors.
        let mut long = vec![d(0x100, 16, NEXT)];
        long.extend((0..8).map(|i| d(0x1000 + i * 512, 512, NEXT)));
        long.push(d(0x300, 1, WRITE));
        assert_eq!(
            parse_descs(&m, &long).0.unwrap_err().error,
            Error::ChainTooLong(8)
        );
    }

    /// Every data descriptor points at the same 1 MiB guest buffer: legal, and cheap for a
    /// guest, but the request may not carry more than `MAX_REQUEST_BYTES` in total.
    #[test]
    fn an_aliased_descriptor_table_is_capped_in_total() {
        const MIB: u32 = 1 << 20;
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        header(&m, 0x100, VIRTIO_BLK_T_OUT, 0);
        let aliased = |n: usize| {
            let mut descs = vec![d(0x100, 16, NEXT)];
            descs.extend((0..n).map(|_| d(0x10_0000, MIB, NEXT)));
            descs.push(d(0x300, 1, WRITE));
            descs
        };
        let mut segs = Vec::new();
        let mut run = |descs: Vec<Descriptor>| parse(&m, descs, 64, MIB, 1 << 40, &mut segs);
        let at_cap = run(aliased(4)).unwrap();
        assert_eq!(at_cap.data_len, MAX_REQUEST_BYTES);
        for n in [5, 14, 62] {
            assert_eq!(
                run(aliased(n)).unwrap_err(),
                Rejected {
                    error: Error::RequestTooLarge(MAX_REQUEST_BYTES),
                    status: Some(GuestAddress(0x300)),
                },
                "{n} aliased 1 MiB descriptors"
            );
        }
        // Reads too (the device would fill the same buffer n times).
        header(&m, 0x100, VIRTIO_BLK_T_IN, 0);
        let mut descs = vec![d(0x100, 16, NEXT)];
        descs.extend((0..5).map(|_| d(0x10_0000, MIB, NEXT | WRITE)));
        descs.push(d(0x300, 1, WRITE));
        assert_eq!(
            run(descs).unwrap_err().error,
            Error::RequestTooLarge(MAX_REQUEST_BYTES)
        );
    }

    #[test]
    fn advertised_limits_keep_a_request_within_the_cap() {
        for queue_size in [2u16, 3, 16, 128, 256, 1024, 1026, 4096, 32768] {
            let (seg_max, size_max) = advertised_limits(queue_size);
            assert!(seg_max >= 1 && size_max >= 4096, "{queue_size}");
            assert!(
                seg_max as usize + 2 <= usize::from(queue_size).max(3),
                "{queue_size}"
            );
            assert_eq!(size_max % 4096, 0);
            assert!(
                u64::from(seg_max) * u64::from(size_max) <= MAX_REQUEST_BYTES,
                "queue {queue_size}: {seg_max} x {size_max}"
            );
        }
        assert_eq!(advertised_limits(128), (126, 32 << 10));
        assert_eq!(advertised_limits(256), (254, 16 << 10));
        assert_eq!(advertised_limits(4096), (1024, 4 << 10));
    }

    #[test]
    fn capacity_and_types() {
        let m = mem();
        let last = CAP / SECTOR_SIZE - 1;
        header(&m, 0x100, VIRTIO_BLK_T_OUT, last);
        let ok = [d(0x100, 16, NEXT), d(0x1000, 512, NEXT), d(0x300, 1, WRITE)];
        assert!(parse_descs(&m, &ok).0.is_ok());
        let over = [
            d(0x100, 16, NEXT),
            d(0x1000, 1024, NEXT),
            d(0x300, 1, WRITE),
        ];
        assert!(matches!(
            parse_descs(&m, &over).0.unwrap_err().error,
            Error::BeyondCapacity { .. }
        ));
        header(&m, 0x100, VIRTIO_BLK_T_IN, u64::MAX);
        let huge = [
            d(0x100, 16, NEXT),
            d(0x1000, 512, NEXT | WRITE),
            d(0x300, 1, WRITE),
        ];
        assert!(matches!(
            parse_descs(&m, &huge).0.unwrap_err().error,
            Error::BeyondCapacity { .. }
        ));
        header(&m, 0x100, 0x99, 0);
        let r = parse_descs(&m, &[d(0x100, 16, NEXT), d(0x300, 1, WRITE)]).0;
        assert_eq!(r.unwrap_err().error, Error::Unsupported(0x99));
        header(&m, 0x100, VIRTIO_BLK_T_FLUSH, 0);
        let r = parse_descs(&m, &[d(0x100, 16, NEXT), d(0x300, 1, WRITE)]).0;
        assert_eq!(r.unwrap().kind, RequestType::Flush);
    }

    #[test]
    fn discard_carries_one_read_only_range() {
        let m = mem();
        header(&m, 0x100, VIRTIO_BLK_T_DISCARD, 0);
        let ok = [d(0x100, 16, NEXT), d(0x1000, 16, NEXT), d(0x300, 1, WRITE)];
        let (r, segs) = parse_descs(&m, &ok);
        assert_eq!(r.unwrap().kind, RequestType::Discard);
        assert_eq!(segs.len(), 1);
        let short = [d(0x100, 16, NEXT), d(0x300, 1, WRITE)];
        assert_eq!(
            parse_descs(&m, &short).0.unwrap_err().error,
            Error::BadDiscardRangeList(0)
        );
        let two = [
            d(0x100, 16, NEXT),
            d(0x1000, 16, NEXT),
            d(0x2000, 16, NEXT),
            d(0x300, 1, WRITE),
        ];
        assert_eq!(
            parse_descs(&m, &two).0.unwrap_err().error,
            Error::BadDiscardRangeList(32)
        );
        let writable = [
            d(0x100, 16, NEXT),
            d(0x1000, 16, NEXT | WRITE),
            d(0x300, 1, WRITE),
        ];
        assert_eq!(
            parse_descs(&m, &writable).0.unwrap_err().error,
            Error::WrongDirection(RequestType::Discard)
        );
    }
}
