//! A backup's view stays the image as it was when copy-before-write started, whatever is
//! written meanwhile, through the tracker's methods and through its queues.

use super::{BackupView, CopyBeforeWrite, DirtyTracker, COPY_REGION, RELEASE_GRANULE};
use cryptblk_block::aio::{run_one, write_at, IoOp, IoRequest, QueueOptions};
use cryptblk_block::open_queue;
use cryptblk_block::{BlockDevice, BlockError, OpenOptions, RawFile};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

const SIZE: u64 = 16 * COPY_REGION;
const TIMEOUT: Duration = Duration::from_secs(10);

struct Disk {
    dir: tempfile::TempDir,
    raw: Arc<dyn BlockDevice>,
    before: Vec<u8>,
}

/// A raw image of 16 regions, each byte its region number plus its offset's low bits.
fn disk() -> Disk {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.raw");
    let before: Vec<u8> = (0..SIZE)
        .map(|i| ((i / COPY_REGION) as u8).wrapping_mul(31) ^ (i as u8))
        .collect();
    std::fs::write(&path, &before).unwrap();
    let raw: Arc<dyn BlockDevice> = Arc::new(
        RawFile::open(
            &path,
            OpenOptions {
                writable: true,
                lock: true,
            },
        )
        .unwrap(),
    );
    Disk { dir, raw, before }
}

fn backup(disk: &Disk, tracker: &DirtyTracker, scratch: u64) -> BackupView {
    let cbw = Arc::new(
        CopyBeforeWrite::create(disk.raw.clone(), &disk.dir.path().join("scratch"), scratch)
            .unwrap(),
    );
    tracker
        .start_copy_before_write(cbw.clone(), TIMEOUT)
        .unwrap();
    BackupView::new(disk.raw.clone(), cbw)
}

fn read_all(view: &dyn BlockDevice) -> Result<Vec<u8>, BlockError> {
    let mut buf = vec![0u8; view.size() as usize];
    // Odd-sized reads, so they straddle regions.
    for (n, chunk) in buf.chunks_mut(3 * 4096 + 512).enumerate() {
        view.read_at(chunk, n as u64 * (3 * 4096 + 512))?;
    }
    Ok(buf)
}

#[test]
fn writes_during_a_backup_leave_its_view_unchanged() {
    let disk = disk();
    let tracker = Arc::new(DirtyTracker::new(disk.raw.clone(), 0, 4096).unwrap());
    let device: Arc<dyn BlockDevice> = tracker.clone();
    let mut queue = open_queue(&device, &QueueOptions { depth: 4 }).unwrap();
    let view = backup(&disk, &tracker, SIZE);

    // Through the tracker's methods: a write across two regions, a discard, write-zeroes.
    tracker.write_at(&[0xAA; 8192], COPY_REGION - 4096).unwrap();
    tracker.write_zeroes(5 * COPY_REGION, COPY_REGION).unwrap();
    tracker.discard(7 * COPY_REGION, 2 * COPY_REGION).unwrap();
    // Through a queue: a write, and a second one to a region already copied.
    let buf = vec![0x55u8; 4096];
    write_at(&mut *queue, 10 * COPY_REGION, &buf).unwrap();
    write_at(&mut *queue, 10 * COPY_REGION, &[0x56u8; 4096]).unwrap();
    run_one(
        &mut *queue,
        &IoRequest::range(IoOp::WriteZeroes, 12 * COPY_REGION, 4096, 3),
    )
    .unwrap();

    let now = std::fs::read(disk.dir.path().join("disk.raw")).unwrap();
    assert_eq!(now[COPY_REGION as usize - 1], 0xAA, "the writes landed");
    assert_eq!(now[10 * COPY_REGION as usize], 0x56);
    assert_ne!(now, disk.before);
    assert!(
        read_all(&view).unwrap() == disk.before,
        "the backup sees the old image"
    );
    let cbw = view.copy_before_write();
    assert_eq!(
        cbw.used(),
        7 * COPY_REGION,
        "regions 0, 1, 5, 7, 8, 10, 12, none twice"
    );
    assert!(cbw.failure().is_none());

    // Ended: writes no longer copy.
    tracker.stop_copy_before_write();
    tracker.write_at(&[1; 4096], 14 * COPY_REGION).unwrap();
    assert_eq!(cbw.used(), 7 * COPY_REGION);
}

