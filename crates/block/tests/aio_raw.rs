//! The asynchronous engines of raw files (io_uring, threads) in every cache mode, against a
//! model of the disk: batches of concurrent reads and writes with scattered, misaligned
//! buffers, short reads past a shrunken end, discard and write-zeroes, refusals.

use cryptblk_block::aio::{open_queue, IoOp, IoQueue, IoRequest, IoVec, QueueOptions};
use cryptblk_block::{
    AioEngine, BlockDevice, BlockErrorKind, CacheMode, IoSettings, OpenOptions, RawFile,
};
use rand::{Rng, RngCore, SeedableRng};
use std::collections::HashMap;
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

/// One request of a batch with the memory behind its buffers.
struct Pending {
    op: IoOp,
    offset: usize,
    len: usize,
    /// Backing memory; the segments point into it at `skew`.
    mem: Vec<u8>,
    skew: usize,
    iov: Vec<IoVec>,
}

/// Splits `len` bytes at `mem[skew..]` into 1..=4 segments of multiples of `unit`.
fn segments(
    mem: &mut [u8],
    skew: usize,
    len: usize,
    unit: usize,
    rng: &mut impl Rng,
) -> Vec<IoVec> {
    let units = len / unit;
    let mut cuts: Vec<usize> = (0..rng.gen_range(0..4usize).min(units.saturating_sub(1)))
        .map(|_| rng.gen_range(1..units) * unit)
        .collect();
    cuts.push(0);
    cuts.push(len);
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2)
        .map(|w| IoVec::from_slice(&mut mem[skew + w[0]..skew + w[1]]))
        .collect()
}

/// Runs `rounds` batches of up to `depth` non-overlapping requests through `queue`, checking
/// every read against `model` and applying every write to it.
fn exercise(queue: &mut dyn IoQueue, model: &mut [u8], depth: usize, rounds: usize, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let block = 512usize;
    let region = 64 * 1024;
    let regions = model.len() / region;
    for _ in 0..rounds {
        let mut free: Vec<usize> = (0..regions).collect();
        let n = rng.gen_range(1..=depth.min(regions));
        let mut batch: HashMap<u64, Pending> = HashMap::new();
        for tag in 0..n as u64 {
            let r = free.swap_remove(rng.gen_range(0..free.len()));
            let len = rng.gen_range(1..=region / block) * block;
            let offset = r * region + rng.gen_range(0..=(region - len) / block) * block;
            // Mostly aligned memory, sometimes misaligned by a few bytes or half a block.
            let skew = [0, 0, 0, 512, 1, 7][rng.gen_range(0..6)];
            let mut mem = vec![0u8; len + 4096 + skew];
            let base = mem.as_ptr() as usize;
            let skew = (4096 - base % 4096) % 4096 + skew;
            let op = if rng.gen_bool(0.5) {
                IoOp::Read
            } else {
                IoOp::Write
            };
            if op == IoOp::Write {
                rng.fill_bytes(&mut mem[skew..skew + len]);
                model[offset..offset + len].copy_from_slice(&mem[skew..skew + len]);
            }
            let iov = segments(&mut mem, skew, len, block, &mut rng);
            batch.insert(
                tag,
                Pending {
                    op,
                    offset,
                    len,
                    mem,
                    skew,
                    iov,
                },
            );
        }
        for (&tag, p) in &batch {
            let req = match p.op {
                IoOp::Read => IoRequest::read(p.offset as u64, &p.iov, tag),
                _ => IoRequest::write(p.offset as u64, &p.iov, rng.gen_bool(0.2), tag),
            };
            // SAFETY: `batch` keeps the memory alive and untouched until every completion
            // has been drained below.
            unsafe { queue.push(&req) }.unwrap();
        }
        queue.submit().unwrap();
        let mut left = batch.len();
        while left > 0 {
            queue.drain(&mut |c| {
                c.result
                    .unwrap_or_else(|e| panic!("request {} failed: {e}", c.tag));
                let p = &batch[&c.tag];
                if p.op == IoOp::Read {
                    assert!(
                        p.mem[p.skew..p.skew + p.len] == model[p.offset..p.offset + p.len],
                        "read of {} bytes at {} returned wrong data",
                        p.len,
                        p.offset
                    );
                }
                left -= 1;
            });
            if left > 0 {
                queue.wait();
            }
        }
        assert_eq!(queue.in_flight(), 0);
    }
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
            exercise(&mut *queue, &mut model, 32, 40, 11);
            // Flush through the queue, then the synchronous path sees every write.
            // SAFETY: a flush carries no buffers.
            unsafe { cryptblk_block::aio::run_one(&mut *queue, &IoRequest::flush(99)) }.unwrap();
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
    exercise(&mut *queue, &mut model, 8, 20, 5);
}

fn run(queue: &mut dyn IoQueue, req: &IoRequest<'_>) -> Result<(), cryptblk_block::BlockError> {
    // SAFETY: callers keep the request's buffers alive across the call.
    unsafe { cryptblk_block::aio::run_one(queue, req) }
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
            let mut buf = cryptblk_block::AlignedBuf::zeroed(16384);
            buf.fill(0xee);
            let iov = [IoVec::from_slice(&mut buf)];
            run(&mut *queue, &IoRequest::read((1 << 20) - 16384, &iov, 1)).unwrap();
            assert!(buf[..8192] == data[(1 << 20) - 16384..(1 << 20) - 8192]);
            assert!(buf[8192..].iter().all(|&b| b == 0), "{aio}/{cache}");

            let iov = [IoVec::from_slice(&mut buf[..4096])];
            let err = run(&mut *queue, &IoRequest::read(1 << 20, &iov, 2)).unwrap_err();
            assert_eq!(err.kind(), BlockErrorKind::OutOfRange, "{err}");
            assert!(err.to_string().contains("disk.raw"), "{err}");
            drop(queue);
            drop(dev);

            let ro: Arc<dyn BlockDevice> = Arc::new(
                RawFile::open_with(&p, OpenOptions::default(), IoSettings { cache, aio }).unwrap(),
            );
            let mut queue = open_queue(&ro, &QueueOptions { depth: 4 }).unwrap();
            let err = run(&mut *queue, &IoRequest::write(0, &iov, false, 3)).unwrap_err();
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
