//! The `VhostUserBackend` implementation: features, config space and the per-queue workers.
//!
//! vhost-user-backend runs one epoll thread per queue (`queues_per_thread`); each thread only
//! touches its own vring and its own `QueueWorker` (behind a per-queue mutex that nothing else
//! contends), so queues never serialize on a backend-wide lock.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::device::{Disk, MAX_DISCARD_SECTORS, MAX_WRITE_ZEROES_SECTORS};
use crate::request::{self, Segment, SECTOR_SIZE};

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

/// Per-queue state, touched only by that queue's worker thread.
struct QueueWorker {
    /// Data segments of the request being parsed; reused so requests do not allocate.
    segments: Vec<Segment>,
}

struct Inner {
    disk: Disk,
    num_queues: u16,
    queue_size: u16,
    seg_max: u32,
    event_idx: AtomicBool,
    /// Guest write cache enabled (CONFIG_WCE); when off, every write is followed by a flush.
    writeback: AtomicBool,
    mem: RwLock<GuestMemoryAtomic<GuestMemoryMmap>>,
    queues: Vec<Mutex<QueueWorker>>,
}

/// The backend handed to `VhostUserDaemon`; cheap to clone (one per worker thread).
#[derive(Clone)]
pub struct BlkBackend {
    inner: Arc<Inner>,
}

impl BlkBackend {
    pub fn new(
        disk: Disk,
        num_queues: u16,
        queue_size: u16,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
    ) -> Self {
        let seg_max = u32::from(queue_size.saturating_sub(2)).max(1);
        let queues = (0..num_queues)
            .map(|_| {
                Mutex::new(QueueWorker {
                    segments: Vec::with_capacity(seg_max as usize),
                })
            })
            .collect();
        BlkBackend {
            inner: Arc::new(Inner {
                disk,
                num_queues,
                queue_size,
                seg_max,
                event_idx: AtomicBool::new(false),
                writeback: AtomicBool::new(true),
                mem: RwLock::new(mem),
                queues,
            }),
        }
    }

    /// The virtio-blk config space as the guest sees it.
    fn config_space(&self) -> [u8; CONFIG_LEN] {
        let inner = &self.inner;
        let mut c = [0u8; CONFIG_LEN];
        let capacity = inner.disk.capacity() / SECTOR_SIZE;
        c[0..8].copy_from_slice(&capacity.to_le_bytes());
        c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        c[12..16].copy_from_slice(&inner.seg_max.to_le_bytes());
        let blk_size = inner.disk.device().logical_block_size();
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
        c[CONFIG_WCE_OFFSET] = u8::from(inner.writeback.load(Ordering::Relaxed));
        c[34..36].copy_from_slice(&inner.num_queues.to_le_bytes());
        if inner.disk.discard() {
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

    /// Pops and answers every available request of one queue; signals the guest every
    /// `SIGNAL_BATCH` completions and at the end, when it wants a notification.
    fn process_queue(&self, vring: &VringRwLock, worker: &mut QueueWorker) -> io::Result<()> {
        let inner = &self.inner;
        let atomic = inner
            .mem
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mem = atomic.memory();
        let max_descriptors = inner.seg_max as usize + 2;
        let capacity = inner.disk.capacity();
        let mut unsignalled = 0u32;
        loop {
            let chain = vring
                .get_mut()
                .get_queue_mut()
                .pop_descriptor_chain(atomic.memory());
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let used_len = match request::parse(
                &*mem,
                chain,
                max_descriptors,
                SIZE_MAX,
                capacity,
                &mut worker.segments,
            ) {
                Ok(req) => {
                    let n = inner.disk.execute(&*mem, &req, &worker.segments);
                    let writes = matches!(
                        req.kind,
                        request::RequestType::Out
                            | request::RequestType::WriteZeroes
                            | request::RequestType::Discard
                    );
                    if writes && !inner.writeback.load(Ordering::Relaxed) {
                        if let Err(e) = inner.disk.device().flush() {
                            tracing::warn!("write-through flush: {e}");
                        }
                    }
                    n
                }
                Err(rejected) => {
                    tracing::debug!("rejected request: {}", rejected.error);
                    inner.disk.reject(&*mem, &rejected)
                }
            };
            vring
                .add_used(head, used_len)
                .map_err(|e| io::Error::other(format!("add_used: {e}")))?;
            unsignalled += 1;
            // Coalesce completions, but do not hold a long batch back from the guest.
            if unsignalled >= SIGNAL_BATCH {
                Self::signal(vring)?;
                unsignalled = 0;
            }
        }
        if unsignalled > 0 {
            Self::signal(vring)?;
        }
        Ok(())
    }

    /// Interrupts the guest if it wants to hear about the new used entries (EVENT_IDX).
    fn signal(vring: &VringRwLock) -> io::Result<()> {
        if vring
            .needs_notification()
            .map_err(|e| io::Error::other(format!("needs_notification: {e}")))?
        {
            vring.signal_used_queue()?;
        }
        Ok(())
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

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
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if self.inner.disk.read_only() {
            f |= 1 << VIRTIO_BLK_F_RO;
        } else {
            f |= 1 << VIRTIO_BLK_F_WRITE_ZEROES;
            if self.inner.disk.discard() {
                f |= 1 << VIRTIO_BLK_F_DISCARD;
            }
        }
        f
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
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
                self.inner.writeback.store(wce != 0, Ordering::Relaxed);
                if wce == 0 {
                    // Switching to write-through: make earlier writes durable now.
                    self.inner
                        .disk
                        .device()
                        .flush()
                        .map_err(|e| io::Error::other(e.to_string()))?;
                }
            }
        }
        Ok(())
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<GuestMemoryMmap>) -> io::Result<()> {
        *self
            .inner
            .mem
            .write()
            .unwrap_or_else(PoisonError::into_inner) = mem;
        Ok(())
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
        vrings: &[VringRwLock],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected event set {evset:?}")));
        }
        let vring = vrings
            .get(usize::from(device_event))
            .ok_or_else(|| io::Error::other(format!("no vring for event {device_event}")))?;
        // One queue per thread: the thread index is the queue index.
        let worker = self
            .inner
            .queues
            .get(thread_id)
            .ok_or_else(|| io::Error::other(format!("no queue for thread {thread_id}")))?;
        let mut worker = worker.lock().unwrap_or_else(PoisonError::into_inner);
        if self.inner.event_idx.load(Ordering::Relaxed) {
            // Keep draining until the guest added nothing between the last pop and re-enabling
            // notifications (virtio's EVENT_IDX protocol), so no kick is lost.
            loop {
                vring
                    .disable_notification()
                    .map_err(|e| io::Error::other(format!("disable_notification: {e}")))?;
                self.process_queue(vring, &mut worker)?;
                if !vring
                    .enable_notification()
                    .map_err(|e| io::Error::other(format!("enable_notification: {e}")))?
                {
                    break;
                }
            }
        } else {
            self.process_queue(vring, &mut worker)?;
        }
        Ok(())
    }
}
