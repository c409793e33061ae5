//! Restarting the daemon under a running guest, deterministically: the daemon runs in a child
//! process (this test binary again, `restart_daemon_process`) on a LUKS2 image, and is aborted
//! at a chosen crash point (`fault::Point`, compiled in for these tests only) while a device
//! that never completes one request per queue keeps completions out of order. The in-repo
//! frontend keeps guest memory and the inflight region and reconnects to a fresh daemon the
//! way QEMU 7.2 does (SET_VRING_BASE = used->idx). Every request must complete exactly once,
//! with its data, the new daemon must signal the guest when the rings start, and the rings
//! must go on working.
use cryptblk_testutil::vhost_user as common;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{pattern, Guest, S_OK, VIRTIO_BLK_T_FLUSH};
use cryptblk_block::{BlockDevice, BlockError};
use cryptblk_vhost_user_blk::fault::{self, Point};
use cryptblk_vhost_user_blk::{ServeOptions, Server};
use cryptblk_volume::{open_luks_volume, VolumeOptions};
use vm_memory::GuestAddress;

const MIB: u64 = 1 << 20;
const PW: &[u8] = b"restart passphrase";
const QUEUES: u16 = 2;
const QUEUE_SIZE: u16 = 64;
/// Bytes per write (one 4 KiB encryption sector each, 8 sectors apart).
const WRITE: usize = 4096;

/// Environment of the daemon process.
const ENV_SOCKET: &str = "RESTART_TEST_SOCKET";
const ENV_IMAGE: &str = "RESTART_TEST_IMAGE";
/// Byte offsets (comma-separated) whose writes never complete.
const ENV_HOLD: &str = "RESTART_TEST_HOLD";

/// A 4 MiB LUKS2 image, aes-xts-plain64 with 4096-byte sectors, passphrase `PW`.
fn luks2_image(dir: &Path) -> PathBuf {
    let img = dir.join("disk.luks2");
    cryptblk_testutil::luks::cheap_luks2(&img, PW, 4 * MIB, 4096);
    img
}

/// The device of the daemon process: the volume, except that writes at the held offsets
/// block for good (until the process is aborted), so other requests complete around them.
struct HoldingDevice {
    inner: Arc<dyn BlockDevice>,
    hold: Vec<u64>,
}

impl BlockDevice for HoldingDevice {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        if self.hold.contains(&offset) {
            loop {
                std::thread::park();
            }
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.inner.flush()
    }
}

/// The daemon process the tests start (this binary run with `--ignored --exact` and the
/// environment above); does nothing when run any other way.
#[test]
#[ignore = "the daemon process of the restart tests, which start it themselves"]
fn restart_daemon_process() {
    let (Ok(socket), Ok(image)) = (std::env::var(ENV_SOCKET), std::env::var(ENV_IMAGE)) else {
        eprintln!("not started by the restart tests: nothing to do");
        return;
    };
    let hold = std::env::var(ENV_HOLD)
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let rw = VolumeOptions {
        writable: true,
        ..Default::default()
    };
    let volume = open_luks_volume(Path::new(&image), PW, &rw).unwrap();
    let device = Arc::new(HoldingDevice {
        inner: Arc::new(volume),
        hold,
    });
    let opts = ServeOptions {
        num_queues: QUEUES,
        queue_size: QUEUE_SIZE,
        ..Default::default()
    };
    Server::bind(&socket, device, opts).unwrap().run().unwrap();
}

/// A daemon process, killed when dropped.
struct DaemonProcess {
    child: Child,
    log: PathBuf,
}

