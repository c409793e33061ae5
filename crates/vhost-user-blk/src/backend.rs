//! The `VhostUserBackend` implementation: features, config space and the per-queue workers.
//!
//! vhost-user-backend runs one epoll thread per queue (`queues_per_thread`). That thread pops
//! and parses its queue's requests and hands them to the disk's submission pool (`executor`),
//! running the last one of each batch itself; whichever thread finishes a request puts it on
//! the used ring and signals the guest. Queues share nothing but the disk and the pool, so
//! they never serialize on a backend-wide lock, and one queue keeps many requests in flight.
//!
//! Restarts (`inflight`): every head taken from a ring is marked in the inflight region
//! (`QueuePart::popped`) and every completion goes through `inflight::add_used`, under the
//! ring's lock; when a ring starts, its worker first resubmits what a predecessor daemon left
//! in flight and signals the guest even with nothing to do. `drain` (a stop) takes no more
//! requests, waits for those taken and signals every ring.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Instant;

use cryptblk_block::{IoKind, IoStats};

use vhost::vhost_user::message::{
    VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::chain::Chain;
use crate::device::{Disk, MAX_DISCARD_SECTORS, MAX_WRITE_ZEROES_SECTORS};
use crate::executor::{Executor, InFlight};
use crate::fault::{self, Point};
use crate::frontend::{FrontendState, TrackedVring};
use crate::inflight::{self, QueuePart, Rings};
use crate::request::{self, Request, RequestType, SECTOR_SIZE};
use crate::GuestMem;

/// A ring as the workers use it.
type Vring = VringRwLock<GuestMemoryAtomic<GuestMem>>;

/// Offset of the `writeback` byte in `struct virtio_blk_config`.
const CONFIG_WCE_OFFSET: usize = 32;
/// Bytes of config space this device defines (up to `write_zeroes_may_unmap` and its
/// padding); reads past it return zeros.
const CONFIG_LEN: usize = 60;
/// Largest config read answered (the virtio-blk config struct is well below this).
const CONFIG_MAX: usize = 256;

/// Largest data descriptor accepted (`size_max`, VIRTIO_BLK_F_SIZE_MAX): 1 MiB. Longer ones
/// get IOERR. Linux uses it as the queue's max_segment_size, so it never builds one larger.
pub const SIZE_MAX: u32 = 1 << 20;

/// Completions after which the guest is signalled even if more requests are waiting.
const SIGNAL_BATCH: u32 = 16;

/// Per-queue state shared by the queue's epoll thread and the pool threads completing its
/// requests.
pub struct QueueState {
    /// The queue's index (= its worker thread's).
    index: usize,
    in_flight: InFlight,
    stats: Arc<IoStats>,
    /// Moving average of the time one request takes to execute, in nanoseconds.
    avg_service_ns: AtomicU64,
}

/// What a request needs once it has left the queue thread.
struct RequestContext {
    disk: Disk,
    /// Guest write cache enabled (CONFIG_WCE); when off, every write is followed by a flush.
    writeback: AtomicBool,
}

struct Inner {
    ctx: Arc<RequestContext>,
    num_queues: u16,
    queue_size: u16,
    seg_max: u32,
    event_idx: AtomicBool,
    mem: RwLock<GuestMemoryAtomic<GuestMem>>,
    queues: Vec<Arc<QueueState>>,
    executor: Arc<Executor>,
    /// Where queue starts and stops and the acked LOG_ALL feature are reported.
    frontend: Arc<FrontendState>,
    /// The running rings and the inflight region (restarts).
    rings: Arc<Rings>,
    /// Stopping: take no more requests from the rings (`drain`).
    draining: AtomicBool,
}

/// A parsed request on its way to execution.
struct Pending {
    head: u16,
    req: Request,
    segments: Vec<request::Segment>,
    start: Instant,
}

/// The backend handed to `VhostUserDaemon`; cheap to clone (one per worker thread).
#[derive(Clone)]
pub struct BlkBackend {
    inner: Arc<Inner>,
}

impl BlkBackend {
    /// `queue_stats` has one entry per queue (kept by the caller across connections);
    /// `executor` runs the requests of every queue.
    pub fn new(
        disk: Disk,
        num_queues: u16,
        queue_size: u16,
        mem: GuestMemoryAtomic<GuestMem>,
        queue_stats: &[Arc<IoStats>],
        executor: Arc<Executor>,
    ) -> Self {
        Self::with_frontend(
            disk,
            num_queues,
            queue_size,
            mem,
            queue_stats,
            executor,
            Arc::default(),
        )
    }

    pub(crate) fn with_frontend(
        disk: Disk,
        num_queues: u16,
        queue_size: u16,
        mem: GuestMemoryAtomic<GuestMem>,
        queue_stats: &[Arc<IoStats>],
        executor: Arc<Executor>,
        frontend: Arc<FrontendState>,
    ) -> Self {
        let seg_max = u32::from(queue_size.saturating_sub(2)).max(1);
        let queues = (0..usize::from(num_queues))
            .map(|q| {
                Arc::new(QueueState {
                    index: q,
                    in_flight: InFlight::default(),
                    stats: queue_stats.get(q).cloned().unwrap_or_default(),
                    avg_service_ns: AtomicU64::new(u64::MAX / 1024),
                })
            })
            .collect();
        BlkBackend {
            inner: Arc::new(Inner {
                ctx: Arc::new(RequestContext {
                    disk,
                    writeback: AtomicBool::new(true),
                }),
                num_queues,
                queue_size,
                seg_max,
                event_idx: AtomicBool::new(false),
                mem: RwLock::new(mem),
                queues,
                executor,
                frontend,
                rings: Arc::new(Rings::new(num_queues, queue_size)),
                draining: AtomicBool::new(false),
            }),
        }
    }

    /// The connection's rings and inflight region, for the rings to report their starts to.
    pub(crate) fn rings(&self) -> Arc<Rings> {
        self.inner.rings.clone()
    }

    /// Stops taking requests from the rings, waits until every request taken is answered,
    /// then signals the guest on every ring: a frontend that disconnects after this sees every
    /// completion, and a QEMU that restarts its rings at used->idx loses and repeats nothing.
    pub fn drain(&self) {
        self.inner.draining.store(true, Ordering::SeqCst);
        self.wait_idle();
        self.inner.rings.signal_all();
    }

    /// Blocks until every request popped from any queue has been answered.
    pub fn wait_idle(&self) {
        for q in &self.inner.queues {
            q.in_flight.wait_idle();
        }
    }

    /// The virtio-blk config space as the guest sees it.
    fn config_space(&self) -> [u8; CONFIG_LEN] {
        let inner = &self.inner;
        let mut c = [0u8; CONFIG_LEN];
        let capacity = inner.ctx.disk.capacity() / SECTOR_SIZE;
        c[0..8].copy_from_slice(&capacity.to_le_bytes());
        c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        c[12..16].copy_from_slice(&inner.seg_max.to_le_bytes());
        let blk_size = inner.ctx.disk.device().logical_block_size();
        c[20..24].copy_from_slice(&blk_size.to_le_bytes());
        // Topology, in units of logical blocks (Linux multiplies each field by blk_size):
        // physical_block_exp = log2(physical / logical) = 0, as a BlockDevice's physical
        // block is its logical block (a LUKS volume's encryption sector, or 512 for raw);
        // alignment_offset 0; min_io_size 1 block, so guests never issue sub-block I/O;
        // opt_io_size 0 (no preference: every request size costs the same per byte).
        c[24] = 0; // physical_block_exp
        c[25] = 0; // alignment_offset
        c[26..28].copy_from_slice(&1u16.to_le_bytes()); // min_io_size
        c[28..32].copy_from_slice(&0u32.to_le_bytes()); // opt_io_size
        c[CONFIG_WCE_OFFSET] = u8::from(inner.ctx.writeback.load(Ordering::Relaxed));
        c[34..36].copy_from_slice(&inner.num_queues.to_le_bytes());
        if inner.ctx.disk.discard() {
            c[36..40].copy_from_slice(&MAX_DISCARD_SECTORS.to_le_bytes());
            c[40..44].copy_from_slice(&1u32.to_le_bytes()); // max_discard_seg
            let align = (blk_size / SECTOR_SIZE as u32).max(1); // discard_sector_alignment
            c[44..48].copy_from_slice(&align.to_le_bytes());
        }
        c[48..52].copy_from_slice(&MAX_WRITE_ZEROES_SECTORS.to_le_bytes());
        c[52..56].copy_from_slice(&1u32.to_le_bytes()); // max_write_zeroes_seg
        c[56] = 0; // write_zeroes_may_unmap: zeroes are always written
        c
    }

    /// Pops every available request of one queue (when `pop`), after the heads in
    /// `resubmit`. Rejected chains are answered at once; the
    /// valid ones form a batch that this thread works through together with pool threads
    /// woken to help (`helpers_for`), so a deep queue spreads over the cores while a lone
    /// request pays no hand-off. This thread does not wait for the helpers: it goes back to
    /// the queue as soon as the batch is empty.
    fn process_queue(
        &self,
        vring: &Vring,
        queue: &Arc<QueueState>,
        resubmit: &[u16],
        pop: bool,
    ) -> io::Result<()> {
        let inner = &self.inner;
        let atomic = inner
            .mem
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mem = atomic.memory().into_inner();
        let part = inner.rings.part(queue.index);
        let mut requests = VecDeque::new();
        let mut rejected_unsignalled = false;
        // Counts as in flight while popping: a chain popped but not yet counted would
        // otherwise let GET_VRING_BASE (`stop_vring`) hand the ring back, and report
        // `FrontendEvent::Stopped`, before that request is answered. Pops fail once the
        // frontend stopped the ring, so this only waits for a pop already under way.
        let popping = Popping::new(&queue.in_flight);
        // inflight: requests a predecessor daemon took from the ring and did not complete,
        // oldest first. Still marked in flight; parsed and run like new ones.
        if !resubmit.is_empty() {
            let (table, size) = {
                let state = vring.get_ref();
                (state.get_queue().desc_table(), state.get_queue().size())
            };
            for &head in resubmit {
                let chain = Chain::new(&*mem, GuestAddress(table), size, head);
                rejected_unsignalled |= self.take_request(
                    &mem,
                    vring,
                    part.as_deref(),
                    queue,
                    head,
                    chain,
                    &mut requests,
                )?;
            }
        }
        // A stopping daemon takes nothing new (`drain`).
        while pop && !inner.draining.load(Ordering::SeqCst) {
            let chain = vring
                .get_mut()
                .get_queue_mut()
                .pop_descriptor_chain(atomic.memory());
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            fault::hit(Point::Popped);
            // inflight: mark the head taken before anything else happens to it.
            if let Some(part) = &part {
                part.popped(head);
            }
            fault::hit(Point::Marked);
            rejected_unsignalled |= self.take_request(
                &mem,
                vring,
                part.as_deref(),
                queue,
                head,
                chain,
                &mut requests,
            )?;
        }
        if rejected_unsignalled {
            signal(vring)?;
        }
        drop(popping);
        if requests.is_empty() {
            return Ok(());
        }
        let helpers = helpers_for(&requests, queue, inner.executor.threads());
        let batch = Arc::new(Batch {
            ctx: inner.ctx.clone(),
            mem,
            vring: vring.clone(),
            part,
            queue: queue.clone(),
            requests: Mutex::new(requests),
        });
        for _ in 0..helpers {
            let batch = batch.clone();
            inner.executor.spawn(Box::new(move || batch.work()));
        }
        batch.work();
        Ok(())
    }

    /// Parses the chain of `head`: a valid request joins `requests` (and counts as in
    /// flight), a rejected one is answered at once. Returns whether it was rejected.
    #[allow(clippy::too_many_arguments)]
    fn take_request(
        &self,
        mem: &GuestMem,
        vring: &Vring,
        part: Option<&QueuePart>,
        queue: &QueueState,
        head: u16,
        descriptors: impl IntoIterator<Item = Descriptor>,
        requests: &mut VecDeque<Pending>,
    ) -> io::Result<bool> {
        let inner = &self.inner;
        let mut segments = Vec::new();
        match request::parse(
            mem,
            descriptors,
            inner.seg_max as usize + 2,
            SIZE_MAX,
            inner.ctx.disk.capacity(),
            &mut segments,
        ) {
            Ok(req) => {
                queue.in_flight.inc();
                requests.push_back(Pending {
                    head,
                    req,
                    segments,
                    start: queue.stats.begin(),
                });
                Ok(false)
            }
            Err(rejected) => {
                tracing::debug!("rejected request: {}", rejected.error);
                let used_len = inner.ctx.disk.reject(mem, &rejected);
                inflight::add_used(vring, part, head, used_len)
                    .map_err(|e| io::Error::other(format!("add_used: {e}")))?;
                Ok(true)
            }
        }
    }
}

/// A queue thread popping requests, counted in the queue's `InFlight` until dropped.
struct Popping<'a>(&'a InFlight);

