//! Drives `Server`'s queues over a real vhost-user socket with the in-repo frontend in
//! `common`: malformed descriptor chains get an error (or nothing) and the queue keeps
//! working, the frontend reconnects, two queues run batches concurrently, and a request stuck
//! in the device on one queue does not hold up the other.
mod common;

use std::sync::Arc;

use common::{open_raw, opts, pattern, raw_image, Daemon, Desc, Guest, MIB, S_IOERR, S_OK};
use cryptblk_block::BlockDevice;

#[test]
fn malformed_chains_get_errors_and_the_queue_keeps_working() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), MIB);
    let daemon = Daemon::start(open_raw(&img, true), opts(1));
    let mut guest = Guest::connect(&daemon.socket, 1, 256);

    // Status descriptor read-only: nothing can be reported, used length 0, status untouched.
    let (mut descs, s) = guest.out_chain(0, 0, &[1u8; 512], 512);
    descs.last_mut().unwrap().write = false;
    assert_eq!(guest.run(0, &descs), 0);
    assert_eq!(guest.status(s), 0xff);
    // Status descriptor longer than one byte.
    let (mut descs, s) = guest.out_chain(0, 0, &[1u8; 512], 512);
    descs.last_mut().unwrap().len = 2;
    assert_eq!(guest.run(0, &descs), 0);
    assert_eq!(guest.status(s), 0xff);
    // Header too short.
    let (mut descs, s) = guest.out_chain(0, 0, &[1u8; 512], 512);
    descs[0].len = 8;
    assert_eq!(guest.run(0, &descs), 1);
    assert_eq!(guest.status(s), S_IOERR);
    // Header device-writable.
    let (mut descs, s) = guest.out_chain(0, 0, &[1u8; 512], 512);
    descs[0].write = true;
    guest.run(0, &descs);
    assert_eq!(guest.status(s), S_IOERR);
    // Data in the wrong direction: OUT with a device-writable buffer, IN with a read-only one.
    let (mut descs, s) = guest.out_chain(0, 0, &[1u8; 512], 512);
    descs[1].write = true;
    guest.run(0, &descs);
    assert_eq!(guest.status(s), S_IOERR);
    let (mut descs, s) = guest.in_chain(0, 0, 512, 512);
    descs[1].write = false;
    guest.run(0, &descs);
    assert_eq!(guest.status(s), S_IOERR);
    // Only one descriptor.
    let s1 = guest.status_buf(0);
    assert_eq!(
        guest.run(
            0,
            &[Desc {
                addr: s1,
                len: 1,
                write: true
            }]
        ),
        0
    );
    // A data buffer outside guest memory.
    let (mut descs, s) = guest.out_chain(0, 0, &[1u8; 512], 512);
    descs[1].addr = vm_memory::GuestAddress(1 << 40);
    guest.run(0, &descs);
    assert_eq!(guest.status(s), S_IOERR);
    // A data descriptor longer than size_max (1 MiB): IOERR, nothing written.
    let big = vec![7u8; (1 << 20) + 512];
    let (descs, s) = guest.out_chain(0, 0, &big, big.len());
    assert_eq!(descs.len(), 3);
    guest.run(0, &descs);
    assert_eq!(guest.status(s), S_IOERR);
    // Exactly size_max is accepted (then overwritten with zeroes below).
    let (descs, s) = guest.out_chain(0, 0, &big[..1 << 20], 1 << 20);
    assert_eq!(descs.len(), 3);
    guest.run(0, &descs);
    assert_eq!(guest.status(s), S_OK);
    let (descs, s) = guest.out_chain(0, 0, &vec![0u8; 1 << 20], 1 << 20);
    guest.run(0, &descs);
    assert_eq!(guest.status(s), S_OK);
    // A status byte outside guest memory.
    let (mut descs, _) = guest.out_chain(0, 0, &[1u8; 512], 512);
    descs.last_mut().unwrap().addr = vm_memory::GuestAddress(1 << 40);
    assert_eq!(guest.run(0, &descs), 0);

    // A chain whose last data descriptor links back to the header: a loop. The queue walks
    // at most the queue size, the chain is too long, nothing is executed.
    let (descs, s) = guest.out_chain(0, 0, &[1u8; 1024], 512);
    let head = guest.publish_linked(0, &descs, &[(2, 0)]);
    guest.kick(0);
    let used = guest.wait_used(0, 1);
    assert_eq!(used, vec![(head, 0)]);
    assert_eq!(guest.status(s), 0xff);

    // None of that wrote anything, and the next valid request works.
    assert!(std::fs::read(&img).unwrap()[..512].iter().all(|&b| b == 0));
    let data = pattern(8192, 3);
    assert_eq!(guest.write(0, 8, &data), S_OK);
    assert_eq!(guest.read(0, 8, 8192), (S_OK, data));
    drop(guest);
    daemon.stop();
}