impl DaemonProcess {
    /// Starts the daemon on `socket` and waits for its socket; `abort_at` is the crash point
    /// and its count, `hold` the byte offsets whose writes never complete.
    fn start(
        dir: &Path,
        image: &Path,
        socket: &Path,
        abort_at: Option<(Point, u32)>,
        hold: &[u64],
    ) -> DaemonProcess {
        let _ = std::fs::remove_file(socket);
        let log = dir.join(format!("daemon-{}.log", unique()));
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "restart_daemon_process",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env(ENV_SOCKET, socket)
        .env(ENV_IMAGE, image)
        .env(
            ENV_HOLD,
            hold.iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(","),
        )
        .env_remove(fault::ENV)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(&log).unwrap());
        if let Some((point, nth)) = abort_at {
            cmd.env(fault::ENV, format!("{}:{nth}", point.name()));
        }
        let mut child = cmd.spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "daemon exited {status}: {}",
                    std::fs::read_to_string(&log).unwrap()
                );
            }
            assert!(
                Instant::now() < deadline,
                "daemon never bound {}",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        DaemonProcess { child, log }
    }

    /// Waits for the daemon to abort at its crash point.
    fn wait_abort(mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "the daemon did not reach its crash point: {}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(
            status.signal(),
            Some(libc::SIGABRT),
            "daemon ended {status} instead of aborting: {}",
            self.output()
        );
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// A request of the batch: which queue, its head, where its status goes, and what it does.
struct Sent {
    queue: usize,
    head: u16,
    status: GuestAddress,
    /// Sector written, with its data; or, for a read, the sector, the data expected and
    /// where it lands.
    write: Option<(u64, Vec<u8>)>,
    read: Option<(u64, Vec<u8>, Vec<common::Desc>)>,
}

/// First sector of request `i` of queue `q` (4 KiB apart, queues apart).
fn sector(q: usize, i: u64) -> u64 {
    (q as u64 * 64 + i) * 8
}

/// The requests each queue gets, all published before one kick.
#[derive(Clone, Copy)]
struct Batch {
    writes: u64,
    /// Reads of data a healthy daemon wrote before, after the writes.
    reads: u64,
    /// The first write of each queue never completes on a daemon that is to crash.
    hold_first: bool,
}

/// The usual batch: six writes (the first held) and two reads per queue.
const BATCH: Batch = Batch {
    writes: 6,
    reads: 2,
    hold_first: true,
};