impl<'a> Popping<'a> {
    fn new(in_flight: &'a InFlight) -> Self {
        in_flight.inc();
        Popping(in_flight)
    }
}

impl Drop for Popping<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Expected work per woken helper. Waking a thread costs a few microseconds and, on a busy
/// machine, takes a core from someone else; a helper pays off when it takes over tens of
/// microseconds of work. Chosen with `tests/throughput.rs` on 2 vCPUs (4k and 64k requests,
/// depth 32): waking one helper per two requests halved 4k IOPS compared with this rule.
const WORK_PER_HELPER_NS: u64 = 32_000;

/// How many pool threads to wake for a batch: enough that each thread gets about
/// `WORK_PER_HELPER_NS` of work, judged by the queue's recent request service time, so
/// page-cache hits stay on few threads while slow device reads or large crypto get many.
fn helpers_for(requests: &VecDeque<Pending>, queue: &QueueState, threads: usize) -> usize {
    let n = requests.len();
    if n < 2 {
        return 0;
    }
    // Before any measurement, assume the requests are slow enough to spread.
    let avg = queue.avg_service_ns.load(Ordering::Relaxed).max(1);
    let work = (n as u64).saturating_mul(avg);
    let wanted = usize::try_from(work / WORK_PER_HELPER_NS).unwrap_or(usize::MAX);
    wanted.min(n - 1).min(threads)
}

