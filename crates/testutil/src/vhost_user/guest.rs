//! The frontend's connection: feature negotiation, shared memory, queue setup and restarts in
//! the order QEMU sends them, kicks and waits for completions.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::memfd_memory_sealed;
use super::ring::{Desc, DriverRing};

/// Where queue `q`'s rings start.
fn rings_base(q: u16) -> GuestAddress {
    GuestAddress(0x10_0000 + u64::from(q) * 0x1_0000)
}

/// Data buffers: an area per queue (so queues can be driven from different threads).
pub(super) const DATA_BASE: u64 = 0x40_0000;
pub(super) const DATA_PER_QUEUE: u64 = 4 << 20;

/// One virtqueue the test drives.
pub(super) struct TestQueue {
    pub ring: DriverRing,
    kick: EventFd,
    call: EventFd,
    /// Bump allocator for data buffers in this queue's data area.
    pub data_next: u64,
}

/// A frontend connected to a daemon, with guest memory and queues set up.
pub struct Guest {
    pub mem: GuestMemoryMmap,
    pub frontend: Frontend,
    pub(super) queues: Vec<TestQueue>,
    pub features: u64,
    /// The inflight region GET_INFLIGHT_FD returned, kept across reconnects as QEMU keeps it.
    inflight: Option<(VhostUserInflight, File)>,
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

        let mem = memfd_memory_sealed(true);
        share_memory(&mut frontend, &mem);
        let mut queues = Vec::new();
        for q in 0..num_queues {
            let tq = TestQueue {
                ring: DriverRing::new(rings_base(q), queue_size),
                kick: EventFd::new(0).unwrap(),
                call: EventFd::new(EFD_NONBLOCK).unwrap(),
                data_next: DATA_BASE + u64::from(q) * DATA_PER_QUEUE,
            };
            let qi = usize::from(q);
            frontend.set_vring_num(qi, queue_size).unwrap();
            frontend
                .set_vring_addr(qi, &ring_addresses(&mem, &tq.ring))
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
        share_memory(&mut frontend, &self.mem);
        for (qi, tq) in self.queues.iter().enumerate() {
            frontend.set_vring_call(qi, &tq.call).unwrap();
            frontend.set_vring_num(qi, tq.ring.size).unwrap();
            frontend
                .set_vring_base(qi, tq.ring.used_idx(&self.mem))
                .unwrap();
            frontend
                .set_vring_addr(qi, &ring_addresses(&self.mem, &tq.ring))
                .unwrap();
            frontend.set_vring_kick(qi, &tq.kick).unwrap();
        }
        for qi in 0..self.queues.len() {
            frontend.set_vring_enable(qi, true).unwrap();
        }
        self.frontend = frontend;
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
        self.queues[q].ring.used
    }

    /// Guest address of queue `q`'s available ring.
    pub fn avail_ring(&self, q: usize) -> GuestAddress {
        self.queues[q].ring.avail
    }

    /// Guest address of queue `q`'s descriptor table.
    pub fn desc_table(&self, q: usize) -> GuestAddress {
        self.queues[q].ring.desc
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

    /// Writes a chain into queue `q`'s descriptor table and publishes it (no kick); returns
    /// its head.
    pub fn publish(&mut self, q: usize, descs: &[Desc]) -> u16 {
        self.queues[q].ring.publish(&self.mem, descs, &[])
    }

    /// Like `publish`, but for each `(i, to)` in `links` descriptor `i` of the chain links to
    /// chain position `to` instead of the next one (loops, bad links).
    pub fn publish_linked(&mut self, q: usize, descs: &[Desc], links: &[(usize, usize)]) -> u16 {
        self.queues[q].ring.publish(&self.mem, descs, links)
    }

    /// Publishes a chain as an indirect table (in queue `q`'s data area) behind one ring
    /// descriptor (no kick); returns its head.
    pub fn publish_indirect(&mut self, q: usize, descs: &[Desc]) -> u16 {
        let table = self.alloc(q, (descs.len() * 16) as u32);
        self.queues[q]
            .ring
            .publish_indirect(&self.mem, table, descs)
    }

    pub fn kick(&self, q: usize) {
        self.queues[q].kick.write(1).unwrap();
    }

    /// Used entries queue `q` has that were not seen yet, without waiting.
    pub fn take_used(&mut self, q: usize) -> Vec<(u16, u32)> {
        let n = self.queues[q].ring.used_pending(&self.mem);
        self.wait_used(q, n)
    }

    /// Waits until `count` more used entries appeared on queue `q`; returns (head, len) pairs.
    pub fn wait_used(&mut self, q: usize, count: usize) -> Vec<(u16, u32)> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let tq = &mut self.queues[q];
        let mut out = Vec::new();
        while out.len() < count {
            out.extend(tq.ring.take_used(&self.mem, count - out.len()));
            if out.len() >= count {
                break;
            }
            assert!(
                Instant::now() < deadline,
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

    /// Empties queue `q`'s call eventfd (forgets signals received so far).
    pub fn clear_call(&self, q: usize) {
        let _ = self.queues[q].call.read();
    }

    /// Waits up to `timeout` for the device to signal queue `q`'s call eventfd; true if it did.
    pub fn wait_call(&self, q: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.queues[q].call.read().is_ok() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            wait_readable(
                &self.queues[q].call,
                (deadline - now).min(Duration::from_millis(100)),
            );
        }
    }
}

/// SET_MEM_TABLE with the one region of `mem`.
fn share_memory(frontend: &mut Frontend, mem: &GuestMemoryMmap) {
    let region = mem.find_region(GuestAddress(0)).unwrap();
    let info = VhostUserMemoryRegionInfo::from_guest_region(region).unwrap();
    frontend.set_mem_table(&[info]).unwrap();
}

/// SET_VRING_ADDR's message: the rings as addresses in this process, as QEMU sends them.
fn ring_addresses(mem: &GuestMemoryMmap, ring: &DriverRing) -> VringConfigData {
    let host = mem.get_host_address(GuestAddress(0)).unwrap() as u64;
    VringConfigData {
        queue_max_size: ring.size,
        queue_size: ring.size,
        flags: 0,
        desc_table_addr: host + ring.desc.0,
        used_ring_addr: host + ring.used.0,
        avail_ring_addr: host + ring.avail.0,
        log_addr: None,
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

#[allow(unsafe_code)] // vmm-sys-util's EventFd has no `AsFd`: poll(2) on its raw descriptor
fn wait_readable(fd: &EventFd, timeout: Duration) {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid, initialised pollfd that outlives the call.
    unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as libc::c_int) };
}
