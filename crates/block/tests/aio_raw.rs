//! The asynchronous engines of raw files (io_uring, threads) in every cache mode, against a
//! model of the disk: batches of concurrent reads and writes with scattered, misaligned
//! buffers, short reads past a shrunken end, discard and write-zeroes, refusals.

mod common;

use common::aio::{exercise, run};
use cryptblk_block::aio::{read_at, IoBuffers, IoOp, IoRequest, OwnedBuffer, QueueOptions};
use cryptblk_block::open_queue;
use cryptblk_block::{
    AioEngine, BlockDevice, BlockErrorKind, CacheMode, IoSettings, OpenOptions, RawFile,
};
use rand::{RngCore, SeedableRng};
use std::path::Path;
use std::sync::Arc;

const RW: OpenOptions = OpenOptions {
    writable: true,
    lock: true,
};

/// A directory on a real filesystem (O_DIRECT works there, unlike tmpfs).
fn disk_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn image(dir: &Path, size: usize, seed: u64) -> (std::path::PathBuf, Vec<u8>) {
    let mut data = vec![0u8; size];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut data);
    let p = dir.join("disk.raw");
    std::fs::write(&p, &data).unwrap();
    (p, data)
}

fn open(p: &Path, cache: CacheMode, aio: AioEngine) -> Arc<dyn BlockDevice> {
    Arc::new(RawFile::open_with(p, RW, IoSettings { cache, aio }).unwrap())
}

#[test]
fn every_engine_and_cache_mode_reads_what_was_written() {
    let dir = disk_dir();
    for aio in AioEngine::ALL {
        for cache in CacheMode::ALL {
            let (p, mut model) = image(dir.path(), 4 << 20, 7);
            let raw = RawFile::open_with(&p, RW, IoSettings { cache, aio }).unwrap();
            assert_eq!(
                raw.cache(),
                cache,
                "O_DIRECT must work on {}",
                dir.path().display()
            );
            let dev: Arc<dyn BlockDevice> = Arc::new(raw);
            let mut queue = open_queue(&dev, &QueueOptions { depth: 32 }).unwrap();
            exercise(&mut *queue, &mut model, 32, 40, 11, 512);
            // Flush through the queue, then the synchronous path sees every write.
            run(&mut *queue, &IoRequest::flush(99)).unwrap();
            drop(queue);
            let mut back = vec![0u8; model.len()];
            dev.read_at(&mut back, 0).unwrap();
            assert!(back == model, "{aio}/{cache}: image differs from the model");
            drop(dev);
            assert!(
                std::fs::read(&p).unwrap() == model,
                "{aio}/{cache}: file differs"
            );
            std::fs::remove_file(&p).unwrap();
        }
    }
}

#[test]
fn cache_none_on_tmpfs_works_with_or_without_o_direct() {
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        panic!("/dev/shm (tmpfs) is needed for this test");
    };
    let (p, mut model) = image(dir.path(), 1 << 20, 3);
    let raw = RawFile::open_with(
        &p,
        RW,
        IoSettings {
            cache: CacheMode::None,
            aio: AioEngine::IoUring,
        },
    )
    .unwrap();
    // tmpfs takes O_DIRECT since Linux 6.6 (it is the page cache anyway); before that it
    // refuses it and the mode falls back to writeback.
    match raw.cache() {
        CacheMode::Writeback => assert_eq!(raw.direct_alignment(), (1, 1)),
        CacheMode::None => assert_ne!(raw.direct_alignment(), (1, 1)),
        other => panic!("cache=none became {other}"),
    }
    let dev: Arc<dyn BlockDevice> = Arc::new(raw);
    let mut queue = open_queue(&dev, &QueueOptions { depth: 8 }).unwrap();
    exercise(&mut *queue, &mut model, 8, 20, 5, 512);
}

#[test]
fn short_reads_past_a_shrunken_end_read_zeros_and_refusals_complete_with_errors() {
    let dir = disk_dir();
    for aio in AioEngine::ALL {
        for cache in [CacheMode::None, CacheMode::Writeback] {
            let (p, data) = image(dir.path(), 1 << 20, 9);
            let dev = open(&p, cache, aio);
            let mut queue = open_queue(&dev, &QueueOptions { depth: 4 }).unwrap();
            // Someone truncates the image under us: the tail reads as zeros, not an error.
            std::fs::OpenOptions::new()
                .write(true)
                .open(&p)
                .unwrap()
                .set_len((1 << 20) - 8192)
                .unwrap();
            let mut buf = vec![0xee; 16384];
            read_at(&mut *queue, (1 << 20) - 16384, &mut buf).unwrap();
            assert!(buf[..8192] == data[(1 << 20) - 16384..(1 << 20) - 8192]);
            assert!(buf[8192..].iter().all(|&b| b == 0), "{aio}/{cache}");

            let page = IoBuffers::whole(Arc::new(OwnedBuffer::zeroed(4096)), 4096).unwrap();
            let err = run(&mut *queue, &IoRequest::read(1 << 20, &page, 2)).unwrap_err();
            assert_eq!(err.kind(), BlockErrorKind::OutOfRange, "{err}");
            assert!(err.to_string().contains("disk.raw"), "{err}");
            drop(queue);
            drop(dev);

            let ro: Arc<dyn BlockDevice> = Arc::new(
                RawFile::open_with(&p, OpenOptions::default(), IoSettings { cache, aio }).unwrap(),
            );
            let mut queue = open_queue(&ro, &QueueOptions { depth: 4 }).unwrap();
            let err = run(&mut *queue, &IoRequest::write(0, &page, false, 3)).unwrap_err();
            assert_eq!(err.kind(), BlockErrorKind::ReadOnly, "{err}");
            let err = run(&mut *queue, &IoRequest::range(IoOp::Discard, 0, 4096, 4)).unwrap_err();
            assert_eq!(err.kind(), BlockErrorKind::ReadOnly, "{err}");
            // A flush of a read-only file has nothing to do.
            run(&mut *queue, &IoRequest::flush(5)).unwrap();
            drop(queue);
            drop(ro);
            std::fs::remove_file(&p).unwrap();
        }
    }
}

#[test]
fn discard_and_write_zeroes_read_back_as_zeros() {
    for (dir, what) in [
        (disk_dir(), "disk"),
        (tempfile::tempdir_in("/dev/shm").unwrap(), "tmpfs"),
    ] {
        for aio in AioEngine::ALL {
            let (p, data) = image(dir.path(), 4 << 20, 13);
            let dev = open(&p, CacheMode::None, aio);
            let mut queue = open_queue(&dev, &QueueOptions { depth: 4 }).unwrap();
            run(
                &mut *queue,
                &IoRequest::range(IoOp::Discard, 1 << 20, 1 << 20, 1),
            )
            .unwrap();
            // 3 MiB: more than one chunk where zeros have to be written (tmpfs).
            run(
                &mut *queue,
                &IoRequest::range(IoOp::WriteZeroes, 4096, 3 << 20, 2),
            )
            .unwrap();
            drop(queue);
            let back = std::fs::read(&p).unwrap();
            assert!(back[..4096] == data[..4096], "{what}/{aio}");
            assert!(
                back[4096..(3 << 20) + 4096].iter().all(|&b| b == 0),
                "{what}/{aio}"
            );
            assert!(
                back[(3 << 20) + 4096..] == data[(3 << 20) + 4096..],
                "{what}/{aio}"
            );
            drop(dev);
            std::fs::remove_file(&p).unwrap();
        }
    }
}