#[test]
fn a_read_racing_writes_sees_the_old_bytes() {
    let disk = disk();
    let tracker = Arc::new(DirtyTracker::new(disk.raw.clone(), 0, 4096).unwrap());
    let view = Arc::new(backup(&disk, &tracker, SIZE));
    let done = Arc::new(AtomicBool::new(false));
    let written: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
    // Two writers, so two of them race for the same region's copy too.
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let (tracker, done, written) = (tracker.clone(), done.clone(), written.clone());
            std::thread::spawn(move || {
                let device: Arc<dyn BlockDevice> = tracker;
                let mut queue = open_queue(&device, &QueueOptions { depth: 4 }).unwrap();
                let mut n = 0u64;
                while !done.load(Ordering::SeqCst) {
                    let buf = vec![n as u8; 4096];
                    let offset = ((n + w) * 7919 * 4096) % SIZE;
                    write_at(&mut *queue, offset, &buf).unwrap();
                    n += 1;
                    written[w as usize].store(n, Ordering::SeqCst);
                }
            })
        })
        .collect();
    // At least 200 reads, and on until both writers wrote every region (on a loaded machine
    // a writer may start late).
    let started = std::time::Instant::now();
    let mut reads = 0;
    while reads < 200 || written.iter().any(|n| n.load(Ordering::SeqCst) < 16) {
        assert!(read_all(&*view).unwrap() == disk.before);
        reads += 1;
        assert!(started.elapsed() < TIMEOUT, "the writers did not write");
    }
    done.store(true, Ordering::SeqCst);
    for writer in writers {
        writer.join().unwrap();
    }
    assert!(read_all(&*view).unwrap() == disk.before);
}

#[test]
fn a_full_scratch_fails_the_backup_and_not_the_writes() {
    let disk = disk();
    let tracker = DirtyTracker::new(disk.raw.clone(), 0, 4096).unwrap();
    // Room for two regions (a size off the region is rounded down).
    let view = backup(&disk, &tracker, 2 * COPY_REGION + 100);
    let cbw = view.copy_before_write().clone();
    assert_eq!(cbw.capacity(), 2 * COPY_REGION);
    for region in 0..4 {
        tracker
            .write_at(&[0xEE; 4096], region * COPY_REGION)
            .unwrap();
    }
    let now = std::fs::read(disk.dir.path().join("disk.raw")).unwrap();
    for region in 0..4 {
        assert_eq!(
            now[(region * COPY_REGION) as usize],
            0xEE,
            "every write landed"
        );
    }
    let why = cbw.failure().expect("the backup failed");
    assert!(why.contains("full") && why.contains("--failed"), "{why}");
    let e = read_all(&view).unwrap_err();
    assert!(e.to_string().contains("scratch"), "{e}");
    // Memory and disk bounded by the scratch: no more copies were kept than it holds.
    assert_eq!(cbw.used(), 2 * COPY_REGION);
    assert!(std::fs::metadata(cbw.scratch_path()).unwrap().len() <= 2 * COPY_REGION);
    assert!(cbw.slots_used() <= 2);
    let scratch = cbw.scratch_path().to_path_buf();
    tracker.stop_copy_before_write();
    // A later backup's scratch of the same name is not the old one's to remove.
    let next = CopyBeforeWrite::create(disk.raw.clone(), &scratch, COPY_REGION).unwrap();
    drop((view, cbw));
    assert!(
        scratch.exists(),
        "an old backup removed the next one's scratch"
    );
    drop(next);
    assert!(!scratch.exists(), "the scratch goes with the backup");
}

/// A device whose writes wait until the test lets them go.
struct Gate {
    inner: Arc<dyn BlockDevice>,
    entered: Barrier,
    release: Barrier,
}

impl BlockDevice for Gate {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        self.entered.wait();
        self.release.wait();
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.inner.flush()
    }
}

