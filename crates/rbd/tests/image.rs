//! The RBD client against a real single-node cluster: I/O, the exclusive lock naming its
//! owner, allocation map, snapshots read-only, create refusing an existing image.

use cryptblk_testutil::ceph as support;

use cryptblk_block::aio::{Completion, IoBuffers, IoOp, IoRequest, OwnedBuffer, QueueOptions};

use cryptblk_block::open_queue;
use cryptblk_block::{BlockDevice, BlockErrorKind, ExtentKind};
use cryptblk_rbd::{Image, OpenMode, RbdDevice, RbdError, RbdSpec};
use std::sync::Arc;

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

    asynchronous_queue(&spec);
    teardown_under_in_flight_io(&spec);

    let missing = Image::open(
        &RbdSpec::parse(&cluster.name("nope")).unwrap(),
        OpenMode::ReadOnly,
    )
    .unwrap_err();
    assert_eq!(missing.errno(), Some(libc::ENOENT), "{missing}");
}

/// Runs `reqs` through `queue` with all of them in flight at once and returns their results by
/// tag.
fn run_all(
    queue: &mut dyn cryptblk_block::aio::IoQueue,
    reqs: &[IoRequest<'_>],
) -> Vec<Result<(), cryptblk_block::BlockError>> {
    for req in reqs {
        queue.push(req).unwrap();
    }
    queue.submit().unwrap();
    let mut results: Vec<Option<_>> = (0..reqs.len()).map(|_| None).collect();
    let mut left = reqs.len();
    while left > 0 {
        queue.wait();
        queue.drain(&mut |c: Completion| {
            assert!(
                results[c.tag as usize].is_none(),
                "tag {} completed twice",
                c.tag
            );
            results[c.tag as usize] = Some(c.result);
            left -= 1;
        });
    }
    results.into_iter().map(Option::unwrap).collect()
}

/// librbd's asynchronous calls behind the block crate's queue interface: 64 writes of
/// scatter-gather buffers in flight at once (every 8th with FUA), a write-zeroes, reads of it
/// all back at the same depth, refusals at push, and the data still there after reopening.
fn asynchronous_queue(spec: &RbdSpec) {
    const N: usize = 64;
    const BLOCK: usize = 16 << 10;
    let device: Arc<dyn BlockDevice> = Arc::new(RbdDevice::new(
        Image::open(spec, OpenMode::ReadWrite).unwrap(),
    ));
    let mut queue = open_queue(&device, &QueueOptions { depth: N }).unwrap();
    assert_eq!(queue.capacity(), N);
    let offset = |i: usize| (16 << 20) + (i as u64) * 3 * BLOCK as u64;
    let data: Vec<Vec<u8>> = (0..N)
        .map(|i| (0..BLOCK).map(|b| (b * 31 + i * 7) as u8).collect())
        .collect();
    // Two pieces per request, so the scatter-gather list is used.
    let iovs: Vec<IoBuffers> = data
        .iter()
        .map(|d| {
            let mut buffers = IoBuffers::new();
            buffers.set_owner(Arc::new(OwnedBuffer::from_bytes(d)));
            buffers.add(0, 4096).unwrap();
            buffers.add(4096, BLOCK - 4096).unwrap();
            buffers
        })
        .collect();
    let writes: Vec<IoRequest> = iovs
        .iter()
        .enumerate()
        .map(|(i, iov)| IoRequest::write(offset(i), iov, i % 8 == 0, i as u64))
        .collect();
    for r in run_all(&mut *queue, &writes) {
        r.unwrap();
    }
    let zeroed = 5;
    let zero = [IoRequest::range(
        IoOp::WriteZeroes,
        offset(zeroed),
        BLOCK as u64,
        0,
    )];
    run_all(&mut *queue, &zero)[0].as_ref().unwrap();

    let mut back: Vec<Arc<OwnedBuffer>> = (0..N)
        .map(|_| Arc::new(OwnedBuffer::from_bytes(&[0xee; BLOCK])))
        .collect();
    let mut read_iovs: Vec<IoBuffers> = back
        .iter()
        .map(|b| IoBuffers::whole(b.clone(), BLOCK).unwrap())
        .collect();
    let reads: Vec<IoRequest> = read_iovs
        .iter()
        .enumerate()
        .map(|(i, iov)| IoRequest::read(offset(i), iov, i as u64))
        .collect();
    for r in run_all(&mut *queue, &reads) {
        r.unwrap();
    }
    drop(reads);
    read_iovs.iter_mut().for_each(IoBuffers::clear);
    for (i, b) in back.iter_mut().enumerate() {
        let b = Arc::get_mut(b).unwrap().bytes_mut();
        if i == zeroed {
            assert!(b.iter().all(|&x| x == 0), "write-zeroes left data");
        } else {
            assert!(*b == data[i][..], "block {i} read back differently");
        }
    }

    // Refused at push, completed with the error; the queue keeps working.
    let iov = IoBuffers::whole(Arc::new(OwnedBuffer::zeroed(4096)), 4096).unwrap();
    let bad = [
        IoRequest::read(device.size() - 2048, &iov, 0),
        IoRequest::flush(1),
    ];
    let results = run_all(&mut *queue, &bad);
    assert_eq!(
        results[0].as_ref().unwrap_err().kind(),
        BlockErrorKind::OutOfRange
    );
    results[1].as_ref().unwrap();
    assert_eq!(queue.in_flight(), 0);
    drop(queue);
    drop(device);

    let reopened = Image::open(spec, OpenMode::ReadOnly).unwrap();
    let mut check = vec![0u8; BLOCK];
    reopened.read_at(&mut check, offset(N - 1)).unwrap();
    assert_eq!(check, data[N - 1]);
    let device: Arc<dyn BlockDevice> = Arc::new(RbdDevice::new(reopened));
    let mut queue = open_queue(&device, &QueueOptions::default()).unwrap();
    let iov = IoBuffers::whole(Arc::new(OwnedBuffer::from_bytes(&check)), BLOCK).unwrap();
    let write = [IoRequest::write(0, &iov, false, 0)];
    let err = run_all(&mut *queue, &write).remove(0).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::ReadOnly, "{err}");
}

