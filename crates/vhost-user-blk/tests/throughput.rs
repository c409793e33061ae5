//! Rough throughput of the daemon through the in-repo frontend (not a timed test: ignored by
//! default; run with `cargo test --release -p cryptblk-vhost-user-blk --test throughput --
//! --ignored --nocapture`). The frontend's own cost is included, so these are lower bounds.
use cryptblk_testutil::vhost_user as common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{pattern, Daemon, Guest, S_OK};
use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_vhost_user_blk::ServeOptions;
use cryptblk_volume::{open_luks_volume, VolumeOptions};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 256 * MIB;
const RUN: Duration = Duration::from_secs(3);

fn scratch_dir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm).unwrap()
    } else {
        tempfile::tempdir().unwrap()
    }
}

/// Keeps `depth` requests of `bs` bytes in flight on queue 0 for `RUN`; returns (IOPS, MiB/s).
fn run(guest: &mut Guest, write: bool, bs: usize, depth: usize, random: bool) -> (f64, f64) {
    let blocks = SIZE / bs as u64;
    let data = pattern(bs, 1);
    let mut rng = 0x1234_5678_9abc_def0u64;
    let mut next = 0u64;
    let mut pick = |rng: &mut u64| {
        let b = if random {
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            *rng % blocks
        } else {
            next = (next + 1) % blocks;
            next
        };
        b * bs as u64 / 512
    };
    let seg = bs.min(4096);
    let mut submit = |guest: &mut Guest, rng: &mut u64| {
        let sector = pick(rng);
        let (descs, _) = if write {
            guest.out_chain(0, sector, &data, seg)
        } else {
            guest.in_chain(0, sector, bs, seg)
        };
        guest.publish(0, &descs);
    };
    for _ in 0..depth {
        submit(guest, &mut rng);
    }
    guest.kick(0);
    let start = Instant::now();
    let mut done = 0u64;
    while start.elapsed() < RUN {
        let used = guest.wait_used(0, 1);
        for _ in &used {
            submit(guest, &mut rng);
        }
        guest.kick(0);
        done += used.len() as u64;
    }
    guest.wait_used(0, depth);
    let secs = start.elapsed().as_secs_f64();
    let iops = done as f64 / secs;
    (iops, iops * bs as f64 / MIB as f64)
}

fn report(name: &str, device: Arc<dyn BlockDevice>) {
    let daemon = Daemon::start(
        device,
        ServeOptions {
            num_queues: 1,
            queue_size: 1024,
            read_only: false,
            serial: String::new(),
            discard: false,
            ..Default::default()
        },
    );
    let mut guest = Guest::connect(&daemon.socket, 1, 1024);
    // Fill the first part so reads hit allocated blocks.
    let fill = pattern(1 << 20, 2);
    for i in 0..(SIZE >> 20) {
        assert_eq!(guest.write(0, i * 2048, &fill), S_OK);
    }
    for (label, write, bs, random) in [
        ("4k randread", false, 4096, true),
        ("4k randwrite", true, 4096, true),
        ("64k read", false, 65536, false),
        ("64k write", true, 65536, false),
    ] {
        let (iops, mibs) = run(&mut guest, write, bs, 32, random);
        println!("{name:>12} {label:>13} iodepth 32: {iops:>9.0} IOPS {mibs:>8.1} MiB/s");
    }
    drop(guest);
    daemon.stop();
}

#[test]
#[ignore]
fn throughput() {
    let dir = scratch_dir();

    let raw_path = dir.path().join("disk.raw");
    std::fs::File::create(&raw_path)
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    let raw = RawFile::open(
        &raw_path,
        OpenOptions {
            writable: true,
            lock: true,
        },
    )
    .unwrap();
    report("raw", Arc::new(raw));

    let luks_path = dir.path().join("disk.luks2");
    cryptblk_testutil::luks::cheap_luks2(&luks_path, b"throughput pass", SIZE, 4096);
    let rw = VolumeOptions {
        writable: true,
        ..Default::default()
    };
    let volume = open_luks_volume(&luks_path, b"throughput pass", &rw).unwrap();
    report("luks2-4k", Arc::new(volume));
}
