//! The `VhostUserBackend` implementation: what vhost-user-backend's message thread asks of the
//! device, answered from `config` or handed to the queues' workers (`worker`).
//!
//! vhost-user-backend gets no epoll thread of its own from this backend (`queues_per_thread`
//! is empty): each virtqueue has its worker thread, which watches the ring's kick itself once
//! the ring starts (`start_vring`, from the vendored vring hooks) and owns everything a
//! request touches on its way. The message thread only sends the workers messages, and waits
//! for their answer where the protocol waits (a ring's stop, the daemon's drain).

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cryptblk_block::{BlockError, IoStats};
use vhost::vhost_user::message::{
    VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::Backend;
use vhost_user_backend::VhostUserBackend;
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::EventSet;

use crate::config::{self, ConfigSpace};
use crate::device::VirtioBlkDevice;
use crate::frontend::FrontendState;
use crate::inflight::InflightRegion;
use crate::worker::{Message, RequestContext, Vring, WorkerHandle};
use crate::GuestMem;

struct Inner {
    ctx: Arc<RequestContext>,
    num_queues: u16,
    queue_size: u16,
    /// One per queue, in queue order.
    workers: Vec<WorkerHandle>,
    /// Where queue starts and stops and the acked LOG_ALL feature are reported.
    frontend: Arc<FrontendState>,
    /// The inflight region the frontend shared (restarts).
    inflight: InflightRegion,
}

/// The backend handed to `VhostUserDaemon`; cheap to clone.
#[derive(Clone)]
pub struct BlkBackend {
    inner: Arc<Inner>,
}

/// How a backend serves its disk.
#[derive(Clone, Debug, Default)]
pub struct BackendOptions {
    /// Name of the disk in log lines.
    pub name: String,
    /// Busy-poll each queue's completions this long before sleeping (QEMU's aio-poll);
    /// zero sleeps at once.
    pub poll: Duration,
}

/// Why the backend could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("opening the disk's I/O queues: {0}")]
    Queues(BlockError),
    #[error("starting a queue worker: {0}")]
    Worker(io::Error),
}

impl BlkBackend {
    /// Opens one asynchronous I/O queue per virtqueue and starts its worker. `queue_stats`
    /// has one entry per queue (kept by the caller across connections).
    pub fn new(
        disk: VirtioBlkDevice,
        num_queues: u16,
        queue_size: u16,
        mem: GuestMemoryAtomic<GuestMem>,
        queue_stats: &[Arc<IoStats>],
        opts: BackendOptions,
    ) -> Result<Self, StartError> {
        Self::with_frontend(
            disk,
            num_queues,
            queue_size,
            mem,
            queue_stats,
            opts,
            Arc::default(),
        )
    }

    pub(crate) fn with_frontend(
        disk: VirtioBlkDevice,
        num_queues: u16,
        queue_size: u16,
        mem: GuestMemoryAtomic<GuestMem>,
        queue_stats: &[Arc<IoStats>],
        opts: BackendOptions,
        frontend: Arc<FrontendState>,
    ) -> Result<Self, StartError> {
        let ctx = Arc::new(RequestContext {
            disk,
            config: ConfigSpace::new(num_queues, queue_size),
            event_idx: AtomicBool::new(false),
            name: opts.name,
            poll: opts.poll,
        });
        let mut workers = Vec::new();
        for index in 0..usize::from(num_queues) {
            let io = ctx
                .disk
                .open_queue(usize::from(queue_size))
                .map_err(StartError::Queues)?;
            let stats = queue_stats.get(index).cloned().unwrap_or_default();
            workers.push(
                WorkerHandle::spawn(index, ctx.clone(), stats, mem.clone(), io, queue_size)
                    .map_err(StartError::Worker)?,
            );
        }
        Ok(BlkBackend {
            inner: Arc::new(Inner {
                ctx,
                num_queues,
                queue_size,
                workers,
                frontend,
                inflight: InflightRegion::new(num_queues, queue_size),
            }),
        })
    }

