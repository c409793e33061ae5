//! The encrypted volume's asynchronous queue over both raw engines and every cache mode:
//! whatever goes through the queue reads back the same through the synchronous path and
//! through a fresh open of the image, including requests that are not sector-aligned
//! (read-modify-write) and buffers that split a sector between two segments.

// The block crate's test helpers (QEMU tools, the aio harness), one copy for both crates.
#[path = "../../block/tests/common/mod.rs"]
mod common;

use common::aio::{exercise, run};
use cryptblk_block::aio::{IoBuffers, IoOp, IoRequest, OwnedBuffer, QueueOptions};
use cryptblk_block::open_queue;
use cryptblk_block::{AioEngine, BlockDevice, BlockErrorKind, CacheMode, IoSettings};
use cryptblk_volume::{open_luks_volume, VolumeOptions};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const PW: &[u8] = b"aio test passphrase";

fn format(dir: &Path, sector_size: u32, payload: u64) -> PathBuf {
    let img = dir.join(format!("v{sector_size}.luks2"));
    cryptblk_testutil::luks::cheap_luks2(&img, PW, payload, sector_size);
    img
}

fn open(img: &Path, cache: CacheMode, aio: AioEngine, writable: bool) -> Arc<dyn BlockDevice> {
    Arc::new(
        open_luks_volume(
            img,
            PW,
            &VolumeOptions {
                writable,
                io: IoSettings { cache, aio },
                ..Default::default()
            },
        )
        .unwrap()
        .into_device(),
    )
}

fn plaintext(dev: &dyn BlockDevice) -> Vec<u8> {
    let mut all = vec![0u8; dev.size() as usize];
    dev.read_at(&mut all, 0).unwrap();
    all
}

#[test]
fn queue_and_synchronous_path_agree_in_every_mode() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    for sector_size in [4096u32, 512] {
        let img = format(dir.path(), sector_size, 4 << 20);
        for aio in AioEngine::ALL {
            for cache in CacheMode::ALL {
                let dev = open(&img, cache, aio, true);
                let mut model = plaintext(&*dev);
                let mut queue = open_queue(&dev, &QueueOptions { depth: 32 }).unwrap();
                // Sector-aligned requests take the fast path; 512-byte units on a 4 KiB
                // volume mix in read-modify-write and sector-splitting buffers.
                exercise(
                    &mut *queue,
                    &mut model,
                    32,
                    20,
                    u64::from(sector_size),
                    sector_size as usize,
                );
                exercise(&mut *queue, &mut model, 16, 10, 99, 512);
                run(&mut *queue, &IoRequest::flush(1)).unwrap();
                drop(queue);
                assert!(
                    plaintext(&*dev) == model,
                    "{aio}/{cache}/{sector_size}: sync view"
                );
                drop(dev);
                let fresh = open(&img, CacheMode::Writeback, AioEngine::Threads, false);
                assert!(
                    plaintext(&*fresh) == model,
                    "{aio}/{cache}/{sector_size}: reopened"
                );
            }
        }
    }
}

