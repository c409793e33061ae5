//! The parser's tests: well-formed chains, every rejection, the aliased-descriptor cap.

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
