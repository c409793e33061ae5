mod common;

use cryptblk_block::{BlockDevice, BlockErrorKind, ExtentKind, OpenOptions, RawFile};
use rand::{Rng, SeedableRng};

const RW: OpenOptions = OpenOptions {
    writable: true,
    lock: true,
};

#[test]
fn read_write_round_trip_and_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.raw");
    let dev = RawFile::create(&p, 1 << 20).unwrap();
    assert_eq!(dev.size(), 1 << 20);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let data: Vec<u8> = (0..10_000).map(|_| rng.gen()).collect();
    dev.write_at(&data, 12345).unwrap();
    dev.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    dev.read_at(&mut back, 12345).unwrap();
    assert_eq!(back, data);

    let err = dev.read_at(&mut [0u8; 2], (1 << 20) - 1).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::OutOfRange);
    assert!(err.to_string().contains("a.raw"), "{err}");
    let err = dev.write_at(&[0u8; 1], 1 << 20).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::OutOfRange);
    let err = dev.read_at(&mut [0u8; 1], u64::MAX).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::OutOfRange);
    // The file never grows.
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20);
    drop(dev);

    let ro = RawFile::open(&p, OpenOptions::default()).unwrap();
    assert!(ro.read_only());
    assert_eq!(
        ro.write_at(&[1], 0).unwrap_err().kind(),
        BlockErrorKind::ReadOnly
    );
    let mut back = vec![0u8; data.len()];
    ro.read_at(&mut back, 12345).unwrap();
    assert_eq!(back, data);
}

#[test]
fn holes_are_reported_and_punched() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("sparse.raw");
    let mib = 1u64 << 20;
    let dev = RawFile::create(&p, 8 * mib).unwrap();
    dev.write_at(&vec![0xabu8; mib as usize], 2 * mib).unwrap();
    dev.write_at(&vec![0xcdu8; mib as usize], 6 * mib).unwrap();

    let st = dev.block_status(0, 8 * mib).unwrap();
    assert_eq!(st.kind, ExtentKind::Unallocated);
    assert_eq!(st.len, 2 * mib);
    let st = dev.block_status(2 * mib, 8 * mib).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Data, mib));
    let st = dev.block_status(3 * mib, 8 * mib).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Unallocated, 3 * mib));
    // Clipped to the request and to the device.
    let st = dev.block_status(6 * mib, 4096).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Data, 4096));
    let st = dev.block_status(7 * mib, u64::MAX).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Unallocated, mib));
    assert_eq!(
        dev.block_status(9 * mib, 1).unwrap_err().kind(),
        BlockErrorKind::OutOfRange
    );

    dev.punch_hole(2 * mib, mib).unwrap();
    let st = dev.block_status(0, 8 * mib).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Unallocated, 6 * mib));
    let mut back = vec![1u8; 4096];
    dev.read_at(&mut back, 2 * mib).unwrap();
    assert!(back.iter().all(|&b| b == 0));
    assert_eq!(dev.size(), 8 * mib);
}

#[test]
fn second_writer_is_refused_with_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("locked.raw");
    let first = RawFile::create(&p, 4096).unwrap();
    let err = RawFile::open(&p, RW).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::Locked);
    let msg = err.to_string();
    assert!(
        msg.contains("in use by another process") && msg.contains("locked.raw"),
        "{msg}"
    );
    // A reader cannot share with a writer either.
    assert_eq!(
        RawFile::open(&p, OpenOptions::default())
            .unwrap_err()
            .kind(),
        BlockErrorKind::Locked
    );
    drop(first);

    // Readers share; a writer is refused while they hold the image.
    let r1 = RawFile::open(&p, OpenOptions::default()).unwrap();
    let r2 = RawFile::open(&p, OpenOptions::default()).unwrap();
    assert_eq!(
        RawFile::open(&p, RW).unwrap_err().kind(),
        BlockErrorKind::Locked
    );
    drop((r1, r2));
    RawFile::open(&p, RW).unwrap();
    // Opting out of locking always works.
    let _w = RawFile::open(&p, RW).unwrap();
    RawFile::open(
        &p,
        OpenOptions {
            writable: true,
            lock: false,
        },
    )
    .unwrap();
}

#[test]
fn create_refuses_existing_and_open_reports_missing() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.raw");
    std::fs::write(&p, b"hello").unwrap();
    assert_eq!(
        RawFile::create(&p, 10).unwrap_err().kind(),
        BlockErrorKind::Io
    );
    let err = RawFile::open(dir.path().join("missing.raw"), OpenOptions::default()).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::Io);
    assert!(err.to_string().contains("missing.raw"), "{err}");
}