/// Daemons are aborted at `crashes` in turn (a point and its count) under `batch`: the
/// first while the batch runs, the others while they recover it. A last daemon must then
/// finish everything.
fn crash_and_recover(batch: Batch, crashes: &[(Point, u32)]) {
    let point = crashes[0].0;
    let dir = tempfile::tempdir().unwrap();
    let image = luks2_image(dir.path());
    let socket = dir.path().join("vub.sock");
    let held: Vec<u64> = if batch.hold_first {
        (0..usize::from(QUEUES))
            .map(|q| sector(q, 0) * 512)
            .collect()
    } else {
        Vec::new()
    };
    let per_queue = batch.writes + batch.reads;

    // Setup: what the batch's reads will read, through a healthy daemon.
    let daemon = DaemonProcess::start(dir.path(), &image, &socket, None, &[]);
    let mut guest = Guest::connect_inflight(&socket, QUEUES, QUEUE_SIZE);
    for q in 0..usize::from(QUEUES) {
        for i in batch.writes..per_queue {
            let data = pattern(WRITE, 1000 + sector(q, i));
            assert_eq!(guest.write(q, sector(q, i), &data), S_OK);
        }
    }
    drop(daemon);

    let mut daemon = DaemonProcess::start(dir.path(), &image, &socket, Some(crashes[0]), &held);
    guest.reconnect(&socket);
    let mut sent = Vec::new();
    for q in 0..usize::from(QUEUES) {
        for i in 0..per_queue {
            let s = sector(q, i);
            if i < batch.writes {
                let data = pattern(WRITE, s);
                let (descs, status) = guest.out_chain(q, s, &data, WRITE);
                let head = guest.publish(q, &descs);
                sent.push(Sent {
                    queue: q,
                    head,
                    status,
                    write: Some((s, data)),
                    read: None,
                });
            } else {
                let (descs, status) = guest.in_chain(q, s, WRITE, 1024);
                let head = guest.publish(q, &descs);
                let want = pattern(WRITE, 1000 + s);
                sent.push(Sent {
                    queue: q,
                    head,
                    status,
                    write: None,
                    read: Some((s, want, descs)),
                });
            }
        }
    }
    for q in 0..usize::from(QUEUES) {
        guest.kick(q);
    }
    let mut used: BTreeMap<(usize, u16), u32> = BTreeMap::new();
    let record = |guest: &mut Guest, used: &mut BTreeMap<(usize, u16), u32>| {
        for q in 0..usize::from(QUEUES) {
            for (head, len) in guest.take_used(q) {
                assert!(
                    used.insert((q, head), len).is_none(),
                    "queue {q}: head {head} completed twice ({point:?})"
                );
            }
        }
    };
    for i in 0..crashes.len() {
        daemon.wait_abort();
        record(&mut guest, &mut used);
        for q in 0..usize::from(QUEUES) {
            guest.clear_call(q);
        }
        let next = crashes.get(i + 1).copied();
        // A daemon that is to crash again holds the same writes; the last one holds nothing.
        let hold: &[u64] = if next.is_some() { &held } else { &[] };
        daemon = DaemonProcess::start(dir.path(), &image, &socket, next, hold);
        guest.reconnect(&socket);
        if next.is_none() {
            // The restarted rings signal the guest even when nothing new completes.
            for q in 0..usize::from(QUEUES) {
                assert!(
                    guest.wait_call(q, Duration::from_secs(10)),
                    "queue {q}: no signal after the ring restarted ({point:?})"
                );
            }
        }
    }

    // Every request of the batch completes exactly once, and nothing else does.
    let deadline = Instant::now() + Duration::from_secs(20);
    while used.len() < sent.len() {
        assert!(
            Instant::now() < deadline,
            "{} of {} requests completed after the restart ({point:?}): {:?}\n{}",
            used.len(),
            sent.len(),
            used.keys().collect::<Vec<_>>(),
            daemon.output()
        );
        std::thread::sleep(Duration::from_millis(10));
        record(&mut guest, &mut used);
    }
    std::thread::sleep(Duration::from_millis(200));
    record(&mut guest, &mut used);
    assert_eq!(
        used.len(),
        sent.len(),
        "more completions than requests ({point:?})"
    );
    for r in &sent {
        let len = used[&(r.queue, r.head)];
        assert_eq!(
            guest.status(r.status),
            S_OK,
            "queue {} head {}",
            r.queue,
            r.head
        );
        if let Some((s, want, descs)) = &r.read {
            assert_eq!(len as usize, WRITE + 1);
            assert!(
                guest.data_of(descs) == *want,
                "read of sector {s} after the restart"
            );
        } else {
            assert_eq!(len, 1);
        }
    }
    // The rings go on: every write of the batch reads back, a flush and new writes work.
    for r in &sent {
        if let Some((s, data)) = &r.write {
            assert_eq!(
                guest.read(r.queue, *s, WRITE),
                (S_OK, data.clone()),
                "sector {s}"
            );
        }
    }
    for q in 0..usize::from(QUEUES) {
        assert_eq!(guest.simple(q, VIRTIO_BLK_T_FLUSH, 0), S_OK);
        let data = pattern(WRITE, 77 + q as u64);
        assert_eq!(guest.write(q, 1000, &data), S_OK);
        assert_eq!(guest.read(q, 1000, WRITE), (S_OK, data));
    }
    drop(guest);
    drop(daemon);
    // And the image holds it: opened afresh, the volume decrypts every write of the batch.
    let volume = open_luks_volume(&image, PW, &VolumeOptions::default()).unwrap();
    for r in &sent {
        if let Some((s, data)) = &r.write {
            let mut buf = vec![0u8; WRITE];
            volume.read_at(&mut buf, s * 512).unwrap();
            assert!(buf == *data, "sector {s} on the image");
        }
    }
}

#[test]
fn killed_after_taking_a_request_before_marking_it() {
    crash_and_recover(BATCH, &[(Point::Popped, 3)]);
}

#[test]
fn killed_after_marking_every_request() {
    let all = QUEUES as u32 * (BATCH.writes + BATCH.reads) as u32;
    crash_and_recover(BATCH, &[(Point::Marked, all)]);
}

#[test]
fn killed_before_a_completion_reaches_the_used_ring() {
    crash_and_recover(BATCH, &[(Point::Completing, 3)]);
}