/// Requests popped together, claimed one by one by the queue thread and its helpers.
struct Batch {
    ctx: Arc<RequestContext>,
    mem: Arc<GuestMem>,
    vring: Vring,
    /// The ring's inflight part, if tracked.
    part: Option<Arc<QueuePart>>,
    queue: Arc<QueueState>,
    requests: Mutex<VecDeque<Pending>>,
}

impl Batch {
    fn next(&self) -> Option<Pending> {
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
    }

    /// Runs requests until the batch is empty. The guest is signalled every `SIGNAL_BATCH`
    /// completions and when this thread runs out of work, not after each request.
    fn work(&self) {
        let mut unsignalled = 0u32;
        while let Some(pending) = self.next() {
            run_request(
                &self.ctx,
                &self.mem,
                &self.vring,
                self.part.as_deref(),
                &self.queue,
                pending,
            );
            unsignalled += 1;
            if unsignalled >= SIGNAL_BATCH {
                self.signal();
                unsignalled = 0;
            }
        }
        if unsignalled > 0 {
            self.signal();
        }
    }

    fn signal(&self) {
        if let Err(e) = signal(&self.vring) {
            tracing::warn!("signalling the guest: {e}");
        }
    }
}

/// Executes one request and puts it on the used ring (the caller signals the guest).
fn run_request(
    ctx: &RequestContext,
    mem: &GuestMem,
    vring: &Vring,
    part: Option<&QueuePart>,
    queue: &QueueState,
    pending: Pending,
) {
    let Pending {
        head,
        req,
        segments,
        start,
    } = pending;
    let began = Instant::now();
    let (status, used_len) = ctx.disk.execute_with_status(mem, &req, &segments);
    let writes = matches!(
        req.kind,
        RequestType::Out | RequestType::WriteZeroes | RequestType::Discard
    );
    if writes && !ctx.writeback.load(Ordering::Relaxed) {
        if let Err(e) = ctx.disk.device().flush() {
            tracing::warn!("write-through flush: {e}");
        }
    }
    let (kind, bytes) = match req.kind {
        RequestType::In => (IoKind::Read, req.data_len),
        RequestType::Out => (IoKind::Write, req.data_len),
        RequestType::Flush => (IoKind::Flush, 0),
        RequestType::Discard => (IoKind::Discard, 0),
        _ => (IoKind::Other, 0),
    };
    queue
        .stats
        .complete(kind, bytes, start, status == crate::device::STATUS_OK);
    // EWMA with weight 1/8; a lost update between threads only delays adaptation.
    let took = u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX / 1024);
    let avg = queue.avg_service_ns.load(Ordering::Relaxed);
    let next = avg - avg / 8 + took.min(u64::MAX / 1024) / 8;
    queue.avg_service_ns.store(next, Ordering::Relaxed);
    // inflight: recorded around the used ring update, under the ring's lock.
    if let Err(e) = inflight::add_used(vring, part, head, used_len) {
        // The ring is unusable (e.g. the frontend reset it); the connection's next message
        // or disconnect handles that. The request is still no longer in flight.
        tracing::warn!("completing request: {e}");
    }
    queue.in_flight.dec();
}

