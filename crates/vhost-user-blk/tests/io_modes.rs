//! The asynchronous data path under the in-repo frontend: guest buffers that are misaligned
//! or split encryption sectors, in every cache mode and with both aio engines, on a real
//! filesystem; device errors becoming IOERR while the disk keeps serving; FLUSH ordering.
use cryptblk_testutil::vhost_user as common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::{pattern, Daemon, Guest, S_IOERR, S_OK};
use cryptblk_block::{
    AioEngine, BlockDevice, BlockError, CacheMode, IoSettings, OpenOptions, RawFile,
};
use cryptblk_vhost_user_blk::ServeOptions;
use cryptblk_volume::{open_luks_volume, VolumeOptions};

const MIB: u64 = 1 << 20;
const PW: &[u8] = b"io modes passphrase";

fn opts(num_queues: u16) -> ServeOptions {
    ServeOptions {
        num_queues,
        queue_size: 256,
        serial: "io-modes".into(),
        ..Default::default()
    }
}

/// A directory on a real filesystem, where O_DIRECT works (unlike tmpfs).
fn disk_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn luks2_image(dir: &std::path::Path) -> std::path::PathBuf {
    let img = dir.join("disk.luks2");
    cryptblk_testutil::luks::cheap_luks2(&img, PW, 4 * MIB, 4096);
    img
}

fn open(img: &std::path::Path, luks: bool, io: IoSettings) -> Arc<dyn BlockDevice> {
    if luks {
        let rw = VolumeOptions {
            writable: true,
            io,
            ..Default::default()
        };
        Arc::new(open_luks_volume(img, PW, &rw).unwrap())
    } else {
        let rw = OpenOptions {
            writable: true,
            lock: true,
        };
        Arc::new(RawFile::open_with(img, rw, io).unwrap())
    }
}

/// Writes and reads back through buffers the guest lays out badly: 16-byte aligned (never
/// page-aligned) and cut into pieces that split 512-byte and 4096-byte sectors.
#[test]
fn misaligned_and_sector_splitting_buffers_in_every_mode() {
    let dir = disk_dir();
    for luks in [false, true] {
        for aio in AioEngine::ALL {
            for cache in [CacheMode::None, CacheMode::Writeback, CacheMode::Directsync] {
                let img = if luks {
                    luks2_image(dir.path())
                } else {
                    let p = dir.path().join("disk.raw");
                    std::fs::File::create(&p).unwrap().set_len(4 * MIB).unwrap();
                    p
                };
                let what = format!("{}/{aio}/{cache}", if luks { "luks2" } else { "raw" });
                let device = open(&img, luks, IoSettings { cache, aio });
                let daemon = Daemon::start(device, opts(1));
                let mut guest = Guest::connect(&daemon.socket, 1, 256);
                // Five 16 KiB writes side by side, read back as one 80 KiB range (the chains
                // must fit the 256-entry queue).
                let mut want = vec![0u8; 80 * 1024];
                for (i, seg) in [4096usize, 1000, 512, 3000, 65536].into_iter().enumerate() {
                    let data = pattern(16 * 1024, i as u64 + 1);
                    let sector = 32 * i as u64;
                    let (descs, status) = guest.out_chain(0, sector, &data, seg);
                    guest.run(0, &descs);
                    assert_eq!(
                        guest.status(status),
                        S_OK,
                        "{what}: write in {seg}-byte pieces"
                    );
                    let at = sector as usize * 512;
                    want[at..at + data.len()].copy_from_slice(&data);
                }
                for seg in [777usize, 4096, 12288] {
                    let (descs, status) = guest.in_chain(0, 0, want.len(), seg);
                    guest.run(0, &descs);
                    assert_eq!(
                        guest.status(status),
                        S_OK,
                        "{what}: read in {seg}-byte pieces"
                    );
                    assert!(
                        guest.data_of(&descs) == want,
                        "{what}: read in {seg}-byte pieces"
                    );
                }
                assert_eq!(guest.simple(0, common::VIRTIO_BLK_T_FLUSH, 0), S_OK);
                drop(guest);
                daemon.stop();
                let fresh = open(&img, luks, IoSettings::default());
                let mut back = vec![0u8; want.len()];
                fresh.read_at(&mut back, 0).unwrap();
                assert!(back == want, "{what}: reopened image differs");
                drop(fresh);
                std::fs::remove_file(&img).unwrap();
            }
        }
    }
}

/// A device that fails every read and write touching one range, like a bad spot on a disk.
struct FaultyDevice {
    inner: Arc<dyn BlockDevice>,
    bad: std::ops::Range<u64>,
}