#[test]
fn error_messages_read_as_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.raw");
    let dev = RawFile::create(&p, 4096).unwrap();
    let locked = RawFile::open(&p, RW).unwrap_err().to_string();
    let range = dev.read_at(&mut [0u8; 8], 4092).unwrap_err().to_string();
    let ro = RawFile::open(
        &p,
        OpenOptions {
            writable: false,
            lock: false,
        },
    )
    .unwrap()
    .write_at(&[0], 0)
    .unwrap_err()
    .to_string();
    let expect_locked = format!(
        "{}: locked: image is in use by another process (could not get an exclusive lock for writing)",
        p.display()
    );
    assert_eq!(locked, expect_locked);
    assert_eq!(
        range,
        format!(
            "{}: out of range during read at offset 4092: 8 bytes at offset 4092 extend beyond the device size of 4096 bytes",
            p.display()
        )
    );
    assert_eq!(
        ro,
        format!(
            "{}: read-only during write at offset 0: device is read-only",
            p.display()
        )
    );
}

#[test]
fn direct_writes_land_and_mix_with_buffered_ones() {
    use cryptblk_block::AlignedBuf;
    // Under the build directory, not /tmp: some CI machines mount /tmp as tmpfs, which may
    // refuse O_DIRECT, and this test wants a filesystem that accepts it where it can.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let p = dir.path().join("direct.raw");
    let mut dev = RawFile::create(&p, 1 << 20).unwrap();
    let direct = dev.enable_direct_writes().unwrap();
    let mut aligned = AlignedBuf::zeroed(64 * 1024);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    rng.fill(&mut aligned[..]);
    let odd: Vec<u8> = (0..1000).map(|_| rng.gen()).collect();
    // Aligned (direct when enabled), unaligned offset, unaligned buffer: all must land.
    dev.write_at(&aligned, 4096 * 8).unwrap();
    dev.write_at(&odd, 777).unwrap();
    dev.write_at(&aligned[512..4608], 4096 * 40).unwrap();
    dev.flush().unwrap();
    let back = std::fs::read(&p).unwrap();
    assert_eq!(&back[4096 * 8..4096 * 8 + aligned.len()], &aligned[..]);
    assert_eq!(&back[777..1777], &odd[..]);
    assert_eq!(&back[4096 * 40..4096 * 41], &aligned[512..4608]);
    // Reads are buffered and must see the direct writes.
    let mut r = vec![0u8; aligned.len()];
    dev.read_at(&mut r, 4096 * 8).unwrap();
    assert_eq!(&r[..], &aligned[..], "direct={direct}");
}

#[test]
fn direct_writes_need_a_writable_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("ro.raw");
    drop(RawFile::create(&p, 4096).unwrap());
    let mut ro = RawFile::open(
        &p,
        OpenOptions {
            writable: false,
            lock: true,
        },
    )
    .unwrap();
    assert_eq!(
        ro.enable_direct_writes().unwrap_err().kind(),
        BlockErrorKind::ReadOnly
    );
}

#[test]
fn discard_punches_a_hole_that_reads_as_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("discard.raw");
    let mib = 1u64 << 20;
    let dev = RawFile::create(&p, 4 * mib).unwrap();
    dev.write_at(&vec![0x5au8; (4 * mib) as usize], 0).unwrap();
    assert_eq!(dev.block_status(0, 4 * mib).unwrap().kind, ExtentKind::Data);

    let dyn_dev: &dyn BlockDevice = &dev;
    dyn_dev.discard(mib, 2 * mib).unwrap();
    let st = dev.block_status(mib, 4 * mib).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Unallocated, 2 * mib));
    let st = dev.block_status(0, 4 * mib).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Data, mib));
    let mut back = vec![1u8; (4 * mib) as usize];
    dev.read_at(&mut back, 0).unwrap();
    assert!(back[..mib as usize].iter().all(|&b| b == 0x5a));
    assert!(back[mib as usize..3 * mib as usize].iter().all(|&b| b == 0));
    assert!(back[3 * mib as usize..].iter().all(|&b| b == 0x5a));
    assert_eq!(dev.size(), 4 * mib);

    assert_eq!(
        dyn_dev.discard(3 * mib, 2 * mib).unwrap_err().kind(),
        BlockErrorKind::OutOfRange
    );
    assert_eq!(
        dyn_dev.discard(u64::MAX, 1).unwrap_err().kind(),
        BlockErrorKind::OutOfRange
    );
    drop(dev);

    let ro = RawFile::open(&p, OpenOptions::default()).unwrap();
    assert_eq!(
        ro.discard(0, 4096).unwrap_err().kind(),
        BlockErrorKind::ReadOnly
    );
}
