//! Drives `Server` over a real vhost-user socket with the in-repo frontend in `common`:
//! every request type, the status byte, bad chains, LUKS images and reconnects.
use cryptblk_testutil::vhost_user as common;

use std::sync::Arc;

use common::{pattern, Daemon, Desc, Guest, S_IOERR, S_OK, S_UNSUPP};
use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_vhost_user_blk::ServeOptions;
use cryptblk_volume::{open_luks_volume, VolumeOptions};

const MIB: u64 = 1 << 20;

fn raw_image(dir: &std::path::Path, size: u64) -> std::path::PathBuf {
    let path = dir.join("disk.raw");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(size).unwrap();
    path
}

fn open_raw(path: &std::path::Path, writable: bool) -> Arc<dyn BlockDevice> {
    Arc::new(
        RawFile::open(
            path,
            OpenOptions {
                writable,
                lock: true,
            },
        )
        .unwrap(),
    )
}

fn opts(num_queues: u16) -> ServeOptions {
    ServeOptions {
        num_queues,
        queue_size: 256,
        read_only: false,
        serial: "cryptblk-test-serial-too-long".into(),
        discard: false,
        ..Default::default()
    }
}

fn discard_opts() -> ServeOptions {
    ServeOptions {
        discard: true,
        ..opts(1)
    }
}

#[test]
fn config_space_and_features() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), 8 * MIB);
    let daemon = Daemon::start(open_raw(&img, true), opts(2));
    let mut guest = Guest::connect(&daemon.socket, 2, 256);
    let f = guest.features;
    // VERSION_1, EVENT_IDX, SIZE_MAX, SEG_MAX, BLK_SIZE, FLUSH, TOPOLOGY, CONFIG_WCE, MQ,
    // WRITE_ZEROES.
    for bit in [32u32, 29, 1, 2, 6, 9, 10, 11, 12, 14] {
        assert!(f & (1 << bit) != 0, "feature bit {bit} missing: {f:#x}");
    }
    assert!(f & (1 << 5) == 0, "RO offered for a writable disk");
    assert!(f & (1 << 13) == 0, "DISCARD offered without being enabled");
    let cfg = guest.config(0, 60);
    assert!(cfg[36..48].iter().all(|&b| b == 0), "discard config set");
    assert_eq!(
        u32::from_le_bytes(cfg[48..52].try_into().unwrap()),
        64 * 1024
    );
    assert_eq!(u32::from_le_bytes(cfg[52..56].try_into().unwrap()), 1);
    assert_eq!(
        u64::from_le_bytes(cfg[0..8].try_into().unwrap()),
        8 * MIB / 512
    );
    assert_eq!(u32::from_le_bytes(cfg[8..12].try_into().unwrap()), 1 << 20);
    assert_eq!(u32::from_le_bytes(cfg[12..16].try_into().unwrap()), 254);
    assert_eq!(u32::from_le_bytes(cfg[20..24].try_into().unwrap()), 512);
    // Topology: physical_block_exp 0, alignment_offset 0, min_io_size 1 block, opt 0.
    assert_eq!(cfg[24..32], [0, 0, 1, 0, 0, 0, 0, 0]);
    assert_eq!(cfg[32], 1, "writeback cache on by default");
    assert_eq!(u16::from_le_bytes(cfg[34..36].try_into().unwrap()), 2);
    drop(guest);
    daemon.stop();
}