    /// Stops taking requests from the rings, waits until every request taken is answered,
    /// then signals the guest on every ring: a frontend that disconnects after this sees
    /// every completion, and a QEMU that restarts its rings at used->idx loses and repeats
    /// nothing.
    pub fn drain(&self) {
        for worker in &self.inner.workers {
            worker.call(Message::Drain);
        }
    }

    /// Ends the workers once every request they took has completed (answered on its ring
    /// while the ring is there): for when the connection is gone, before the memory the
    /// requests point into is released and before a new frontend may connect. Their I/O
    /// queues close with them.
    pub fn stop_workers(&self) {
        for worker in &self.inner.workers {
            worker.exit();
        }
    }

    fn worker(&self, queue_index: u32) -> io::Result<&WorkerHandle> {
        self.inner
            .workers
            .get(queue_index as usize)
            .ok_or_else(|| io::Error::other(format!("no queue {queue_index}")))
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = crate::MemoryLog;
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        usize::from(self.inner.num_queues)
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.inner.queue_size)
    }

    fn features(&self) -> u64 {
        config::features(&self.inner.ctx.disk)
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        config::protocol_features()
    }

    fn acked_features(&self, features: u64) {
        self.inner
            .frontend
            .set_log_all(features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0);
    }

    fn set_event_idx(&self, enabled: bool) {
        self.inner.ctx.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let ctx = &self.inner.ctx;
        ctx.config.read(&ctx.disk, offset, size)
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        let ctx = &self.inner.ctx;
        ctx.config.write(&ctx.disk, offset, buf)
    }

    /// The frontend's backend request channel (BACKEND_REQ negotiated): kept for config
    /// change notifications (`StopHandle::notify_config_change`).
    fn set_backend_req_fd(&self, backend: Backend) {
        self.inner.frontend.set_backend_req(backend);
    }

    /// vhost-user-backend replaces the table inside the `GuestMemoryAtomic` it was created
    /// with, the one the workers hold, and passes that same one here: each request reads
    /// the table current when it is taken.
    fn update_memory(&self, _mem: GuestMemoryAtomic<GuestMem>) -> io::Result<()> {
        Ok(())
    }

    /// The frontend started ring `queue_index` (its kick is set), before anything watches its
    /// kick: takes over what a predecessor left in the inflight region, hands the ring to its
    /// worker and reports the start.
    fn start_vring(&self, queue_index: u32, vring: &Vring) -> io::Result<()> {
        let worker = self.worker(queue_index)?;
        let index = queue_index as usize;
        let start = self.inner.inflight.ring_started(index, vring);
        worker.send(Message::Start(vring.clone(), start));
        self.inner.frontend.queue_started(index);
        Ok(())
    }

    fn set_vring_enabled(&self, queue_index: u32, enabled: bool) -> io::Result<()> {
        self.worker(queue_index)?.send(Message::Enable(enabled));
        Ok(())
    }

    /// GET_VRING_BASE stops a ring: its worker answers every request taken from it first, so
    /// the index handed back to the frontend covers only finished requests and nothing writes
    /// to the ring after the frontend took it back. When it was the last running ring,
    /// reports `FrontendEvent::Stopped`.
    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        if let Ok(worker) = self.worker(queue_index) {
            worker.call(Message::Stop);
        }
        self.inner.frontend.queue_stopped(queue_index as usize);
        Ok(())
    }

    fn get_inflight_fd(&self, msg: &VhostUserInflight) -> io::Result<(VhostUserInflight, File)> {
        self.inner.inflight.get_fd(msg)
    }

    fn set_inflight_fd(&self, msg: &VhostUserInflight, file: File) -> io::Result<()> {
        self.inner.inflight.set_fd(msg, file)
    }

    /// No epoll thread in vhost-user-backend: the workers watch the kicks.
    fn queues_per_thread(&self) -> Vec<u64> {
        Vec::new()
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        _vrings: &[Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        Err(io::Error::other(format!(
            "event {device_event} on a vhost-user-backend thread; the queue workers watch \
             the rings"
        )))
    }
}
