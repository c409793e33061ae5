//! A virtqueue's worker driven from the caller's thread instead of a vhost-user connection,
//! so that the fuzz targets and their replay tests put requests through the daemon's own
//! request path (take, parse, plan, I/O queue, answer, used ring) on a ring they built in
//! guest memory.

use std::io;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use cryptblk_block::IoStats;
use vhost_user_backend::{VringRwLock, VringT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{RequestContext, Worker};
use crate::config::ConfigSpace;
use crate::device::VirtioBlkDevice;
use crate::inflight::RingStart;
use crate::GuestMem;

/// One split virtqueue in `mem` served by a worker on the caller's thread: no kick, no call,
/// no inflight region, EVENT_IDX off, the write cache on.
pub struct RingDriver {
    worker: Worker,
}

impl RingDriver {
    /// The ring of `queue_size` entries whose descriptor table, available ring and used ring
    /// are at `desc`, `avail` and `used` in `mem`, started and enabled (so, as a starting ring
    /// is, served at once: what is available already is taken); `disk` executes its requests
    /// on an I/O queue of its own.
    pub fn new(
        disk: VirtioBlkDevice,
        mem: GuestMem,
        queue_size: u16,
        desc: u64,
        avail: u64,
        used: u64,
    ) -> io::Result<RingDriver> {
        let mem = GuestMemoryAtomic::new(mem);
        let io = disk
            .open_queue(usize::from(queue_size))
            .map_err(|e| io::Error::other(e.to_string()))?;
        let ctx = Arc::new(RequestContext {
            disk,
            config: ConfigSpace::new(1, queue_size),
            event_idx: AtomicBool::new(false),
            name: "ring-driver".into(),
            poll: Duration::ZERO,
        });
        let vring = VringRwLock::new(mem.clone(), queue_size)
            .map_err(|e| io::Error::other(format!("creating the ring: {e}")))?;
        vring.set_queue_size(queue_size);
        vring
            .set_queue_info(desc, avail, used)
            .map_err(|e| io::Error::other(format!("ring addresses: {e}")))?;
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        // No message ever arrives: the caller's calls are the worker's events.
        let (_messages, inbox) = crossbeam_channel::unbounded();
        let wake = EventFd::new(EFD_NONBLOCK)?;
        let stats = Arc::new(IoStats::default());
        let mut worker = Worker::new(0, ctx, stats, mem, io, queue_size, inbox, wake)?;
        worker.start(vring, RingStart::default())?;
        Ok(RingDriver { worker })
    }

    /// Serves the ring as a guest kick would: takes every available request, submits, and
    /// answers what completed at once.
    pub fn kick(&mut self) -> io::Result<()> {
        self.worker.serve_ring()
    }

    /// Waits until every request taken is answered on the used ring.
    pub fn settle(&mut self) {
        self.worker.answer_outstanding();
    }

    /// The guest memory the ring and its requests live in.
    pub fn memory(&self) -> Arc<GuestMem> {
        self.worker.mem.memory().into_inner()
    }
}