#[test]
fn raw_write_read_flush_get_id_unsupported() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), 8 * MIB);
    let daemon = Daemon::start(open_raw(&img, true), opts(1));
    let mut guest = Guest::connect(&daemon.socket, 1, 256);

    let data = pattern(64 * 1024, 1);
    assert_eq!(guest.write(0, 100, &data), S_OK);
    let (st, back) = guest.read(0, 100, data.len());
    assert_eq!(st, S_OK);
    assert_eq!(back, data);
    // A read split into small, odd-sized segments (512 multiples in total).
    let (descs, s) = guest.in_chain(0, 101, 4096, 1536);
    guest.run(0, &descs);
    assert_eq!(guest.status(s), S_OK);
    assert_eq!(guest.data_of(&descs), data[512..512 + 4096]);

    assert_eq!(guest.simple(0, common::VIRTIO_BLK_T_FLUSH, 0), S_OK);
    let (st, id) = guest.get_id(0);
    assert_eq!(st, S_OK);
    assert_eq!(&id, b"cryptblk-test-serial");
    assert_eq!(guest.simple(0, 0x1234, 0), S_UNSUPP);
    // DISCARD is not enabled: UNSUPP, with or without its range.
    assert_eq!(guest.simple(0, 11, 0), S_UNSUPP);
    assert_eq!(guest.discard(0, 0, 8, 0), S_UNSUPP);
    // WRITE_ZEROES without its range descriptor.
    assert_eq!(guest.simple(0, 13, 0), S_IOERR);
    // WRITE_ZEROES over sectors 110..118 of the data written at sector 100.
    assert_eq!(guest.write_zeroes(0, 110, 8, 0), S_OK);
    let mut data = data;
    data[10 * 512..18 * 512].fill(0);
    assert_eq!(guest.read(0, 100, data.len()), (S_OK, data.clone()));
    // Unknown range flags are UNSUPP; the unmap flag is accepted (zeroes written anyway).
    assert_eq!(guest.write_zeroes(0, 100, 1, 2), S_UNSUPP);
    assert_eq!(guest.write_zeroes(0, 120, 1, 1), S_OK);
    data[20 * 512..21 * 512].fill(0);
    // Beyond the capacity, and above max_write_zeroes_sectors.
    assert_eq!(guest.write_zeroes(0, 8 * MIB / 512 - 1, 2, 0), S_IOERR);
    assert_eq!(guest.write_zeroes(0, 0, 64 * 1024 + 1, 0), S_IOERR);
    assert_eq!(guest.write_zeroes(0, u64::MAX / 2, 1, 0), S_IOERR);

    drop(guest);
    daemon.stop();
    let on_disk = std::fs::read(&img).unwrap();
    assert_eq!(&on_disk[100 * 512..100 * 512 + data.len()], &data[..]);
}

#[test]
fn out_of_range_and_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), MIB);
    {
        let daemon = Daemon::start(open_raw(&img, true), opts(1));
        let mut guest = Guest::connect(&daemon.socket, 1, 256);
        let sectors = MIB / 512;
        // Last sector is fine, one past it is not, nor a request straddling the end.
        assert_eq!(guest.write(0, sectors - 1, &[7u8; 512]), S_OK);
        assert_eq!(guest.write(0, sectors, &[7u8; 512]), S_IOERR);
        assert_eq!(guest.read(0, sectors - 1, 1024).0, S_IOERR);
        assert_eq!(guest.read(0, u64::MAX / 256, 512).0, S_IOERR);
        // Not a multiple of 512.
        assert_eq!(guest.write(0, 0, &[1u8; 100]), S_IOERR);
        drop(guest);
        daemon.stop();
    }
    let mut o = opts(1);
    o.read_only = true;
    let daemon = Daemon::start(open_raw(&img, false), o);
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    assert!(guest.features & (1 << 5) != 0, "RO not offered");
    assert_eq!(guest.write(0, 0, &[9u8; 512]), S_IOERR);
    assert!(
        guest.features & (1 << 14) == 0,
        "WRITE_ZEROES offered read-only"
    );
    assert_eq!(guest.write_zeroes(0, MIB / 512 - 1, 1, 0), S_IOERR);
    let (st, back) = guest.read(0, MIB / 512 - 1, 512);
    assert_eq!(st, S_OK);
    assert_eq!(back, vec![7u8; 512]);
    drop(guest);
    daemon.stop();
    assert!(std::fs::read(&img).unwrap()[..512].iter().all(|&b| b == 0));
}

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

const PW: &[u8] = b"vhost passphrase";

/// A 4 MiB LUKS2 image with 4096-byte encryption sectors, passphrase `PW`.
fn luks2_image(dir: &std::path::Path) -> std::path::PathBuf {
    let img = dir.join("disk.luks2");
    cryptblk_testutil::luks::cheap_luks2(&img, PW, 4 * MIB, 4096);
    img
}