#[test]
fn killed_between_the_used_ring_and_the_record() {
    crash_and_recover(BATCH, &[(Point::Used, 3)]);
}

#[test]
fn killed_with_completions_on_the_used_ring_not_signalled() {
    crash_and_recover(BATCH, &[(Point::BeforeSignal, 1)]);
}

/// The hang: every request taken is on the used ring but the daemon died before
/// signalling, so only the restarted ring's own signal tells the guest.
#[test]
fn killed_after_completing_everything_before_signalling() {
    let one_write = Batch {
        writes: 1,
        reads: 0,
        hold_first: false,
    };
    crash_and_recover(one_write, &[(Point::BeforeSignal, 1)]);
}

#[test]
fn killed_again_while_resubmitting() {
    crash_and_recover(BATCH, &[(Point::Used, 4), (Point::Used, 1)]);
}

/// A device whose writes take a while, counting the writes begun.
struct SlowDevice {
    inner: Arc<dyn BlockDevice>,
    begun: std::sync::atomic::AtomicUsize,
}

impl BlockDevice for SlowDevice {
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
        self.begun.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(150));
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.inner.flush()
    }
}

/// A clean stop (SIGTERM) under load: by the time the socket closes, every request the
/// daemon took is on the used ring and the guest was signalled, so a frontend that restarts
/// the rings at used->idx (QEMU, even without an inflight region) repeats and loses nothing.
#[test]
fn stop_answers_and_signals_every_request_taken_before_closing() {
    use cryptblk_block::{OpenOptions, RawFile};
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.raw");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    let open = || -> Arc<dyn BlockDevice> {
        let opts = OpenOptions {
            writable: true,
            lock: true,
        };
        Arc::new(RawFile::open(&img, opts).unwrap())
    };
    let slow = Arc::new(SlowDevice {
        inner: open(),
        begun: Default::default(),
    });
    let opts = ServeOptions {
        queue_size: QUEUE_SIZE,
        ..Default::default()
    };
    let daemon = common::Daemon::start(slow.clone(), opts.clone());
    let mut guest = Guest::connect(&daemon.socket, 1, QUEUE_SIZE);
    let mut sent = Vec::new();
    for i in 0..12 {
        let data = pattern(WRITE, 500 + i);
        let (descs, status) = guest.out_chain(0, i * 8, &data, WRITE);
        sent.push((guest.publish(0, &descs), status, i * 8, data));
    }
    guest.kick(0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while slow.begun.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the daemon took no request");
        std::thread::sleep(Duration::from_millis(1));
    }
    guest.clear_call(0);
    // Returns once the connection is closed.
    daemon.stop_handle().stop();
    let used_at_close = guest.take_used(0);
    assert!(
        !used_at_close.is_empty(),
        "nothing completed before the close"
    );
    assert!(
        guest.wait_call(0, Duration::from_secs(0)),
        "completions were not signalled before the close"
    );
    daemon.stop();
    assert!(
        guest.take_used(0).is_empty(),
        "requests completed after the connection closed"
    );
    assert_eq!(
        used_at_close.len(),
        slow.begun.load(Ordering::SeqCst),
        "a request taken was not answered before the close"
    );

    // A new daemon, the rings restarted at used->idx with no inflight region: every request
    // completes exactly once.
    drop(slow);
    let daemon = common::Daemon::start(open(), opts);
    guest.reconnect(&daemon.socket);
    let mut heads: Vec<u16> = used_at_close.iter().map(|u| u.0).collect();
    heads.extend(
        guest
            .wait_used(0, sent.len() - heads.len())
            .iter()
            .map(|u| u.0),
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(guest.take_used(0).is_empty(), "a request completed twice");
    heads.sort_unstable();
    let mut want: Vec<u16> = sent.iter().map(|s| s.0).collect();
    want.sort_unstable();
    assert_eq!(heads, want);
    for (_, status, sector, data) in &sent {
        assert_eq!(guest.status(*status), S_OK);
        assert_eq!(guest.read(0, *sector, WRITE), (S_OK, data.clone()));
    }
    daemon.stop();
}
