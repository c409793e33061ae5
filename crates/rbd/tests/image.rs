//! The RBD client against a real single-node cluster: I/O, the exclusive lock naming its
//! owner, allocation map, snapshots read-only, create refusing an existing image.

mod support;

use cryptblk_block::{BlockDevice, BlockErrorKind, ExtentKind};
use cryptblk_rbd::{Image, OpenMode, RbdDevice, RbdError, RbdSpec};

#[test]
fn rbd_image_against_a_real_cluster() {
    let Some(cluster) = support::start() else {
        return;
    };
    let name = cluster.name("t1");
    let spec = RbdSpec::parse(&name).unwrap();

    Image::create(&spec, 64 << 20).unwrap();
    let again = Image::create(&spec, 64 << 20).unwrap_err();
    assert_eq!(again.errno(), Some(libc::EEXIST), "{again}");

    let image = Image::open(&spec, OpenMode::ReadWrite).unwrap();
    assert_eq!(image.size(), 64 << 20);
    assert!(image.allocated(0, image.size()).unwrap().is_empty());

    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
    image.write_at(&data, 1 << 20).unwrap();
    image.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    image.read_at(&mut back, 1 << 20).unwrap();
    assert_eq!(back, data);
    let runs = image.allocated(0, image.size()).unwrap();
    // The map is exact to the byte only where the object store keeps objects sparse (memstore
    // does not: the object reads as allocated from its start); it never misses written data.
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert!(runs[0].offset <= 1 << 20 && runs[0].offset + runs[0].len >= (1 << 20) + 8192);

    // The rbd CLI sees what we wrote.
    let export = cluster.dir().join("t1.raw");
    cluster.rbd(&["export", "rbd/t1", export.to_str().unwrap()]);
    let exported = std::fs::read(&export).unwrap();
    assert_eq!(&exported[1 << 20..(1 << 20) + 8192], &data[..]);

    // A second writer is refused with the owner named.
    match Image::open(&spec, OpenMode::ReadWrite) {
        Err(e @ RbdError::Locked { .. }) => {
            // librbd names the owner by its client address (IP:port/nonce).
            let message = e.to_string();
            assert!(message.contains("locked by 127.0.0.1:"), "{message}");
        }
        Err(e) => panic!("expected a lock error, got {e}"),
        Ok(_) => panic!("a second writer got the exclusive lock"),
    }
    drop(image);

    // Once the first writer closed, a snapshot opens read-only with the data.
    cluster.rbd(&["snap", "create", "rbd/t1@s1"]);
    let snap = Image::open(
        &RbdSpec::parse(&format!("rbd:rbd/t1@s1:conf={}", cluster.conf.display())).unwrap(),
        OpenMode::ReadWrite,
    )
    .unwrap();
    assert!(snap.read_only());
    snap.read_at(&mut back, 1 << 20).unwrap();
    assert_eq!(back, data);
    assert!(snap.write_at(&data, 0).is_err());

    // As a block device: holes and data from the allocation map, read-only snapshot.
    let device = RbdDevice::new(snap);
    let hole = device.block_status(2 << 20, 1 << 20).unwrap();
    assert_eq!((hole.kind, hole.len), (ExtentKind::Unallocated, 1 << 20));
    let written = device.block_status(1 << 20, 4096).unwrap();
    assert_eq!((written.kind, written.len), (ExtentKind::Data, 4096));
    let after = device.block_status(4 << 20, 60 << 20).unwrap();
    assert_eq!((after.kind, after.len), (ExtentKind::Unallocated, 60 << 20));
    let err = device.write_at(&data, 0).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::ReadOnly, "{err}");
    let err = device.read_at(&mut back, (64 << 20) - 4096).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::OutOfRange, "{err}");
    drop(device);

    // A writable device: what it writes and flushes survives closing and reopening.
    let device = RbdDevice::new(Image::open(&spec, OpenMode::ReadWrite).unwrap());
    device.write_at(&data, 8 << 20).unwrap();
    device.flush().unwrap();
    drop(device);
    let device = RbdDevice::new(Image::open(&spec, OpenMode::ReadOnly).unwrap());
    device.read_at(&mut back, 8 << 20).unwrap();
    assert_eq!(back, data);
    drop(device);

    let missing = Image::open(
        &RbdSpec::parse(&cluster.name("nope")).unwrap(),
        OpenMode::ReadOnly,
    )
    .unwrap_err();
    assert_eq!(missing.errno(), Some(libc::ENOENT), "{missing}");
}
