//! An in-process vhost-user-blk frontend for tests: memfd-backed guest memory shared with the
//! daemon through SET_MEM_TABLE, split virtqueues laid out in that memory by hand, and
//! helpers that build request chains, kick, wait on the call eventfd and read the used ring.
#![allow(dead_code)]

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use cryptblk_block::BlockDevice;
use cryptblk_vhost_user_blk::{EventListener, ServeOptions, Server, StopHandle};
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Address, Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub const VIRTIO_BLK_T_IN: u32 = 0;
pub const VIRTIO_BLK_T_OUT: u32 = 1;
pub const VIRTIO_BLK_T_FLUSH: u32 = 4;
pub const VIRTIO_BLK_T_GET_ID: u32 = 8;
pub const VIRTIO_BLK_T_DISCARD: u32 = 11;
pub const VIRTIO_BLK_T_WRITE_ZEROES: u32 = 13;
pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;

pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
const VIRTIO_RING_F_EVENT_IDX: u64 = 29;

pub const MEM_SIZE: u64 = 32 << 20;
const RINGS_BASE: u64 = 0x10_0000;
const RING_STRIDE: u64 = 0x1_0000;
const DATA_BASE: u64 = 0x40_0000;
/// Data area per queue (so queues can be driven from different threads).
const DATA_PER_QUEUE: u64 = 4 << 20;

/// A daemon serving a device in a background thread of this process.
pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    stop: StopHandle,
    thread: Option<JoinHandle<Result<(), cryptblk_vhost_user_blk::Error>>>,
}

impl Daemon {
    pub fn start(device: Arc<dyn BlockDevice>, opts: ServeOptions) -> Daemon {
        Self::start_with(device, opts, None)
    }

    /// Like `start`, with a `FrontendEvent` listener registered before the server runs.
    pub fn start_with(
        device: Arc<dyn BlockDevice>,
        opts: ServeOptions,
        listener: Option<EventListener>,
    ) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("blk.sock");
        let mut server = Server::bind(&socket, device, opts).unwrap();
        if let Some(listener) = listener {
            server.set_event_listener(listener);
        }
        let stop = server.stop_handle();
        let thread = std::thread::spawn(move || server.run());
        Daemon {
            dir,
            socket,
            stop,
            thread: Some(thread),
        }
    }

    pub fn stop_handle(&self) -> &StopHandle {
        &self.stop
    }

    /// Stops the server and waits for it (it flushes the device on the way out).
    pub fn stop(mut self) {
        self.stop.stop();
        self.thread.take().unwrap().join().unwrap().unwrap();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.stop();
            let _ = t.join();
        }
    }
}

/// One virtqueue the test drives.
struct TestQueue {
    size: u16,
    desc: GuestAddress,
    avail: GuestAddress,
    used: GuestAddress,
    kick: EventFd,
    call: EventFd,
    /// Next free avail index (free-running).
    avail_idx: u16,
    /// Used entries consumed so far (free-running).
    used_seen: u16,
    /// Next free descriptor slot (wraps around the table).
    next_desc: u16,
    /// Descriptors of chains published and not yet seen in the used ring, and each chain's
    /// length by head, so that a test cannot overwrite descriptors still in flight.
    descs_in_flight: usize,
    chain_len: Vec<u16>,
    /// Bump allocator for data buffers in this queue's data area.
    data_next: u64,
}

/// A descriptor to put in a chain.
#[derive(Clone, Copy, Debug)]
pub struct Desc {
    pub addr: GuestAddress,
    pub len: u32,
    /// Device-writable.
    pub write: bool,
}

/// A submitted request: where its pieces live.
#[derive(Clone, Copy, Debug)]
pub struct Pending {
    pub head: u16,
    pub status: Option<GuestAddress>,
    pub data: Option<(GuestAddress, u32)>,
}

/// A frontend connected to a daemon, with guest memory and queues set up.
pub struct Guest {
    pub mem: GuestMemoryMmap,
    pub frontend: Frontend,
    queues: Vec<TestQueue>,
    pub features: u64,
    /// The inflight region GET_INFLIGHT_FD returned, kept across reconnects as QEMU keeps it.
    inflight: Option<(VhostUserInflight, File)>,
}

