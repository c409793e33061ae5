//! What the frontend (the VMM) does with the device's queues, as events for the daemon:
//! when it starts them and when it has stopped all of them, and whether it asked for dirty
//! page logging (VHOST_F_LOG_ALL, set by QEMU while a live migration runs).
//!
//! vhost-user-backend (with the vring hooks of `vendor/`) tells the backend when a ring starts
//! (`start_vring`: its kick is set, after its addresses and base), is enabled or disabled
//! (`set_vring_enabled`) and stops (GET_VRING_BASE, `stop_vring`); the backend reports starts
//! and stops to `FrontendState` (and hands all three to the ring's worker, `worker`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use vhost::vhost_user::{Backend, VhostUserFrontendReqHandler};

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
    /// Which queues run: the message thread's (and `reset`'s, between connections).
    queues: Mutex<RunState>,
    /// The backend request channel the frontend gave (SET_BACKEND_REQ_FD), where the device
    /// tells it of a config change (a resize).
    backend_req: Mutex<Option<Backend>>,
}

#[derive(Default)]
struct RunState {
    /// One bit per ready (started) queue.
    ready: u64,
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
        *self.queues.lock().unwrap_or_else(PoisonError::into_inner) = RunState::default();
        *self
            .backend_req
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// The connection ended: nothing is told on its channel any more.
    pub(crate) fn drop_backend_req(&self) {
        *self
            .backend_req
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }

    pub(crate) fn set_backend_req(&self, backend: Backend) {
        *self
            .backend_req
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(backend);
    }

    /// Sends VHOST_USER_BACKEND_CONFIG_CHANGE_MSG on the backend request channel: the
    /// frontend reads the config space again (GET_CONFIG, answered on the message thread, so
    /// this must not run there) and, when it changed, raises the guest's config interrupt.
    /// With REPLY_ACK this waits for the frontend's answer. False when the frontend gave no
    /// channel (it did not negotiate BACKEND_REQ, or none is connected).
    pub(crate) fn config_changed(&self) -> std::io::Result<bool> {
        let backend = self
            .backend_req
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match backend {
            Some(backend) => backend.handle_config_change().map(|_| true),
            None => Ok(false),
        }
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

    /// Ring `index` was started (its kick set).
    pub(crate) fn queue_started(&self, index: usize) {
        let Some(bit) = 1u64.checked_shl(index as u32) else {
            return;
        };
        let started = {
            let mut q = self.queues.lock().unwrap_or_else(PoisonError::into_inner);
            q.ready |= bit;
            !std::mem::replace(&mut q.running, true)
        };
        if started {
            self.emit(FrontendEvent::Started);
        }
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
