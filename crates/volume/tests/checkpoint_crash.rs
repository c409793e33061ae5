//! A writer killed with SIGKILL at a random moment while it writes through a tracked disk's
//! queues and its synchronous path: afterwards every 64 KiB region of the image whose bytes
//! changed is marked changed in the checkpoint (the write-intent log recorded it before the
//! write was submitted). The writer is this test binary run again as a child process.

use cryptblk_block::aio::{run_one, IoBuffers, IoRequest, OwnedBuffer, QueueOptions};

use cryptblk_block::open_queue;
use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_volume::checkpoint::{store_dir, GRANULARITY};
use cryptblk_volume::{CheckpointStore, DirtyTracker, IntentLog};
use rand::Rng;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const CHILD: &str = "CRYPTBLK_CHECKPOINT_CRASH_CHILD";
const SIZE: u64 = 256 << 20;
const TEST: &str = "a_killed_writer_never_leaves_a_change_unrecorded";

#[test]
fn a_killed_writer_never_leaves_a_change_unrecorded() {
    if let Ok(image) = std::env::var(CHILD) {
        write_until_killed(Path::new(&image));
    }
    let mut changed_total = 0;
    for round in 0..4 {
        let tmp = tempfile::tempdir().unwrap();
        let image = tmp.path().join("disk.raw");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(SIZE)
            .unwrap();
        {
            let (store, _) = CheckpointStore::open(&store_dir(&image), SIZE, Arc::default(), true)
                .unwrap()
                .unwrap();
            store.add("c1", 1).unwrap();
        }
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", TEST, "--nocapture"])
            .env(CHILD, &image)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(150 + 100 * round));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        let (store, warnings) =
            CheckpointStore::open(&store_dir(&image), SIZE, Arc::default(), false)
                .unwrap()
                .unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        let runs = store.dirty_runs("c1", 0, usize::MAX, 0, SIZE).unwrap();
        let marked = |offset: u64| runs.iter().any(|&(o, l)| offset >= o && offset < o + l);
        let bytes = std::fs::read(&image).unwrap();
        let mut changed = 0;
        for (k, region) in bytes.chunks(GRANULARITY as usize).enumerate() {
            if region.iter().any(|&b| b != 0) {
                changed += 1;
                let offset = k as u64 * u64::from(GRANULARITY);
                assert!(
                    marked(offset),
                    "round {round}: region at {offset} changed, unmarked"
                );
            }
        }
        changed_total += changed;
    }
    assert!(
        changed_total > 0,
        "the writer never wrote: the test proves nothing"
    );
}

/// Writes 4 KiB blocks at random places, on two queues and the synchronous path at once.
fn write_until_killed(image: &Path) -> ! {
    let raw: Arc<dyn BlockDevice> = Arc::new(
        RawFile::open(
            image,
            OpenOptions {
                writable: true,
                lock: true,
            },
        )
        .unwrap(),
    );
    let tracker = Arc::new(DirtyTracker::new(raw, 0, 4096).unwrap());
    let log: Arc<IntentLog> = tracker.intent_log().clone();
    let (_store, _) = CheckpointStore::open(&store_dir(image), SIZE, log, false)
        .unwrap()
        .unwrap();
    let device: Arc<dyn BlockDevice> = tracker;
    std::thread::scope(|s| {
        for _ in 0..2 {
            let device = device.clone();
            s.spawn(move || {
                let mut q = open_queue(&device, &QueueOptions { depth: 4 }).unwrap();
                let mut rng = rand::thread_rng();
                let buf = OwnedBuffer::from_bytes(&[0xa5u8; 4096]);
                let iov = IoBuffers::whole(Arc::new(buf), 4096).unwrap();
                for tag in 0.. {
                    let offset = rng.gen_range(0..SIZE / 4096) * 4096;
                    run_one(&mut *q, &IoRequest::write(offset, &iov, false, tag)).unwrap();
                }
            });
        }
        let mut rng = rand::thread_rng();
        loop {
            let offset = rng.gen_range(0..SIZE / 4096) * 4096;
            device.write_at(&[0x5a; 4096], offset).unwrap();
        }
    })
}
