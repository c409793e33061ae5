//! What checkpoints and a running backup cost a disk's writes: 4 KiB random writes at queue
//! depth 32 through a tracked raw file's queue, in three arms per round (every other round in
//! reverse order):
//! - `none`: no checkpoint;
//! - `checkpoint`: one checkpoint with every region already recorded (its steady state: the
//!   write-intent log adds nothing to the data path once a region is recorded);
//! - `backup`: the same disk while a backup runs. Each round starts a new backup, so it pays
//!   for the first write to every region it touches (the region's old bytes read and written
//!   to the scratch: copy-before-write), as a backup does.
//!
//! Reports IOPS and process CPU time per write of each arm per round (and what the backup
//! copied), then the median and worst per-round ratios checkpoint/none and backup/checkpoint.
//! The files are written through the page cache, so the numbers are the request path's and
//! the copy's, not the disk's.
//!
//! ```sh
//! cargo run --release -p cryptblk-volume --example checkpoint_cost -- [ROUNDS] [SECONDS]
//! ```

use cryptblk_block::aio::{IoBuffers, IoRequest, OwnedBuffer, QueueOptions};

use cryptblk_block::open_queue;
use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_volume::checkpoint::store_dir;
use cryptblk_volume::{CheckpointStore, CopyBeforeWrite, DirtyTracker};
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SIZE: u64 = 1 << 30;
const DEPTH: usize = 32;
const BLOCK: usize = 4096;

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF counts every thread of the process (the I/O pool too).
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(usage.ru_utime) + t(usage.ru_stime)
}

/// Random 4 KiB writes at depth 32 for `seconds`: (IOPS, CPU µs per write).
fn measure(device: &Arc<dyn BlockDevice>, seconds: f64, seed: u64) -> (f64, f64) {
    let mut queue = open_queue(device, &QueueOptions { depth: DEPTH }).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let iovs: Vec<IoBuffers> = (0..DEPTH)
        .map(|k| {
            let data = OwnedBuffer::from_bytes(&[k as u8 | 1; BLOCK]);
            IoBuffers::whole(Arc::new(data), BLOCK).unwrap()
        })
        .collect();
    let mut free: Vec<usize> = (0..DEPTH).collect();
    let (start, cpu) = (Instant::now(), cpu_seconds());
    let bound = Duration::from_secs_f64(seconds);
    let mut done = 0u64;
    while start.elapsed() < bound {
        while let Some(slot) = free.pop() {
            let offset = rng.gen_range(0..SIZE / BLOCK as u64) * BLOCK as u64;
            queue
                .push(&IoRequest::write(offset, &iovs[slot], false, slot as u64))
                .unwrap();
        }
        queue.submit().unwrap();
        queue.wait();
        queue.drain(&mut |c| {
            c.result.unwrap();
            free.push(c.tag as usize);
            done += 1;
        });
    }
    while queue.in_flight() > 0 {
        queue.wait();
        queue.drain(&mut |c| c.result.unwrap());
    }
    let (wall, cpu) = (start.elapsed().as_secs_f64(), cpu_seconds() - cpu);
    (done as f64 / wall, cpu * 1e6 / done as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A 1 GiB raw file at `path`, written whole first (steady state: no block allocation while
/// measuring), behind a dirty tracker.
fn tracked_file(path: &Path) -> (Arc<dyn BlockDevice>, Arc<DirtyTracker>) {
    let f = std::fs::File::create(path).unwrap();
    let chunk = vec![0x5au8; 1 << 20];
    for k in 0..SIZE >> 20 {
        std::os::unix::fs::FileExt::write_all_at(&f, &chunk, k << 20).unwrap();
    }
    let options = OpenOptions {
        writable: true,
        lock: true,
    };
    let raw: Arc<dyn BlockDevice> = Arc::new(RawFile::open(path, options).unwrap());
    let tracker = Arc::new(DirtyTracker::new(raw.clone(), 0, 4096).unwrap());
    (raw, tracker)
}

/// "median M, worst round W" of per-round ratios (worst: the lowest).
fn summary(ratios: &[f64]) -> String {
    let worst = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    format!(
        "median {:.3}, worst round {worst:.3}",
        median(ratios.to_vec())
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(1).map_or(7, |a| a.parse().unwrap());
    let seconds: f64 = args.get(2).map_or(3.0, |a| a.parse().unwrap());
    let tmp = tempfile::tempdir().unwrap();
    let (_, plain) = tracked_file(&tmp.path().join("none.raw"));
    let path = tmp.path().join("checkpoint.raw");
    let (raw, tracker) = tracked_file(&path);
    let (store, _) =
        CheckpointStore::open(&store_dir(&path), SIZE, tracker.intent_log().clone(), true)
            .unwrap()
            .unwrap();
    store.add("c1", 0).unwrap();
    tracker.intent_log().record(0, SIZE).unwrap();
    let scratch = tmp.path().join("checkpoint.raw.cryptblk-backup-scratch");
    let devices: [Arc<dyn BlockDevice>; 2] = [plain, tracker.clone()];

    let names = ["none", "checkpoint", "backup"];
    let (mut checkpoint_iops, mut checkpoint_cpu) = (Vec::new(), Vec::new());
    let (mut backup_iops, mut backup_cpu) = (Vec::new(), Vec::new());
    println!("round arm iops cpu_us_per_write copied_mib");
    for round in 0..rounds {
        let mut results = [(0.0, 0.0); 3];
        let mut order = [0, 1, 2];
        if round % 2 == 1 {
            order.reverse();
        }
        for arm in order {
            let backup = (arm == 2).then(|| {
                let cbw = Arc::new(CopyBeforeWrite::create(raw.clone(), &scratch, SIZE).unwrap());
                tracker
                    .start_copy_before_write(cbw.clone(), Duration::from_secs(30))
                    .unwrap();
                cbw
            });
            results[arm] = measure(&devices[arm.min(1)], seconds, round as u64);
            let copied = backup.as_ref().map_or(0, |cbw| cbw.used() >> 20);
            if let Some(cbw) = backup {
                assert!(cbw.failure().is_none(), "the backup failed");
                tracker.stop_copy_before_write();
            }
            println!(
                "{round} {} {:.0} {:.2} {copied}",
                names[arm], results[arm].0, results[arm].1
            );
        }
        checkpoint_iops.push(results[1].0 / results[0].0);
        checkpoint_cpu.push(results[1].1 / results[0].1);
        backup_iops.push(results[2].0 / results[1].0);
        backup_cpu.push(results[2].1 / results[1].1);
    }
    println!(
        "IOPS with/without a checkpoint: {}; CPU per write: median {:.3}",
        summary(&checkpoint_iops),
        median(checkpoint_cpu)
    );
    println!(
        "IOPS during/without a backup (both with the checkpoint): {}; CPU per write: median {:.3}",
        summary(&backup_iops),
        median(backup_cpu)
    );
}