#[test]
fn starting_waits_for_writes_already_under_way() {
    let disk = disk();
    let gate = Arc::new(Gate {
        inner: disk.raw.clone(),
        entered: Barrier::new(2),
        release: Barrier::new(2),
    });
    let tracker = Arc::new(DirtyTracker::new(gate.clone(), 0, 4096).unwrap());
    let writer = {
        let tracker = tracker.clone();
        std::thread::spawn(move || tracker.write_at(&[0x77; 4096], 3 * COPY_REGION))
    };
    // The write is past its copy-before-write check, not yet done.
    gate.entered.wait();
    let started = Arc::new(AtomicBool::new(false));
    let starter = {
        let (tracker, started) = (tracker.clone(), started.clone());
        let source = disk.raw.clone();
        let path = disk.dir.path().join("scratch");
        std::thread::spawn(move || {
            let cbw = Arc::new(CopyBeforeWrite::create(source, &path, SIZE).unwrap());
            tracker
                .start_copy_before_write(cbw.clone(), TIMEOUT)
                .unwrap();
            started.store(true, Ordering::SeqCst);
            cbw
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !started.load(Ordering::SeqCst),
        "start returned while a write it could not copy was under way"
    );
    gate.release.wait();
    writer.join().unwrap().unwrap();
    let cbw = starter.join().unwrap();
    // The write landed before the backup's moment: its view has it.
    let view = BackupView::new(disk.raw.clone(), cbw);
    let mut byte = [0u8; 1];
    view.read_at(&mut byte, 3 * COPY_REGION).unwrap();
    assert_eq!(byte[0], 0x77);
}

#[test]
fn an_incremental_copies_only_its_regions_and_refuses_others_once_changed() {
    let disk = disk();
    let tracker = Arc::new(DirtyTracker::new(disk.raw.clone(), 0, 4096).unwrap());
    let device: Arc<dyn BlockDevice> = tracker.clone();
    let view = backup(&disk, &tracker, SIZE);
    let cbw = view.copy_before_write().clone();
    // Region 1 written before the limit: copied, as every region was until then.
    tracker.write_at(&[0x11; 4096], COPY_REGION).unwrap();
    // The incremental serves regions 3 and 4 (changed since its checkpoint).
    let inside = super::DirtyBitmap::new(SIZE, COPY_REGION).unwrap();
    inside.set_range(3 * COPY_REGION, 2 * COPY_REGION);
    cbw.limit_to(&inside, "only what changed since c1".into())
        .unwrap();
    tracker
        .write_at(&[0x22; 8192], 3 * COPY_REGION + 4096)
        .unwrap();
    // Through a queue too, as a VM writes.
    let mut queue = open_queue(&device, &QueueOptions { depth: 4 }).unwrap();
    write_at(&mut *queue, 6 * COPY_REGION, &[0x33; 4096]).unwrap();
    tracker.write_at(&[0x44; 4096], 9 * COPY_REGION).unwrap();
    assert_eq!(
        cbw.used(),
        2 * COPY_REGION,
        "regions 1 (before the limit) and 3; not 6 or 9"
    );
    // Its regions, and what was copied before the limit, read as they were; so do regions
    // outside that did not change.
    for (first, count) in [(3, 2), (1, 1), (0, 1), (7, 2)] {
        let (start, len) = (
            (first * COPY_REGION) as usize,
            (count * COPY_REGION) as usize,
        );
        let mut buf = vec![0u8; len];
        view.read_at(&mut buf, start as u64).unwrap();
        assert!(
            buf == disk.before[start..start + len],
            "region {first}: the old bytes"
        );
    }
    // A region outside that changed is refused with the reason, also in a longer read.
    for (offset, len) in [(6 * COPY_REGION, 4096), (9 * COPY_REGION - 4096, 8192)] {
        let e = view.read_at(&mut vec![0u8; len], offset).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("changed here since the backup started") && e.contains("since c1"),
            "{e}"
        );
    }
    let everything = super::DirtyBitmap::new(SIZE, COPY_REGION).unwrap();
    everything.set_all();
    cbw.limit_to(&everything, String::new()).unwrap();
    assert!(
        view.read_at(&mut [0u8; 4096], 6 * COPY_REGION).is_err(),
        "a second limit is ignored"
    );
    let fine = super::DirtyBitmap::new(SIZE, COPY_REGION / 2).unwrap();
    let e = cbw.limit_to(&fine, String::new()).unwrap_err();
    assert!(e.to_string().contains("multiples of 4096 bytes"), "{e}");
    assert!(cbw.failure().is_none());
}

/// A patterned image of three release granules under a backup whose scratch holds `slots`
/// regions.
struct GranuleDisk {
    _dir: tempfile::TempDir,
    before: Vec<u8>,
    tracker: Arc<DirtyTracker>,
    cbw: Arc<CopyBeforeWrite>,
    view: BackupView,
}

fn granule_disk(slots: u64) -> GranuleDisk {
    let size = 3 * RELEASE_GRANULE;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.raw");
    let before: Vec<u8> = (0..size)
        .map(|i| (i / COPY_REGION) as u8 ^ (i as u8))
        .collect();
    std::fs::write(&path, &before).unwrap();
    let writable = OpenOptions {
        writable: true,
        lock: true,
    };
    let raw: Arc<dyn BlockDevice> = Arc::new(RawFile::open(&path, writable).unwrap());
    let tracker = Arc::new(DirtyTracker::new(raw.clone(), 0, 4096).unwrap());
    let scratch = dir.path().join("scratch");
    let cbw =
        Arc::new(CopyBeforeWrite::create(raw.clone(), &scratch, slots * COPY_REGION).unwrap());
    tracker
        .start_copy_before_write(cbw.clone(), TIMEOUT)
        .unwrap();
    let view = BackupView::new(raw, cbw.clone());
    GranuleDisk {
        _dir: dir,
        before,
        tracker,
        cbw,
        view,
    }
}

#[test]
fn released_granules_free_their_scratch_and_are_no_longer_served() {
    let (granule, region) = (RELEASE_GRANULE, COPY_REGION);
    let size = 3 * granule;
    let GranuleDisk {
        before,
        tracker,
        cbw,
        view,
        ..
    } = granule_disk(2);
    view.discard(0, 0)
        .expect("a zero-length release says releasing is supported");

    tracker.write_at(&[1; 4096], 0).unwrap();
    tracker.write_at(&[2; 4096], region).unwrap();
    assert_eq!(cbw.used(), 2 * region, "the scratch is full");

    // The client stored the first granule; a range cut inside the next two releases neither.
    view.discard(0, granule + 512).unwrap();
    view.discard(granule + 512, granule).unwrap();
    assert_eq!(cbw.used(), 0, "released copies leave the scratch");

    // Their slots serve new copies; a write to a released granule copies nothing.
    tracker.write_at(&[3; 4096], granule).unwrap();
    tracker.write_at(&[4; 4096], 2 * granule).unwrap();
    tracker.write_at(&[5; 4096], 2 * region).unwrap();
    assert_eq!(cbw.used(), 2 * region);
    assert!(cbw.failure().is_none(), "{:?}", cbw.failure());

    let mut buf = vec![0u8; 2 * granule as usize];
    view.read_at(&mut buf, granule).unwrap();
    assert!(
        buf == before[granule as usize..],
        "the rest is still the backup's moment"
    );
    let err = view.read_at(&mut buf[..512], 2 * region).unwrap_err();
    assert!(err.to_string().contains("released"), "{err}");

    // The last granule, cut by the image's end, is released by a range up to the end.
    view.discard(2 * granule, granule).unwrap();
    assert_eq!(cbw.used(), region);
    assert!(view.discard(size - 512, 1024).is_err(), "past the end");
}

#[test]
fn a_release_shorter_than_the_scratch_frees_only_its_own_copies() {
    let regions_per_granule = RELEASE_GRANULE / COPY_REGION;
    let d = granule_disk(regions_per_granule + 50);
    // Every block of granule 0 copied, and 40 of granule 1: the map outgrows a granule's range.
    for n in 0..regions_per_granule + 40 {
        d.tracker.write_at(&[7; 4096], n * COPY_REGION).unwrap();
    }
    assert_eq!(d.cbw.used(), (regions_per_granule + 40) * COPY_REGION);
    d.view.discard(RELEASE_GRANULE, RELEASE_GRANULE).unwrap();
    assert_eq!(
        d.cbw.used(),
        regions_per_granule * COPY_REGION,
        "granule 1's 40 copies only"
    );
    let mut buf = vec![0u8; 4096];
    d.view.read_at(&mut buf, 5 * COPY_REGION).unwrap();
    assert!(
        buf == d.before[5 * 4096..6 * 4096],
        "granule 0 is still served"
    );
    assert!(d.cbw.failure().is_none(), "{:?}", d.cbw.failure());
}