impl FaultyDevice {
    fn check(&self, op: &'static str, offset: u64, len: usize) -> Result<(), BlockError> {
        if offset < self.bad.end && offset + len as u64 > self.bad.start {
            let eio = std::io::Error::from_raw_os_error(libc::EIO);
            return Err(BlockError::io(op, eio).at(offset));
        }
        Ok(())
    }
}

impl BlockDevice for FaultyDevice {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.check("read", offset, buf.len())?;
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        self.check("write", offset, buf.len())?;
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.inner.flush()
    }
}

#[test]
fn device_errors_become_ioerr_and_the_disk_keeps_serving() {
    let dir = disk_dir();
    let p = dir.path().join("disk.raw");
    std::fs::File::create(&p).unwrap().set_len(4 * MIB).unwrap();
    let inner = open(&p, false, IoSettings::default());
    let device = Arc::new(FaultyDevice {
        inner,
        bad: MIB..MIB + 4096,
    });
    let daemon = Daemon::start(device, opts(2));
    let mut guest = Guest::connect(&daemon.socket, 2, 256);
    let data = pattern(8192, 3);
    let bad_sector = MIB / 512;
    for q in 0..2 {
        assert_eq!(guest.write(q, bad_sector, &data), S_IOERR);
        assert_eq!(guest.read(q, bad_sector - 4, 4096).0, S_IOERR);
        // Next to the bad spot, and after the errors, everything works.
        assert_eq!(guest.write(q, bad_sector + 8, &data), S_OK);
        assert_eq!(guest.read(q, bad_sector + 8, 8192), (S_OK, data.clone()));
        assert_eq!(guest.simple(q, common::VIRTIO_BLK_T_FLUSH, 0), S_OK);
    }
    drop(guest);
    // The daemon is alive: a new frontend connects and is served.
    let mut guest = Guest::connect(&daemon.socket, 2, 256);
    assert_eq!(guest.read(1, bad_sector + 8, 8192), (S_OK, data));
    drop(guest);
    daemon.stop();
}

/// Records the order in which writes finish and flushes start.
struct RecordingDevice {
    inner: Arc<dyn BlockDevice>,
    clock: AtomicU64,
    /// (sequence number when the write finished, offset).
    writes_done: Mutex<Vec<(u64, u64)>>,
    flushes_started: Mutex<Vec<u64>>,
}

impl BlockDevice for RecordingDevice {
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
        // Slow enough that writes of one batch overlap.
        std::thread::sleep(std::time::Duration::from_millis(2));
        self.inner.write_at(buf, offset)?;
        let t = self.clock.fetch_add(1, Ordering::SeqCst);
        self.writes_done.lock().unwrap().push((t, offset));
        Ok(())
    }
    fn flush(&self) -> Result<(), BlockError> {
        let t = self.clock.fetch_add(1, Ordering::SeqCst);
        self.flushes_started.lock().unwrap().push(t);
        self.inner.flush()
    }
}

/// FLUSH covers every write the guest saw completed before it sent the FLUSH, even with many
/// writes in flight at once and completing out of order.
#[test]
fn flush_comes_after_every_write_acknowledged_before_it() {
    let dir = disk_dir();
    let p = dir.path().join("disk.raw");
    std::fs::File::create(&p).unwrap().set_len(4 * MIB).unwrap();
    let device = Arc::new(RecordingDevice {
        inner: open(&p, false, IoSettings::default()),
        clock: AtomicU64::new(0),
        writes_done: Mutex::new(Vec::new()),
        flushes_started: Mutex::new(Vec::new()),
    });
    let daemon = Daemon::start(device.clone(), opts(1));
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    for round in 0..5u64 {
        // 32 writes published at once, all acknowledged, then a flush.
        for i in 0..32u64 {
            let (descs, _) = guest.out_chain(0, (round * 32 + i) * 16, &pattern(8192, i), 4096);
            guest.publish(0, &descs);
        }
        guest.kick(0);
        assert_eq!(guest.wait_used(0, 32).len(), 32);
        let acknowledged = device.clock.load(Ordering::SeqCst);
        assert_eq!(guest.simple(0, common::VIRTIO_BLK_T_FLUSH, 0), S_OK);
        let flush_started = *device.flushes_started.lock().unwrap().last().unwrap();
        let writes = device.writes_done.lock().unwrap();
        assert_eq!(writes.len() as u64, 32 * (round + 1));
        assert!(
            writes.iter().all(|&(t, _)| t < flush_started) && acknowledged <= flush_started,
            "round {round}: a write acknowledged before the FLUSH finished after it started"
        );
    }
    drop(guest);
    daemon.stop();
}