#[test]
fn luks2_image_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let img = luks2_image(dir.path());
    let rw = VolumeOptions {
        writable: true,
        ..Default::default()
    };
    let volume = open_luks_volume(&img, PW, &rw).unwrap();
    let daemon = Daemon::start(Arc::new(volume), opts(1));
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    let f = guest.features;
    assert!(
        f & (1 << 1) != 0 && f & (1 << 10) != 0,
        "SIZE_MAX/TOPOLOGY: {f:#x}"
    );
    let cfg = guest.config(0, 32);
    assert_eq!(
        u64::from_le_bytes(cfg[0..8].try_into().unwrap()),
        4 * MIB / 512
    );
    assert_eq!(u32::from_le_bytes(cfg[8..12].try_into().unwrap()), 1 << 20);
    assert_eq!(u32::from_le_bytes(cfg[20..24].try_into().unwrap()), 4096);
    // Topology in logical blocks: physical = logical (exp 0), min_io_size one 4 KiB block,
    // so a guest computes io_min = 4096 and issues whole encryption sectors.
    assert_eq!(cfg[24], 0, "physical_block_exp");
    assert_eq!(cfg[25], 0, "alignment_offset");
    assert_eq!(u16::from_le_bytes(cfg[26..28].try_into().unwrap()), 1);
    assert_eq!(u32::from_le_bytes(cfg[28..32].try_into().unwrap()), 0);

    let data = pattern(128 * 1024, 5);
    assert_eq!(guest.write(0, 16, &data), S_OK);
    // A sub-sector (512-byte) write inside a 4096-byte encryption sector.
    let small = pattern(512, 6);
    assert_eq!(guest.write(0, 16 + 3, &small), S_OK);
    let mut want = data.clone();
    want[3 * 512..4 * 512].copy_from_slice(&small);
    assert_eq!(guest.read(0, 16, data.len()), (S_OK, want.clone()));
    // Encrypted zeroes over 512-byte sectors 40..57 (not aligned to the 4096-byte sectors).
    assert_eq!(guest.write_zeroes(0, 40, 17, 0), S_OK);
    want[24 * 512..41 * 512].fill(0);
    assert_eq!(guest.read(0, 16, data.len()), (S_OK, want.clone()));
    assert_eq!(guest.simple(0, common::VIRTIO_BLK_T_FLUSH, 0), S_OK);
    drop(guest);
    daemon.stop();

    // The image decrypts to the same data when opened afresh, and is really encrypted.
    let volume = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap();
    let mut back = vec![0u8; want.len()];
    volume.read_at(&mut back, 16 * 512).unwrap();
    assert_eq!(back, want);
    let raw = std::fs::read(&img).unwrap();
    assert!(!raw.windows(64).any(|w| w == &want[..64]));
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

#[test]
fn without_event_idx_and_with_write_through_cache() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), MIB);
    let daemon = Daemon::start(open_raw(&img, true), opts(1));
    let mut guest = Guest::connect_without(&daemon.socket, 1, 64, 1 << 29);
    assert!(!guest.event_idx());
    // The guest turns the write cache off (CONFIG_WCE): writes are flushed as they complete.
    guest.set_config(32, &[0]);
    assert_eq!(guest.config(32, 1), vec![0]);
    for i in 0..50u64 {
        let data = pattern(4096, i);
        assert_eq!(guest.write(0, i * 8, &data), S_OK);
        assert_eq!(guest.read(0, i * 8, 4096), (S_OK, data));
    }
    guest.set_config(32, &[1]);
    assert_eq!(guest.config(32, 1), vec![1]);
    drop(guest);
    daemon.stop();
}

/// Writes `data` at `sector` in 128 KiB requests (a request must fit the queue).
fn write_big(guest: &mut Guest, sector: u64, data: &[u8]) {
    for (i, chunk) in data.chunks(128 * 1024).enumerate() {
        assert_eq!(guest.write(0, sector + i as u64 * 256, chunk), S_OK);
    }
}

/// Reads `len` bytes at `sector` in 128 KiB requests.
fn read_big(guest: &mut Guest, sector: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut s = sector;
    while out.len() < len {
        let n = (len - out.len()).min(128 * 1024);
        let (st, back) = guest.read(0, s, n);
        assert_eq!(st, S_OK);
        out.extend_from_slice(&back);
        s += n as u64 / 512;
    }
    out
}

/// Allocated bytes of a file (st_blocks is in 512-byte units).
fn allocated(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn discard_is_offered_only_when_enabled_and_writable() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), 8 * MIB);
    {
        let daemon = Daemon::start(open_raw(&img, true), discard_opts());
        let mut guest = Guest::connect(&daemon.socket, 1, 256);
        assert!(guest.features & (1 << 13) != 0, "DISCARD not offered");
        let cfg = guest.config(0, 60);
        let word = |o: usize| u32::from_le_bytes(cfg[o..o + 4].try_into().unwrap());
        assert_eq!(word(36), 64 * 1024, "max_discard_sectors");
        assert_eq!(word(40), 1, "max_discard_seg");
        assert_eq!(word(44), 1, "discard_sector_alignment");
        drop(guest);
        daemon.stop();
    }
    // Read-only export: not offered even when asked for, and DISCARD is UNSUPP.
    let mut o = discard_opts();
    o.read_only = true;
    let daemon = Daemon::start(open_raw(&img, false), o);
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    assert!(guest.features & (1 << 13) == 0, "DISCARD offered read-only");
    assert_eq!(guest.discard(0, 0, 8, 0), S_UNSUPP);
    drop(guest);
    daemon.stop();
}

