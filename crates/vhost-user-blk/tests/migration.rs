//! Live-migration support, driven over a real vhost-user socket by the in-repo frontend:
//! the dirty page log (VHOST_F_LOG_ALL, LOG_SHMFD, SET_LOG_BASE) gets exactly the guest pages
//! the device writes, and the `FrontendEvent` listener reports queue starts and stops with
//! whether dirty logging was on.
use cryptblk_testutil::vhost_user as common;

use std::collections::BTreeSet;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use common::{pattern, Daemon, Desc, Guest, MEM_SIZE, S_OK};
use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_vhost_user_blk::{FrontendEvent, ServeOptions};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::VhostUserFrontend;
use vhost::{VhostBackend, VhostUserDirtyLogRegion};
use vm_memory::{Address, Bytes, GuestAddress};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;
const LOG_ALL: u64 = VhostUserVirtioFeatures::LOG_ALL.bits();

fn raw_device(dir: &std::path::Path, data: &[u8]) -> Arc<dyn BlockDevice> {
    let path = dir.join("disk.raw");
    std::fs::write(&path, data).unwrap();
    Arc::new(
        RawFile::open(
            &path,
            OpenOptions {
                writable: true,
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
        serial: "migration-serial".into(),
        ..ServeOptions::default()
    }
}

/// The frontend's dirty log: one bit per 4 KiB guest page, in a memfd shared with the daemon.
struct DirtyLog {
    file: File,
    len: u64,
}

impl DirtyLog {
    /// Sealed against resizing, as QEMU's `vhost_log_alloc` makes it.
    fn new() -> DirtyLog {
        DirtyLog::with_seals(libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL)
    }

    fn with_seals(seals: libc::c_int) -> DirtyLog {
        // SAFETY: the name is a valid NUL-terminated string; the descriptor is checked and
        // then owned by the `File`.
        let fd = unsafe {
            libc::memfd_create(
                c"cryptblk-log".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let len = (MEM_SIZE / PAGE / 8).next_multiple_of(PAGE);
        file.set_len(len).unwrap();
        if seals != 0 {
            // SAFETY: fcntl(F_ADD_SEALS) on the memfd made above, integer argument.
            let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
            assert_eq!(rc, 0, "F_ADD_SEALS: {}", std::io::Error::last_os_error());
        }
        DirtyLog { file, len }
    }

    /// SET_LOG_BASE with this log.
    fn share(&self, guest: &Guest) {
        guest
            .frontend
            .set_log_base(
                0,
                Some(VhostUserDirtyLogRegion {
                    mmap_size: self.len,
                    mmap_offset: 0,
                    mmap_handle: self.file.as_raw_fd(),
                }),
            )
            .unwrap();
    }

    fn clear(&self) {
        self.file
            .write_all_at(&vec![0u8; self.len as usize], 0)
            .unwrap();
    }

    /// Numbers of the pages marked dirty.
    fn dirty_pages(&self) -> BTreeSet<u64> {
        let mut bits = vec![0u8; self.len as usize];
        self.file.read_exact_at(&mut bits, 0).unwrap();
        let mut pages = BTreeSet::new();
        for (i, byte) in bits.iter().enumerate() {
            for b in 0..8 {
                if byte & (1 << b) != 0 {
                    pages.insert(i as u64 * 8 + b);
                }
            }
        }
        pages
    }
}

/// Pages covered by `[addr, addr + len)`.
fn pages(addr: GuestAddress, len: u64) -> impl Iterator<Item = u64> {
    addr.0 / PAGE..=(addr.0 + len - 1) / PAGE
}

/// The used ring of a 256-entry queue: flags, idx, 256 elements, avail_event.
const USED_RING_LEN: u64 = 4 + 8 * 256 + 2;

#[test]
fn dirty_log_gets_exactly_the_pages_the_device_writes() {
    let dir = tempfile::tempdir().unwrap();
    let disk = pattern((4 * MIB) as usize, 7);
    let daemon = Daemon::start(raw_device(dir.path(), &disk), opts(1));
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    assert!(guest.features & LOG_ALL != 0, "LOG_ALL not offered");
    let proto = guest.frontend.get_protocol_features().unwrap();
    assert!(proto.contains(VhostUserProtocolFeatures::LOG_SHMFD));
    assert!(daemon.stop_handle().dirty_logging());

    // Before SET_LOG_BASE the device works (and has no log to mark).
    let (status, data) = guest.read(0, 0, 4096);
    assert_eq!(status, S_OK);
    assert_eq!(data, disk[..4096]);

    let log = DirtyLog::new();
    log.share(&guest);
    // At most the used ring, where the queue thread may still be re-enabling notifications
    // (EVENT_IDX's avail_event) after the last request.
    let used_page = guest.used_ring(0).0 / PAGE;
    let dirty = log.dirty_pages();
    assert!(dirty.iter().all(|&p| p == used_page), "{dirty:?}");

    // A three-segment read: 8 KiB + 512 + 4 KiB at sector 16.
    let h = guest.header(0, common::VIRTIO_BLK_T_IN, 16);
    let mut descs = vec![Desc {
        addr: h,
        len: 16,
        write: false,
    }];
    for len in [8192u32, 512, 4096] {
        let addr = guest.alloc(0, len);
        descs.push(Desc {
            addr,
            len,
            write: true,
        });
    }
    let status_addr = guest.status_buf(0);
    descs.push(Desc {
        addr: status_addr,
        len: 1,
        write: true,
    });
    // The frontend's own writes (header, zeroed buffers) are not the device's: start clean.
    log.clear();
    let used = guest.run(0, &descs);
    assert_eq!(used, 8192 + 512 + 4096 + 1);
    assert_eq!(guest.status(status_addr), S_OK);
    assert_eq!(guest.data_of(&descs), disk[16 * 512..16 * 512 + 12800]);

    let mut expected = BTreeSet::new();
    for d in &descs[1..] {
        expected.extend(pages(d.addr, u64::from(d.len)));
    }
    expected.extend(pages(guest.used_ring(0), USED_RING_LEN));
    let dirty = log.dirty_pages();
    assert_eq!(
        dirty, expected,
        "dirty pages (data, status, used ring) after a read"
    );
    // The header and descriptor table are only read by the device.
    assert!(!dirty.contains(&(guest.desc_table(0).0 / PAGE)));

    // GET_ID: the ID buffer, the status byte and the used ring.
    log.clear();
    let (status, id) = guest.get_id(0);
    assert_eq!(status, S_OK);
    assert_eq!(&id[..16], b"migration-serial");
    let dirty = log.dirty_pages();
    assert!(dirty.contains(&(guest.used_ring(0).0 / PAGE)), "{dirty:?}");
    // Everything GET_ID wrote lies in the last allocations of the data area.
    assert!(dirty.len() <= 3, "{dirty:?}");
    let data_pages: BTreeSet<u64> = dirty
        .iter()
        .copied()
        .filter(|&p| p != guest.used_ring(0).0 / PAGE)
        .collect();
    assert!(!data_pages.is_empty(), "GET_ID buffer not logged");

    // A write request only dirties its status byte and the used ring, not its data.
    let payload = pattern(8192, 9);
    let (descs, status_addr) = guest.out_chain(0, 64, &payload, 4096);
    log.clear();
    assert_eq!(guest.run(0, &descs), 1);
    assert_eq!(guest.status(status_addr), S_OK);
    let mut expected: BTreeSet<u64> = pages(status_addr, 1).collect();
    expected.extend(pages(guest.used_ring(0), USED_RING_LEN));
    assert_eq!(log.dirty_pages(), expected, "dirty pages after a write");
    daemon.stop();
}

/// A dirty log its frontend could truncate (an unsealed memfd) would SIGBUS the daemon on the
/// next device write to guest memory: SET_LOG_BASE refuses it and that connection ends, while
/// another disk of the same process keeps serving and the refused disk takes a frontend with a
/// sealed log next.
#[test]
fn a_dirty_log_that_could_shrink_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let disk = pattern((4 * MIB) as usize, 5);
    let a = Daemon::start(raw_device(dir.path(), &disk), opts(1));
    let other = tempfile::tempdir().unwrap();
    let b = Daemon::start(raw_device(other.path(), &disk), opts(1));
    let mut on_b = Guest::connect(&b.socket, 1, 256);
    assert_eq!(on_b.read(0, 0, 4096).0, S_OK);

    let guest = Guest::connect(&a.socket, 1, 256);
    let unsealed = DirtyLog::with_seals(0);
    let sent = guest.frontend.set_log_base(
        0,
        Some(VhostUserDirtyLogRegion {
            mmap_size: unsealed.len,
            mmap_offset: 0,
            mmap_handle: unsealed.file.as_raw_fd(),
        }),
    );
    // Without REPLY_ACK the message gets no answer: the refusal shows as the daemon closing
    // the connection, so the next request fails.
    let next = guest.frontend.get_features();
    assert!(
        sent.is_err() || next.is_err(),
        "an unsealed memfd was accepted as the dirty log"
    );
    drop(guest);

    let (status, data) = on_b.read(0, 8, 4096);
    assert_eq!((status, &data[..]), (S_OK, &disk[4096..8192]));
    let mut guest = Guest::connect(&a.socket, 1, 256);
    let log = DirtyLog::new();
    log.share(&guest);
    let (status, data) = guest.read(0, 16, 4096);
    assert_eq!((status, &data[..]), (S_OK, &disk[8192..12288]));
    drop((guest, on_b));
    a.stop();
    b.stop();
}

/// A listener recording every event.
fn recorder() -> (
    Arc<Mutex<Vec<FrontendEvent>>>,
    cryptblk_vhost_user_blk::EventListener,
) {
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    (
        events,
        Arc::new(move |e: FrontendEvent| sink.lock().unwrap().push(e)),
    )
}

#[test]
fn stop_event_reports_dirty_logging() {
    let dir = tempfile::tempdir().unwrap();
    let disk = pattern((4 * MIB) as usize, 3);
    let (events, listener) = recorder();
    let daemon = Daemon::start_with(raw_device(dir.path(), &disk), opts(2), Some(listener));

    // Migration: LOG_ALL negotiated, queues stopped one after the other.
    // (SET_VRING_KICK gets no reply: the first completed request proves it was handled.)
    let mut guest = Guest::connect(&daemon.socket, 2, 256);
    for q in 0..2 {
        let (status, data) = guest.read(q, q as u64 * 8, 4096);
        assert_eq!(status, S_OK);
        assert_eq!(data, disk[q * 4096..q * 4096 + 4096]);
    }
    assert_eq!(*events.lock().unwrap(), [FrontendEvent::Started]);
    // A request the frontend publishes just before stopping: GET_VRING_BASE hands back an
    // index that covers exactly the requests answered (it waits for one being handled).
    let (descs, status_addr) = guest.in_chain(1, 0, MIB as usize, 65536);
    guest.publish(1, &descs);
    guest.kick(1);
    let base0 = guest.frontend.get_vring_base(0).unwrap();
    assert_eq!(
        *events.lock().unwrap(),
        [FrontendEvent::Started],
        "Stopped before the last queue stopped"
    );
    let base1 = guest.frontend.get_vring_base(1).unwrap();
    assert_eq!(
        *events.lock().unwrap(),
        [
            FrontendEvent::Started,
            FrontendEvent::Stopped {
                dirty_logging: true
            }
        ]
    );
    let used_idx: u16 = guest
        .mem
        .read_obj(guest.used_ring(1).unchecked_add(2))
        .unwrap();
    assert_eq!(base0, 1);
    assert_eq!(
        u32::from(used_idx),
        base1,
        "requests popped but not answered"
    );
    assert!(base1 == 1 || base1 == 2, "{base1}");

    // Resumed (a failed migration): Started again, and the queues work.
    guest.restart_queue(0, base0);
    guest.restart_queue(1, base1);
    // The request published before the stop: answered before GET_VRING_BASE returned, or
    // (not popped by then) now.
    guest.kick(1);
    guest.wait_used(1, 1);
    assert_eq!(guest.status(status_addr), S_OK);
    assert_eq!(guest.data_of(&descs), disk[..MIB as usize]);
    let (status, data) = guest.read(1, 8, 4096);
    assert_eq!(status, S_OK);
    assert_eq!(data, disk[4096..8192]);
    assert_eq!(events.lock().unwrap().len(), 3);
    assert_eq!(events.lock().unwrap()[2], FrontendEvent::Started);

    // Migration cancelled: LOG_ALL cleared, then a plain stop.
    // (SET_FEATURES gets no reply; GET_VRING_BASE's reply shows it was handled.)
    guest
        .frontend
        .set_features(guest.features & !LOG_ALL)
        .unwrap();
    guest.frontend.get_vring_base(0).unwrap();
    assert!(!daemon.stop_handle().dirty_logging());
    guest.frontend.get_vring_base(1).unwrap();
    assert_eq!(
        events.lock().unwrap()[3..],
        [FrontendEvent::Stopped {
            dirty_logging: false
        }]
    );
    // Stopping an already stopped queue reports nothing more.
    guest.frontend.get_vring_base(0).unwrap();
    assert_eq!(events.lock().unwrap().len(), 4);
    drop(guest);

    // A new frontend that never acks LOG_ALL.
    events.lock().unwrap().clear();
    let mut guest = Guest::connect_without(&daemon.socket, 2, 256, LOG_ALL);
    assert_eq!(guest.read(0, 0, 512).0, S_OK);
    assert!(!daemon.stop_handle().dirty_logging());
    guest.frontend.get_vring_base(0).unwrap();
    guest.frontend.get_vring_base(1).unwrap();
    assert_eq!(
        *events.lock().unwrap(),
        [
            FrontendEvent::Started,
            FrontendEvent::Stopped {
                dirty_logging: false
            }
        ]
    );
    drop(guest);
    daemon.stop();
}
