//! What the frontend (the VMM) does with the device's queues, as events for the daemon:
//! when it starts them and when it has stopped all of them, and whether it asked for dirty
//! page logging (VHOST_F_LOG_ALL, set by QEMU while a live migration runs).
//!
//! vhost-user-backend tells a backend when a ring stops (GET_VRING_BASE, `stop_vring`) but
//! not when one starts, so the rings are wrapped (`TrackedVring`): the handler marks a ring
//! ready once its kick and call descriptors are set (the frontend started it) and not ready
//! on GET_VRING_BASE, and the wrapper reports both transitions to `FrontendState`. A start
//! (and an enable) also hands the ring to the connection's `inflight::Rings`, which takes over
//! what a predecessor daemon left in flight, and is noted for the ring's worker
//! (`FrontendState::take_start`), which then resubmits that and signals the guest.

use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLockReadGuard, RwLockWriteGuard};

use vhost_user_backend::{VringRwLock, VringState, VringStateGuard, VringStateMutGuard, VringT};
use virtio_queue::Error as VirtQueError;
use vm_memory::GuestMemoryAtomic;

use crate::inflight::Rings;
use crate::GuestMem;

/// What the frontend did with the device, reported to the listener registered with
/// `Server::set_event_listener`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrontendEvent {
    /// The frontend started the device's queues: the first queue became ready after the
    /// connection was set up, or after a `Stopped` (a VM resumed, e.g. after a failed or
    /// cancelled migration, or a destination VM starting).
    Started,
    /// The frontend stopped every queue it had started (GET_VRING_BASE on the last running
    /// queue), and every request popped from those queues has been answered: the device does
    /// no more I/O and writes no more guest memory until the next `Started`.
    ///
    /// `dirty_logging` is whether VHOST_F_LOG_ALL was negotiated at that moment. QEMU sets it
    /// (SET_FEATURES) when a live migration starts, so `Stopped { dirty_logging: true }` means
    /// "the VM was stopped to complete a migration"; a plain stop (`stop` in the monitor, a
    /// guest reset, a shutdown) reports `false`.
    Stopped { dirty_logging: bool },
}

/// The callback type: called on the vhost-user message thread of the connection, so it
/// should return quickly (hand work to another thread).
pub type EventListener = Arc<dyn Fn(FrontendEvent) + Send + Sync>;

/// The connection-wide state the rings and the backend report to.
#[derive(Default)]
pub(crate) struct FrontendState {
    listener: Mutex<Option<EventListener>>,
    /// VHOST_F_LOG_ALL is in the features the frontend acked last.
    log_all: AtomicBool,
    queues: Mutex<QueueBits>,
}

#[derive(Default)]
struct QueueBits {
    /// One bit per ready (started) queue.
    ready: u64,
    /// One bit per queue started or enabled since its worker last looked (`take_start`).
    unseen_starts: u64,
    /// Queues were started and have not all been stopped since.
    running: bool,
}

impl FrontendState {
    pub(crate) fn set_listener(&self, listener: Option<EventListener>) {
        *self.listener.lock().unwrap_or_else(PoisonError::into_inner) = listener;
    }

    /// A new connection: no queue runs, no feature is acked.
    pub(crate) fn reset(&self) {
        self.log_all.store(false, Ordering::SeqCst);
        *self.queues.lock().unwrap_or_else(PoisonError::into_inner) = QueueBits::default();
    }

    pub(crate) fn set_log_all(&self, on: bool) {
        self.log_all.store(on, Ordering::SeqCst);
    }

    pub(crate) fn log_all(&self) -> bool {
        self.log_all.load(Ordering::SeqCst)
    }

    fn emit(&self, event: FrontendEvent) {
        tracing::info!("vhost-user frontend: {event:?}");
        let listener = self
            .listener
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(listener) = listener {
            listener(event);
        }
    }

    /// Ring `index` became ready (true) or was stopped (false).
    fn queue_ready(&self, index: usize, ready: bool) {
        let Some(bit) = 1u64.checked_shl(index as u32) else {
            return;
        };
        let started = {
            let mut q = self.queues.lock().unwrap_or_else(PoisonError::into_inner);
            if ready {
                q.ready |= bit;
                q.unseen_starts |= bit;
                !std::mem::replace(&mut q.running, true)
            } else {
                q.ready &= !bit;
                false
            }
        };
        if started {
            self.emit(FrontendEvent::Started);
        }
    }

    /// Ring `index` was enabled (SET_VRING_ENABLE 1): its worker treats that as a start.
    fn queue_enabled(&self, index: usize) {
        if let Some(bit) = 1u64.checked_shl(index as u32) {
            self.queues
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .unseen_starts |= bit;
        }
    }

    /// True once after ring `index` was started or enabled: its worker then resubmits what a
    /// predecessor left in flight and signals the guest even with nothing new to complete.
    pub(crate) fn take_start(&self, index: usize) -> bool {
        let Some(bit) = 1u64.checked_shl(index as u32) else {
            return false;
        };
        let mut q = self.queues.lock().unwrap_or_else(PoisonError::into_inner);
        let started = q.unseen_starts & bit != 0;
        q.unseen_starts &= !bit;
        started
    }