/// Interrupts the guest if it wants to hear about the new used entries (EVENT_IDX).
fn signal(vring: &Vring) -> io::Result<()> {
    fault::hit(Point::BeforeSignal);
    if vring
        .needs_notification()
        .map_err(|e| io::Error::other(format!("needs_notification: {e}")))?
    {
        vring.signal_used_queue()?;
    }
    Ok(())
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = crate::LogBitmap;
    type Vring = TrackedVring;

    fn num_queues(&self) -> usize {
        usize::from(self.inner.num_queues)
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.inner.queue_size)
    }

    fn features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1 << VIRTIO_BLK_F_SIZE_MAX)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_BLK_SIZE)
            | (1 << VIRTIO_BLK_F_TOPOLOGY)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_CONFIG_WCE)
            | (1 << VIRTIO_BLK_F_MQ)
            // Dirty page logging for live migration: every guest page the device writes
            // is marked in the frontend's log once SET_LOG_BASE shared it (see `GuestMem`).
            | VhostUserVirtioFeatures::LOG_ALL.bits()
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if self.inner.ctx.disk.read_only() {
            f |= 1 << VIRTIO_BLK_F_RO;
        } else {
            f |= 1 << VIRTIO_BLK_F_WRITE_ZEROES;
            if self.inner.ctx.disk.discard() {
                f |= 1 << VIRTIO_BLK_F_DISCARD;
            }
        }
        f
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            // Memory shared region by region (ADD_MEM_REG/REM_MEM_REG), which libblkio
            // requires and vhost-user-backend implements.
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            // The dirty log comes as a shared memory fd (SET_LOG_BASE), as QEMU requires
            // with LOG_ALL.
            | VhostUserProtocolFeatures::LOG_SHMFD
            // Requests in flight are recorded in a region the frontend keeps, so that a
            // restarted daemon resubmits them (`inflight`).
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
    }

    fn acked_features(&self, features: u64) {
        self.inner
            .frontend
            .set_log_all(features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0);
    }

    fn set_event_idx(&self, enabled: bool) {
        self.inner.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let (offset, size) = (offset as usize, size as usize);
        let Some(end) = offset.checked_add(size).filter(|&e| e <= CONFIG_MAX) else {
            return Vec::new();
        };
        let mut out = vec![0u8; size];
        let config = self.config_space();
        for (i, byte) in (offset..end).zip(out.iter_mut()) {
            if let Some(b) = config.get(i) {
                *byte = *b;
            }
        }
        out
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        // Only the writeback byte is guest-writable.
        let offset = offset as usize;
        if let Some(rel) = CONFIG_WCE_OFFSET.checked_sub(offset) {
            if let Some(&wce) = buf.get(rel) {
                self.inner.ctx.writeback.store(wce != 0, Ordering::Relaxed);
                if wce == 0 {
                    // Switching to write-through: make earlier writes durable now.
                    self.inner
                        .ctx
                        .disk
                        .device()
                        .flush()
                        .map_err(|e| io::Error::other(e.to_string()))?;
                }
            }
        }
        Ok(())
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<GuestMem>) -> io::Result<()> {
        *self
            .inner
            .mem
            .write()
            .unwrap_or_else(PoisonError::into_inner) = mem;
        Ok(())
    }

    /// GET_VRING_BASE stops a ring: answer every request popped from it first, so the index
    /// handed back to the frontend covers only finished requests and nothing writes to the
    /// ring after the frontend took it back. When it was the last running ring, reports
    /// `FrontendEvent::Stopped`.
    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        let index = queue_index as usize;
        if let Some(q) = self.inner.queues.get(index) {
            // inflight: a ring stopped before its worker saw it start still owes the requests
            // a predecessor left in flight; run them here (the ring takes no new ones now).
            let resubmit = self.inner.rings.take_resubmits(index);
            if let (false, Some(vring)) = (resubmit.is_empty(), self.inner.rings.vring(index)) {
                self.process_queue(&vring, q, &resubmit, false)?;
            }
            q.in_flight.wait_idle();
        }
        self.inner.rings.ring_stopped(index);
        self.inner.frontend.queue_stopped(index);
        Ok(())
    }

    fn get_inflight_fd(&self, msg: &VhostUserInflight) -> io::Result<(VhostUserInflight, File)> {
        self.inner.rings.get_fd(msg)
    }

    fn set_inflight_fd(&self, msg: &VhostUserInflight, file: File) -> io::Result<()> {
        self.inner.rings.set_fd(msg, file)
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.inner.num_queues).map(|q| 1u64 << q).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[TrackedVring],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected event set {evset:?}")));
        }
        let vring = vrings
            .get(usize::from(device_event))
            .map(TrackedVring::vring)
            .ok_or_else(|| io::Error::other(format!("no vring for event {device_event}")))?;
        // One queue per thread: the thread index is the queue index.
        let queue = self
            .inner
            .queues
            .get(thread_id)
            .ok_or_else(|| io::Error::other(format!("no queue for thread {thread_id}")))?;
        // inflight: a ring just started (or enabled) first resubmits what a predecessor daemon
        // left in flight, and signals the guest even with nothing to do: completions a killed
        // predecessor put on the used ring may never have been signalled.
        let started = self.inner.frontend.take_start(thread_id);
        let resubmit = if started {
            self.inner.rings.take_resubmits(thread_id)
        } else {
            Vec::new()
        };
        if self.inner.event_idx.load(Ordering::Relaxed) {
            // Keep draining until the guest added nothing between the last pop and re-enabling
            // notifications (virtio's EVENT_IDX protocol), so no kick is lost.
            let mut resubmit = resubmit.as_slice();
            loop {
                vring
                    .disable_notification()
                    .map_err(|e| io::Error::other(format!("disable_notification: {e}")))?;
                self.process_queue(vring, queue, std::mem::take(&mut resubmit), true)?;
                if self.inner.draining.load(Ordering::SeqCst)
                    || !vring
                        .enable_notification()
                        .map_err(|e| io::Error::other(format!("enable_notification: {e}")))?
                {
                    break;
                }
            }
        } else {
            self.process_queue(vring, queue, &resubmit, true)?;
        }
        if started {
            vring.signal_used_queue()?;
        }
        Ok(())
    }
}