/// Drops a queue with every slot in flight, 300 times. librbd's callbacks finish on their own
/// threads while the queue is being dropped; none may use the queue's state or eventfd after
/// the owner let go of it. An eventfd made right after each drop takes the lowest free fd
/// number, which is the dropped queue's if nothing else took it: a callback notifying through
/// a freed queue would bump that counter.
fn teardown_under_in_flight_io(spec: &RbdSpec) {
    const DEPTH: usize = 32;
    const ROUNDS: usize = 300;
    let device: Arc<dyn BlockDevice> = Arc::new(RbdDevice::new(
        Image::open(spec, OpenMode::ReadWrite).unwrap(),
    ));
    let bufs: Vec<IoBuffers> = (0..DEPTH)
        .map(|_| IoBuffers::whole(Arc::new(OwnedBuffer::zeroed(4096)), 4096).unwrap())
        .collect();
    let mut stray_notifications = 0;
    for round in 0..ROUNDS {
        let mut queue = open_queue(&device, &QueueOptions { depth: DEPTH }).unwrap();
        for (i, iov) in bufs.iter().enumerate() {
            let offset = ((round * DEPTH + i) % 1024) as u64 * 4096;
            let req = match i % 4 {
                0 => IoRequest::write(offset, iov, i % 8 == 0, i as u64),
                1 => IoRequest::flush(i as u64),
                _ => IoRequest::read(offset, iov, i as u64),
            };
            queue.push(&req).unwrap();
        }
        queue.submit().unwrap();
        // Let some finish, so the drop races callbacks that are under way.
        if round % 2 == 1 {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        drop(queue);
        // SAFETY: eventfd(2) with valid flags; the fd is closed below.
        let canary = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        assert!(canary >= 0);
        std::thread::sleep(std::time::Duration::from_millis(2));
        let mut count = 0u64;
        // SAFETY: reads 8 bytes into a u64 from the eventfd made above.
        let n = unsafe { libc::read(canary, (&mut count as *mut u64).cast(), 8) };
        if n == 8 {
            stray_notifications += 1;
        }
        // SAFETY: closes the eventfd made above, once.
        unsafe { libc::close(canary) };
    }
    assert_eq!(
        stray_notifications, 0,
        "a completion callback notified through a dropped queue's eventfd"
    );
    // The image still serves I/O after all those teardowns.
    let mut check = vec![0u8; 4096];
    device.read_at(&mut check, 0).unwrap();
}