    /// Called from `stop_vring` once ring `index` has no request in flight: reports
    /// `Stopped` when it was the last running ring.
    pub(crate) fn queue_stopped(&self, index: usize) {
        let stopped = {
            let mut q = self.queues.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(bit) = 1u64.checked_shl(index as u32) {
                q.ready &= !bit;
            }
            q.ready == 0 && std::mem::replace(&mut q.running, false)
        };
        if stopped {
            self.emit(FrontendEvent::Stopped {
                dirty_logging: self.log_all(),
            });
        }
    }
}

type Mem = GuestMemoryAtomic<GuestMem>;

/// Where a ring reports: the server's `FrontendState`, the connection's `Rings`, its index.
#[derive(Clone)]
struct RingTracker {
    state: Arc<FrontendState>,
    rings: Arc<Rings>,
    index: usize,
}

thread_local! {
    /// What the rings created on this thread report to, with the index of the next ring; set
    /// by `Server` around `VhostUserDaemon::new`, which creates the rings in order.
    static PENDING: RefCell<Option<RingTracker>> = const { RefCell::new(None) };
}

/// Makes the rings created on this thread until `end_tracking` report to `state` and `rings`.
pub(crate) fn begin_tracking(state: Arc<FrontendState>, rings: Arc<Rings>) {
    PENDING.with(|p| {
        *p.borrow_mut() = Some(RingTracker {
            state,
            rings,
            index: 0,
        })
    });
}

pub(crate) fn end_tracking() {
    PENDING.with(|p| *p.borrow_mut() = None);
}

/// A `VringRwLock` that reports when the frontend starts and stops it.
#[derive(Clone)]
pub struct TrackedVring {
    inner: VringRwLock<Mem>,
    tracker: Option<RingTracker>,
}

impl TrackedVring {
    /// The ring itself.
    pub fn vring(&self) -> &VringRwLock<Mem> {
        &self.inner
    }
}

impl<'a> VringStateGuard<'a, Mem> for TrackedVring {
    type G = RwLockReadGuard<'a, VringState<Mem>>;
}

impl<'a> VringStateMutGuard<'a, Mem> for TrackedVring {
    type G = RwLockWriteGuard<'a, VringState<Mem>>;
}

impl VringT<Mem> for TrackedVring {
    fn new(mem: Mem, max_queue_size: u16) -> Result<Self, VirtQueError> {
        let tracker = PENDING.with(|p| {
            p.borrow_mut().as_mut().map(|next| {
                let tracker = next.clone();
                next.index += 1;
                tracker
            })
        });
        Ok(TrackedVring {
            inner: VringRwLock::new(mem, max_queue_size)?,
            tracker,
        })
    }

    fn get_ref(&self) -> <Self as VringStateGuard<'_, Mem>>::G {
        self.inner.get_ref()
    }

    fn get_mut(&self) -> <Self as VringStateMutGuard<'_, Mem>>::G {
        self.inner.get_mut()
    }

    fn add_used(&self, desc_index: u16, len: u32) -> Result<(), VirtQueError> {
        self.inner.add_used(desc_index, len)
    }

    fn signal_used_queue(&self) -> io::Result<()> {
        self.inner.signal_used_queue()
    }

    fn enable_notification(&self) -> Result<bool, VirtQueError> {
        self.inner.enable_notification()
    }

    fn disable_notification(&self) -> Result<(), VirtQueError> {
        self.inner.disable_notification()
    }

    fn needs_notification(&self) -> Result<bool, VirtQueError> {
        self.inner.needs_notification()
    }

    fn set_enabled(&self, enabled: bool) {
        self.inner.set_enabled(enabled);
        if let (true, Some(t)) = (enabled, &self.tracker) {
            t.state.queue_enabled(t.index);
        }
    }

    fn set_queue_info(
        &self,
        desc_table: u64,
        avail_ring: u64,
        used_ring: u64,
    ) -> Result<(), VirtQueError> {
        self.inner.set_queue_info(desc_table, avail_ring, used_ring)
    }

    fn queue_next_avail(&self) -> u16 {
        self.inner.queue_next_avail()
    }

    fn set_queue_next_avail(&self, base: u16) {
        self.inner.set_queue_next_avail(base)
    }

    fn set_queue_next_used(&self, idx: u16) {
        self.inner.set_queue_next_used(idx)
    }

    fn queue_used_idx(&self) -> Result<u16, VirtQueError> {
        self.inner.queue_used_idx()
    }

    fn set_queue_size(&self, num: u16) {
        self.inner.set_queue_size(num)
    }

    fn set_queue_event_idx(&self, enabled: bool) {
        self.inner.set_queue_event_idx(enabled)
    }

    fn set_queue_ready(&self, ready: bool) {
        self.inner.set_queue_ready(ready);
        if let Some(t) = &self.tracker {
            if ready {
                // Before the ring is registered with its worker (the handler does that next).
                t.rings.ring_started(t.index, &self.inner);
            }
            t.state.queue_ready(t.index, ready);
        }
    }

    fn set_kick(&self, file: Option<File>) {
        self.inner.set_kick(file)
    }

    fn read_kick(&self) -> io::Result<bool> {
        self.inner.read_kick()
    }

    fn set_call(&self, file: Option<File>) {
        self.inner.set_call(file)
    }

    fn set_err(&self, file: Option<File>) {
        self.inner.set_err(file)
    }
}