#[test]
fn reconnect_after_frontend_disconnects() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), MIB);
    let daemon = Daemon::start(open_raw(&img, true), opts(1));
    let data = pattern(4096, 9);
    {
        let mut guest = Guest::connect(&daemon.socket, 1, 256);
        assert_eq!(guest.write(0, 0, &data), S_OK);
    }
    for _ in 0..2 {
        let mut guest = Guest::connect(&daemon.socket, 1, 256);
        assert_eq!(guest.read(0, 0, 4096), (S_OK, data.clone()));
    }
    daemon.stop();
}

#[test]
fn two_queues_concurrently_with_verification() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), 16 * MIB);
    let daemon = Daemon::start(open_raw(&img, true), opts(2));
    let mut guest = Guest::connect(&daemon.socket, 2, 256);
    // Each queue gets its own half of the disk; batches of requests are in flight on both
    // queues at once.
    const BATCH: usize = 16;
    const BS: usize = 16 * 1024;
    let half = 8 * MIB / 512;
    for round in 0..4u64 {
        let mut pending = Vec::new();
        for q in 0..2usize {
            for i in 0..BATCH {
                let sector =
                    q as u64 * half + (round * BATCH as u64 + i as u64) * (BS as u64 / 512);
                let data = pattern(BS, round * 1000 + q as u64 * 100 + i as u64);
                let (descs, s) = guest.out_chain(q, sector, &data, 4096);
                guest.publish(q, &descs);
                pending.push((q, s));
            }
        }
        guest.kick(0);
        guest.kick(1);
        assert_eq!(guest.wait_used(0, BATCH).len(), BATCH);
        assert_eq!(guest.wait_used(1, BATCH).len(), BATCH);
        for (_, s) in pending {
            assert_eq!(guest.status(s), S_OK);
        }
    }
    for round in 0..4u64 {
        for q in 0..2usize {
            for i in 0..BATCH {
                let sector =
                    q as u64 * half + (round * BATCH as u64 + i as u64) * (BS as u64 / 512);
                let want = pattern(BS, round * 1000 + q as u64 * 100 + i as u64);
                let (st, got) = guest.read(1 - q, sector, BS);
                assert_eq!(st, S_OK);
                assert!(got == want, "queue {q} round {round} request {i} differs");
            }
        }
    }
    drop(guest);
    daemon.stop();
}

/// A device whose reads of one sector block until released, to show that a stuck request on
/// one queue does not hold up the other queue (no backend-wide lock across I/O).
struct GateDevice {
    inner: Arc<dyn BlockDevice>,
    gated_offset: u64,
    gate: std::sync::Mutex<bool>,
    cond: std::sync::Condvar,
    entered: std::sync::atomic::AtomicBool,
}

impl GateDevice {
    fn open(&self) {
        *self.gate.lock().unwrap() = true;
        self.cond.notify_all();
    }
}

struct OpenOnDrop(Arc<GateDevice>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

impl BlockDevice for GateDevice {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), cryptblk_block::BlockError> {
        if offset == self.gated_offset {
            self.entered
                .store(true, std::sync::atomic::Ordering::SeqCst);
            let mut open = self.gate.lock().unwrap();
            while !*open {
                open = self.cond.wait(open).unwrap();
            }
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), cryptblk_block::BlockError> {
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), cryptblk_block::BlockError> {
        self.inner.flush()
    }
}

#[test]
fn a_stuck_request_on_one_queue_does_not_block_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), 4 * MIB);
    let gate = Arc::new(GateDevice {
        inner: open_raw(&img, true),
        gated_offset: MIB,
        gate: std::sync::Mutex::new(false),
        cond: std::sync::Condvar::new(),
        entered: std::sync::atomic::AtomicBool::new(false),
    });
    let daemon = Daemon::start(gate.clone(), opts(2));
    // Declared after the daemon so it drops first: a failing assertion must not leave the
    // worker stuck and the daemon's shutdown waiting for it.
    let _release = OpenOnDrop(gate.clone());
    let mut guest = Guest::connect(&daemon.socket, 2, 256);

    // Queue 0: a read that blocks inside the device.
    let (stuck, stuck_status) = guest.in_chain(0, MIB / 512, 4096, 4096);
    guest.publish(0, &stuck);
    guest.kick(0);
    let t0 = std::time::Instant::now();
    while !gate.entered.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Queue 1 keeps working meanwhile.
    let data = pattern(16 * 1024, 21);
    for i in 0..8 {
        assert_eq!(guest.write(1, i * 32, &data), S_OK);
        assert_eq!(guest.read(1, i * 32, data.len()), (S_OK, data.clone()));
    }
    assert_eq!(
        guest.status(stuck_status),
        0xff,
        "gated read finished early"
    );
    gate.open();
    assert_eq!(guest.wait_used(0, 1).len(), 1);
    assert_eq!(guest.status(stuck_status), S_OK);
    drop(guest);
    daemon.stop();
}