#[test]
fn discard_on_raw_punches_holes() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), 8 * MIB);
    let daemon = Daemon::start(open_raw(&img, true), discard_opts());
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    let data = pattern(4 * MIB as usize, 21);
    write_big(&mut guest, 0, &data);
    assert_eq!(guest.simple(0, common::VIRTIO_BLK_T_FLUSH, 0), S_OK);
    let before = allocated(&img);
    assert!(before >= 4 * MIB, "{before}");

    // Sectors 2048..4096 (1 MiB at offset 1 MiB).
    assert_eq!(guest.discard(0, 2048, 2048, 0), S_OK);
    let after = allocated(&img);
    assert!(after + MIB <= before, "{before} -> {after}");
    {
        use std::os::unix::io::AsRawFd;
        let f = std::fs::File::open(&img).unwrap();
        // SAFETY: lseek only takes integer arguments on a file descriptor owned by `f`.
        let hole = unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_HOLE) };
        assert_eq!(hole as u64, MIB);
    }
    let back = read_big(&mut guest, 0, 4 * MIB as usize);
    let m = MIB as usize;
    assert_eq!(back[..m], data[..m]);
    assert!(back[m..2 * m].iter().all(|&b| b == 0));
    assert_eq!(back[2 * m..], data[2 * m..]);

    // Flags are not defined for discard; the range must fit the capacity; a zero-length
    // range is a no-op.
    assert_eq!(guest.discard(0, 0, 8, 1), S_UNSUPP);
    assert_eq!(guest.discard(0, 8 * MIB / 512 - 1, 2, 0), S_IOERR);
    assert_eq!(guest.discard(0, u64::MAX / 2, 1, 0), S_IOERR);
    assert_eq!(guest.discard(0, 0, 64 * 1024 + 1, 0), S_IOERR);
    assert_eq!(guest.discard(0, 0, 0, 0), S_OK);
    // Without its range descriptor.
    assert_eq!(guest.simple(0, 11, 0), S_IOERR);
    assert_eq!(read_big(&mut guest, 0, m), data[..m]);
    drop(guest);
    daemon.stop();
}

#[test]
fn discard_on_luks2_keeps_other_sectors() {
    let dir = tempfile::tempdir().unwrap();
    let img = luks2_image(dir.path());
    let rw = VolumeOptions {
        writable: true,
        ..Default::default()
    };
    let volume = open_luks_volume(&img, PW, &rw).unwrap();
    let daemon = Daemon::start(Arc::new(volume), discard_opts());
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    let cfg = guest.config(0, 48);
    // 4096-byte logical blocks: discards aligned to 8 sectors.
    assert_eq!(u32::from_le_bytes(cfg[44..48].try_into().unwrap()), 8);

    let data = pattern(MIB as usize, 22);
    write_big(&mut guest, 0, &data);
    assert_eq!(guest.simple(0, common::VIRTIO_BLK_T_FLUSH, 0), S_OK);
    let before = allocated(&img);
    // Misaligned start or length: IOERR, nothing discarded.
    assert_eq!(guest.discard(0, 4, 256, 0), S_IOERR);
    assert_eq!(guest.discard(0, 256, 255, 0), S_IOERR);
    assert_eq!(read_big(&mut guest, 0, data.len()), data);
    // Sectors 256..768: 256 KiB at offset 128 KiB, whole 4 KiB blocks.
    assert_eq!(guest.discard(0, 256, 512, 0), S_OK);
    assert!(allocated(&img) + 256 * 1024 <= before);
    let back = read_big(&mut guest, 0, data.len());
    let (a, b) = (128 * 1024, 384 * 1024);
    assert_eq!(back[..a], data[..a]);
    assert_eq!(back[b..], data[b..]);
    // Like dm-crypt allow_discards: the discarded range reads as garbage, not the old data.
    assert_ne!(back[a..b], data[a..b]);
    drop(guest);
    daemon.stop();

    // The other sectors still decrypt correctly from a fresh open.
    let volume = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap();
    let mut fresh = vec![0u8; data.len()];
    volume.read_at(&mut fresh, 0).unwrap();
    assert_eq!(fresh[..a], data[..a]);
    assert_eq!(fresh[b..], data[b..]);
}