/// Guest RAM as QEMU's `memory-backend-memfd` makes it: a memfd sealed against shrinking and
/// growing (the daemon refuses guest memory that could shrink under it).
pub fn memfd_memory() -> GuestMemoryMmap {
    memfd_memory_sealed(true)
}

/// Guest RAM in a memfd, sealed (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) or not
/// (`memory-backend-memfd,seal=off`).
pub fn memfd_memory_sealed(sealed: bool) -> GuestMemoryMmap {
    // SAFETY: the name is a valid NUL-terminated string; the returned descriptor is checked
    // before use and owned by the `File` below.
    let fd = unsafe {
        libc::memfd_create(
            c"cryptblk-guest".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(MEM_SIZE).unwrap();
    if sealed {
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl(F_ADD_SEALS) on the memfd made above, integer argument.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
        assert_eq!(rc, 0, "F_ADD_SEALS: {}", std::io::Error::last_os_error());
    }
    GuestMemoryMmap::from_ranges_with_files(&[(
        GuestAddress(0),
        MEM_SIZE as usize,
        Some(FileOffset::new(file, 0)),
    )])
    .unwrap()
}

impl Guest {
    /// Connects, negotiates everything offered, shares memory and sets up `num_queues` queues
    /// of `queue_size` entries.
    pub fn connect(socket: &Path, num_queues: u16, queue_size: u16) -> Guest {
        Self::connect_without(socket, num_queues, queue_size, 0)
    }

    /// Like `connect`, but does not acknowledge the feature bits in `refuse`.
    pub fn connect_without(socket: &Path, num_queues: u16, queue_size: u16, refuse: u64) -> Guest {
        Self::connect_full(socket, num_queues, queue_size, refuse, false)
    }

    /// Like `connect`, and shares an inflight region the way QEMU does: GET_INFLIGHT_FD for a
    /// new region, SET_INFLIGHT_FD before the rings start. `reconnect` hands the same region
    /// to the next daemon.
    pub fn connect_inflight(socket: &Path, num_queues: u16, queue_size: u16) -> Guest {
        Self::connect_full(socket, num_queues, queue_size, 0, true)
    }

    fn connect_full(
        socket: &Path,
        num_queues: u16,
        queue_size: u16,
        refuse: u64,
        inflight: bool,
    ) -> Guest {
        let mut frontend = connect_retry(socket, u64::from(num_queues));
        frontend.set_owner().unwrap();
        let features = frontend.get_features().unwrap() & !refuse;
        assert!(features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0);
        frontend.set_features(features).unwrap();
        let proto = frontend.get_protocol_features().unwrap();
        assert!(proto.contains(VhostUserProtocolFeatures::CONFIG));
        assert!(proto.contains(VhostUserProtocolFeatures::MQ));
        frontend.set_protocol_features(proto).unwrap();
        assert!(frontend.get_queue_num().unwrap() >= u64::from(num_queues));
        let inflight = inflight.then(|| {
            assert!(proto.contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD));
            let ask = VhostUserInflight::new(0, 0, num_queues, queue_size);
            let (info, file) = frontend.get_inflight_fd(&ask).unwrap();
            frontend.set_inflight_fd(&info, file.as_raw_fd()).unwrap();
            (info, file)
        });

        let mem = memfd_memory();
        let region = mem.find_region(GuestAddress(0)).unwrap();
        let host = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
        let info = VhostUserMemoryRegionInfo::from_guest_region(region).unwrap();
        frontend.set_mem_table(&[info]).unwrap();

        let mut queues = Vec::new();
        for q in 0..num_queues {
            let base = RINGS_BASE + u64::from(q) * RING_STRIDE;
            let tq = TestQueue {
                size: queue_size,
                desc: GuestAddress(base),
                avail: GuestAddress(base + 0x4000),
                used: GuestAddress(base + 0x8000),
                kick: EventFd::new(0).unwrap(),
                call: EventFd::new(EFD_NONBLOCK).unwrap(),
                avail_idx: 0,
                used_seen: 0,
                next_desc: 0,
                descs_in_flight: 0,
                chain_len: vec![0; usize::from(queue_size)],
                data_next: DATA_BASE + u64::from(q) * DATA_PER_QUEUE,
            };
            let qi = usize::from(q);
            frontend.set_vring_num(qi, queue_size).unwrap();
            frontend
                .set_vring_addr(
                    qi,
                    &VringConfigData {
                        queue_max_size: queue_size,
                        queue_size,
                        flags: 0,
                        desc_table_addr: host + tq.desc.0,
                        used_ring_addr: host + tq.used.0,
                        avail_ring_addr: host + tq.avail.0,
                        log_addr: None,
                    },
                )
                .unwrap();
            frontend.set_vring_base(qi, 0).unwrap();
            frontend.set_vring_call(qi, &tq.call).unwrap();
            frontend.set_vring_kick(qi, &tq.kick).unwrap();
            frontend.set_vring_enable(qi, true).unwrap();
            queues.push(tq);
        }
        Guest {
            mem,
            frontend,
            queues,
            features,
            inflight,
        }
    }

    /// Connects to a new daemon on `socket` (its predecessor is gone) and resumes every queue
    /// the way QEMU 7.2 reconnects a vhost-user-blk device: the features and memory of before,
    /// the inflight region it kept (SET_INFLIGHT_FD), and each ring restarted at
    /// SET_VRING_BASE = used->idx, which is what QEMU falls back to when GET_VRING_BASE fails
    /// on the dead connection. Message order as QEMU's vhost_dev_start: call, num, base,
    /// addr, kick, then enable.
    pub fn reconnect(&mut self, socket: &Path) {
        let mut frontend = connect_retry(socket, self.queues.len() as u64);
        frontend.set_owner().unwrap();
        let offered = frontend.get_features().unwrap();
        assert_eq!(offered & self.features, self.features, "features changed");
        frontend.set_features(self.features).unwrap();
        let proto = frontend.get_protocol_features().unwrap();
        frontend.set_protocol_features(proto).unwrap();
        if let Some((info, file)) = &self.inflight {
            frontend.set_inflight_fd(info, file.as_raw_fd()).unwrap();
        }
        let region = self.mem.find_region(GuestAddress(0)).unwrap();
        let info = VhostUserMemoryRegionInfo::from_guest_region(region).unwrap();
        frontend.set_mem_table(&[info]).unwrap();
        let host = self.mem.get_host_address(GuestAddress(0)).unwrap() as u64;
        for (qi, tq) in self.queues.iter().enumerate() {
            let used_idx: u16 = self.mem.read_obj(tq.used.unchecked_add(2)).unwrap();
            frontend.set_vring_call(qi, &tq.call).unwrap();
            frontend.set_vring_num(qi, tq.size).unwrap();
            frontend.set_vring_base(qi, used_idx).unwrap();
            frontend
                .set_vring_addr(
                    qi,
                    &VringConfigData {
                        queue_max_size: tq.size,
                        queue_size: tq.size,
                        flags: 0,
                        desc_table_addr: host + tq.desc.0,
                        used_ring_addr: host + tq.used.0,
                        avail_ring_addr: host + tq.avail.0,
                        log_addr: None,
                    },
                )
                .unwrap();
            frontend.set_vring_kick(qi, &tq.kick).unwrap();
        }
        for qi in 0..self.queues.len() {
            frontend.set_vring_enable(qi, true).unwrap();
        }
        self.frontend = frontend;
    }

    /// Used entries queue `q` has that were not seen yet, without waiting.
    pub fn take_used(&mut self, q: usize) -> Vec<(u16, u32)> {
        let tq = &self.queues[q];
        let used_idx: u16 = self.mem.read_obj(tq.used.unchecked_add(2)).unwrap();
        let n = usize::from(used_idx.wrapping_sub(tq.used_seen));
        self.wait_used(q, n)
    }

    /// Empties queue `q`'s call eventfd (forgets signals received so far).
    pub fn clear_call(&self, q: usize) {
        let _ = self.queues[q].call.read();
    }

    /// Waits up to `timeout` for the device to signal queue `q`'s call eventfd; true if it did.
    pub fn wait_call(&self, q: usize, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if self.queues[q].call.read().is_ok() {
                return true;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            wait_readable(
                &self.queues[q].call,
                (deadline - now).min(Duration::from_millis(100)),
            );
        }
    }

    /// Restarts queue `q` after GET_VRING_BASE returned `base`, as a frontend resuming a VM
    /// does: SET_VRING_BASE, then the call and kick descriptors.
    pub fn restart_queue(&mut self, q: usize, base: u32) {
        self.frontend.set_vring_base(q, base as u16).unwrap();
        self.frontend
            .set_vring_call(q, &self.queues[q].call)
            .unwrap();
        self.frontend
            .set_vring_kick(q, &self.queues[q].kick)
            .unwrap();
        self.frontend.set_vring_enable(q, true).unwrap();
    }

    /// Guest address of queue `q`'s used ring.
    pub fn used_ring(&self, q: usize) -> GuestAddress {
        self.queues[q].used
    }

    /// Guest address of queue `q`'s descriptor table.
    pub fn desc_table(&self, q: usize) -> GuestAddress {
        self.queues[q].desc
    }

    pub fn event_idx(&self) -> bool {
        self.features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0
    }

    /// Reads `len` bytes of the device config space.
    pub fn config(&mut self, offset: u32, len: u32) -> Vec<u8> {
        let buf = vec![0u8; len as usize];
        let (_, data) = self
            .frontend
            .get_config(offset, len, VhostUserConfigFlags::WRITABLE, &buf)
            .unwrap();
        data
    }

    /// Writes `data` into the device config space.
    pub fn set_config(&mut self, offset: u32, data: &[u8]) {
        self.frontend
            .set_config(offset, VhostUserConfigFlags::WRITABLE, data)
            .unwrap();
    }

    /// Allocates a zeroed buffer in queue `q`'s data area.
    pub fn alloc(&mut self, q: usize, len: u32) -> GuestAddress {
        let tq = &mut self.queues[q];
        let start = DATA_BASE + q as u64 * DATA_PER_QUEUE;
        let len64 = (u64::from(len) + 15) & !15;
        if tq.data_next + len64 > start + DATA_PER_QUEUE {
            tq.data_next = start;
        }
        let addr = GuestAddress(tq.data_next);
        tq.data_next += len64.max(16);
        self.mem
            .write_slice(&vec![0u8; len as usize], addr)
            .unwrap();
        addr
    }

    pub fn header(&mut self, q: usize, kind: u32, sector: u64) -> GuestAddress {
        let addr = self.alloc(q, 16);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, addr).unwrap();
        addr
    }

    /// Writes a chain into the descriptor table and publishes it (no kick); returns its head.
    pub fn publish(&mut self, q: usize, descs: &[Desc]) -> u16 {
        self.publish_patched(q, descs, &[])
    }

    /// Like `publish`, but descriptor `i` of the chain gets the raw `flags` and points `next`
    /// at chain position `to`, for each `(i, flags, to)` in `patches` (loops, bad links).
    pub fn publish_patched(
        &mut self,
        q: usize,
        descs: &[Desc],
        patches: &[(usize, u16, usize)],
    ) -> u16 {
        let tq = &mut self.queues[q];
        let n = descs.len() as u16;
        assert!(
            tq.descs_in_flight + usize::from(n) <= usize::from(tq.size),
            "test bug: more descriptors in flight than the queue has"
        );
        tq.descs_in_flight += usize::from(n);
        let mut ids = Vec::new();
        for _ in 0..n {
            ids.push(tq.next_desc);
            tq.next_desc = (tq.next_desc + 1) % tq.size;
        }
        for (i, d) in descs.iter().enumerate() {
            let id = ids[i];
            let mut flags = if d.write { F_WRITE } else { 0 };
            let next = if i + 1 < descs.len() {
                flags |= F_NEXT;
                ids[i + 1]
            } else {
                0
            };
            let (flags, next) = match patches.iter().find(|p| p.0 == i) {
                Some(&(_, f, to)) => (f, ids[to]),
                None => (flags, next),
            };
            let at = tq.desc.unchecked_add(u64::from(id) * 16);
            let mut raw = [0u8; 16];
            raw[0..8].copy_from_slice(&d.addr.0.to_le_bytes());
            raw[8..12].copy_from_slice(&d.len.to_le_bytes());
            raw[12..14].copy_from_slice(&flags.to_le_bytes());
            raw[14..16].copy_from_slice(&next.to_le_bytes());
            self.mem.write_slice(&raw, at).unwrap();
        }
        let head = ids[0];
        tq.chain_len[usize::from(head)] = n;
        let slot = tq.avail_idx % tq.size;
        self.mem
            .write_obj(head, tq.avail.unchecked_add(4 + 2 * u64::from(slot)))
            .unwrap();
        // Ask for a notification on the next used entry (EVENT_IDX's used_event).
        self.mem
            .write_obj(
                tq.used_seen,
                tq.avail.unchecked_add(4 + 2 * u64::from(tq.size)),
            )
            .unwrap();
        fence(Ordering::SeqCst);
        tq.avail_idx = tq.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(tq.avail_idx, tq.avail.unchecked_add(2))
            .unwrap();
        fence(Ordering::SeqCst);
        head
    }

    pub fn kick(&self, q: usize) {
        self.queues[q].kick.write(1).unwrap();
    }

    /// Waits until `count` more used entries appeared on queue `q`; returns (head, len) pairs.
    pub fn wait_used(&mut self, q: usize, count: usize) -> Vec<(u16, u32)> {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let mut out = Vec::new();
        while out.len() < count {
            let tq = &mut self.queues[q];
            let used_idx: u16 = self.mem.read_obj(tq.used.unchecked_add(2)).unwrap();
            fence(Ordering::SeqCst);
            while tq.used_seen != used_idx && out.len() < count {
                let slot = tq.used_seen % tq.size;
                let at = tq.used.unchecked_add(4 + 8 * u64::from(slot));
                let id: u32 = self.mem.read_obj(at).unwrap();
                let len: u32 = self.mem.read_obj(at.unchecked_add(4)).unwrap();
                out.push((id as u16, len));
                let n = tq.chain_len.get(id as usize).copied().unwrap_or(0);
                tq.descs_in_flight -= usize::from(n);
                tq.used_seen = tq.used_seen.wrapping_add(1);
            }
            // Keep used_event current so the device signals the next completion.
            self.mem
                .write_obj(
                    tq.used_seen,
                    tq.avail.unchecked_add(4 + 2 * u64::from(tq.size)),
                )
                .unwrap();
            fence(Ordering::SeqCst);
            if out.len() >= count {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {count} used entries on queue {q} (got {})",
                out.len()
            );
            wait_readable(&tq.call, Duration::from_millis(100));
            let _ = tq.call.read();
        }
        out
    }

    /// Publishes a chain, kicks and waits for its completion; returns the used length.
    pub fn run(&mut self, q: usize, descs: &[Desc]) -> u32 {
        let head = self.publish(q, descs);
        self.kick(q);
        let used = self.wait_used(q, 1);
        assert_eq!(used[0].0, head, "completed a different chain");
        used[0].1
    }

    pub fn status_buf(&mut self, q: usize) -> GuestAddress {
        let addr = self.alloc(q, 1);
        self.mem.write_obj(0xffu8, addr).unwrap();
        addr
    }

    pub fn status(&self, addr: GuestAddress) -> u8 {
        self.mem.read_obj(addr).unwrap()
    }

    /// Builds an OUT request (header, data split into `seg` byte pieces, status) without
    /// submitting it.
    pub fn out_chain(
        &mut self,
        q: usize,
        sector: u64,
        data: &[u8],
        seg: usize,
    ) -> (Vec<Desc>, GuestAddress) {
        let h = self.header(q, VIRTIO_BLK_T_OUT, sector);
        let mut descs = vec![Desc {
            addr: h,
            len: 16,
            write: false,
        }];
        for chunk in data.chunks(seg) {
            let a = self.alloc(q, chunk.len() as u32);
            self.mem.write_slice(chunk, a).unwrap();
            descs.push(Desc {
                addr: a,
                len: chunk.len() as u32,
                write: false,
            });
        }
        let s = self.status_buf(q);
        descs.push(Desc {
            addr: s,
            len: 1,
            write: true,
        });
        (descs, s)
    }

    /// Builds an IN request for `len` bytes in `seg` byte pieces.
    pub fn in_chain(
        &mut self,
        q: usize,
        sector: u64,
        len: usize,
        seg: usize,
    ) -> (Vec<Desc>, GuestAddress) {
        let h = self.header(q, VIRTIO_BLK_T_IN, sector);
        let mut descs = vec![Desc {
            addr: h,
            len: 16,
            write: false,
        }];
        let mut left = len;
        while left > 0 {
            let n = left.min(seg);
            let a = self.alloc(q, n as u32);
            descs.push(Desc {
                addr: a,
                len: n as u32,
                write: true,
            });
            left -= n;
        }
        let s = self.status_buf(q);
        descs.push(Desc {
            addr: s,
            len: 1,
            write: true,
        });
        (descs, s)
    }

    /// Concatenated contents of the data descriptors of a chain (between header and status).
    pub fn data_of(&self, descs: &[Desc]) -> Vec<u8> {
        let mut out = Vec::new();
        for d in &descs[1..descs.len() - 1] {
            let mut buf = vec![0u8; d.len as usize];
            self.mem.read_slice(&mut buf, d.addr).unwrap();
            out.extend_from_slice(&buf);
        }
        out
    }

    pub fn write(&mut self, q: usize, sector: u64, data: &[u8]) -> u8 {
        let (descs, s) = self.out_chain(q, sector, data, 4096);
        let used = self.run(q, &descs);
        assert_eq!(used, 1);
        self.status(s)
    }

    pub fn read(&mut self, q: usize, sector: u64, len: usize) -> (u8, Vec<u8>) {
        let (descs, s) = self.in_chain(q, sector, len, 4096);
        let used = self.run(q, &descs);
        let status = self.status(s);
        if status == S_OK {
            assert_eq!(used as usize, len + 1);
        }
        (status, self.data_of(&descs))
    }

    /// A request with only header and status.
    pub fn simple(&mut self, q: usize, kind: u32, sector: u64) -> u8 {
        let h = self.header(q, kind, sector);
        let s = self.status_buf(q);
        self.run(
            q,
            &[
                Desc {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Desc {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
        );
        self.status(s)
    }

    /// A WRITE_ZEROES request with one range.
    pub fn write_zeroes(&mut self, q: usize, sector: u64, num_sectors: u32, flags: u32) -> u8 {
        self.range_request(q, VIRTIO_BLK_T_WRITE_ZEROES, sector, num_sectors, flags)
    }

    /// A DISCARD request with one range.
    pub fn discard(&mut self, q: usize, sector: u64, num_sectors: u32, flags: u32) -> u8 {
        self.range_request(q, VIRTIO_BLK_T_DISCARD, sector, num_sectors, flags)
    }

    /// A request of `kind` carrying one 16-byte range (WRITE_ZEROES, DISCARD).
    pub fn range_request(
        &mut self,
        q: usize,
        kind: u32,
        sector: u64,
        num_sectors: u32,
        flags: u32,
    ) -> u8 {
        let h = self.header(q, kind, 0);
        let r = self.alloc(q, 16);
        let mut range = [0u8; 16];
        range[0..8].copy_from_slice(&sector.to_le_bytes());
        range[8..12].copy_from_slice(&num_sectors.to_le_bytes());
        range[12..16].copy_from_slice(&flags.to_le_bytes());
        self.mem.write_slice(&range, r).unwrap();
        let s = self.status_buf(q);
        let used = self.run(
            q,
            &[
                Desc {
                    addr: h,
                    len: 16,
                    write: false,
                },
                Desc {
                    addr: r,
                    len: 16,
                    write: false,
                },
                Desc {
                    addr: s,
                    len: 1,
                    write: true,
                },
            ],
        );
        assert_eq!(used, 1);
        self.status(s)
    }

    pub fn get_id(&mut self, q: usize) -> (u8, Vec<u8>) {
        let h = self.header(q, VIRTIO_BLK_T_GET_ID, 0);
        let d = self.alloc(q, 20);
        let s = self.status_buf(q);
        let descs = [
            Desc {
                addr: h,
                len: 16,
                write: false,
            },
            Desc {
                addr: d,
                len: 20,
                write: true,
            },
            Desc {
                addr: s,
                len: 1,
                write: true,
            },
        ];
        let used = self.run(q, &descs);
        assert_eq!(used, 21);
        (self.status(s), self.data_of(&descs))
    }
}

fn connect_retry(socket: &Path, queues: u64) -> Frontend {
    let mut last = None;
    for _ in 0..100 {
        match Frontend::connect(socket, queues) {
            Ok(f) => return f,
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("cannot connect to {}: {:?}", socket.display(), last);
}

fn wait_readable(fd: &EventFd, timeout: Duration) {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid, initialised pollfd that outlives the call.
    unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as libc::c_int) };
}

/// Test data that differs per byte and per seed.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