#[test]
fn write_zeroes_discard_and_refusals() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let img = format(dir.path(), 4096, 2 << 20);
    let dev = open(&img, CacheMode::None, AioEngine::IoUring, true);
    let mut queue = open_queue(&dev, &QueueOptions { depth: 8 }).unwrap();
    let data = OwnedBuffer::from_bytes(&vec![0x5a; 1 << 20]);
    let iov = IoBuffers::whole(Arc::new(data), 1 << 20).unwrap();
    run(&mut *queue, &IoRequest::write(0, &iov, true, 1)).unwrap();
    // Zeroes on an encrypted volume are encrypted zeros: they read back as zeros.
    run(
        &mut *queue,
        &IoRequest::range(IoOp::WriteZeroes, 4096, 8192 + 512, 2),
    )
    .unwrap();
    let all = plaintext(&*dev);
    assert!(all[..4096].iter().all(|&b| b == 0x5a));
    assert!(all[4096..12800].iter().all(|&b| b == 0));
    assert!(all[12800..1 << 20].iter().all(|&b| b == 0x5a));
    // Discard of a range with partial sectors at both ends touches only the whole ones.
    run(
        &mut *queue,
        &IoRequest::range(IoOp::Discard, 100, 3 * 4096, 3),
    )
    .unwrap();
    let after = plaintext(&*dev);
    assert!(after[..4096] == all[..4096], "partial head sector kept");
    assert!(
        after[3 * 4096..] == all[3 * 4096..],
        "partial tail sector kept"
    );

    let err = run(&mut *queue, &IoRequest::read(2 << 20, &iov, 4)).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::OutOfRange, "{err}");
    drop(queue);
    drop(dev);
    let ro = open(&img, CacheMode::None, AioEngine::IoUring, false);
    let mut queue = open_queue(&ro, &QueueOptions { depth: 8 }).unwrap();
    let err = run(&mut *queue, &IoRequest::write(0, &iov, false, 5)).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::ReadOnly, "{err}");
}

/// A burst of large reads is handed out in slices, not all at once after the whole burst is
/// decrypted: the owner gets its thread back after about 64 KiB of decryption (to take new
/// requests while the device would otherwise idle), finds the notifier still set, and gets
/// the rest, correctly decrypted, from the next drains.
#[test]
fn a_burst_of_reads_is_handed_out_in_slices() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let img = format(dir.path(), 4096, 4 << 20);
    let dev = open(&img, CacheMode::None, AioEngine::IoUring, true);
    let mut queue = open_queue(&dev, &QueueOptions { depth: 16 }).unwrap();
    const READS: usize = 8;
    const LEN: usize = 64 * 1024;
    let data: Vec<u8> = (0..READS * LEN).map(|i| (i / 4096) as u8 ^ 0xa5).collect();
    let iov = IoBuffers::whole(Arc::new(OwnedBuffer::from_bytes(&data)), data.len()).unwrap();
    run(&mut *queue, &IoRequest::write(0, &iov, false, 100)).unwrap();

    let mut bufs: Vec<Arc<OwnedBuffer>> = (0..READS)
        .map(|_| Arc::new(OwnedBuffer::zeroed(LEN)))
        .collect();
    for (i, buf) in bufs.iter().enumerate() {
        let iov = IoBuffers::whole(buf.clone(), LEN).unwrap();
        // The queue holds the buffer until the read's completion is handed out.
        queue
            .push(&IoRequest::read((i * LEN) as u64, &iov, i as u64))
            .unwrap();
    }
    queue.submit().unwrap();
    // Time for the device to finish all eight (a few milliseconds at most), so that a drain
    // that decrypted a whole burst before handing anything out would hand out all of them.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let mut per_drain = Vec::new();
    let mut done = 0;
    while queue.in_flight() > 0 {
        let mut pfd = [PollFd::from_borrowed_fd(queue.notifier(), PollFlags::IN)];
        let timeout = Timespec {
            tv_sec: 10,
            tv_nsec: 0,
        };
        let ready = poll(&mut pfd, Some(&timeout));
        assert_eq!(ready, Ok(1), "reads in flight but the notifier never fired");
        let mut got = 0;
        queue.drain(&mut |c| {
            c.result.unwrap();
            got += 1;
        });
        per_drain.push(got);
        done += got;
    }
    assert_eq!(done, READS);
    assert!(
        per_drain.iter().all(|&n| n <= 2),
        "drains handed out {per_drain:?} reads of 64 KiB: a slice should hold about 64 KiB"
    );
    for (i, b) in bufs.iter_mut().enumerate() {
        let b = Arc::get_mut(b).unwrap().bytes_mut();
        assert!(
            b[..] == data[i * LEN..(i + 1) * LEN],
            "read {i} decrypted wrongly"
        );
    }
}
