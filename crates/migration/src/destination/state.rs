//! What the destination's threads share: the session (once a source said Hello), its phase and
//! counters, and the writers on which on-demand requests go out.

use super::store::IncomingStore;
use crate::channel::{Closer, MigrationListener};
use crate::latency::LatencyHistogram;
use crate::wire::{Hello, FLAG_AWAITS_READY, FLAG_CHECKPOINTS, FLAG_SHARED, SESSION_ID_LEN};
use crate::{DirtyBitmap, MigrationError, Phase};
use cryptblk_block::Container;
use cryptblk_volume::checkpoint::CarriedCheckpoints;
use std::io::Write;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Instant;

pub(super) type SharedWriter = Arc<Mutex<Box<dyn Write + Send>>>;

/// What the destination knows once a source said Hello.
pub(super) struct Created {
    pub(super) file: Arc<dyn Container>,
    /// Blocks (file offsets) whose current contents are here. Before postcopy: written at
    /// least once; at postcopy: everything but what the source listed as missing.
    pub(super) received: DirtyBitmap,
    /// Blocks asked for on demand (and maybe not received yet).
    pub(super) requested: DirtyBitmap,
    pub(super) hello: Hello,
}

impl Created {
    /// Whether the source hands over shared storage instead of copying the disk.
    pub(super) fn shared(&self) -> bool {
        self.hello.flags & FLAG_SHARED != 0
    }

    /// Whether the source waits for this side's `Ready` before it switches over (when this
    /// side announces it).
    pub(super) fn awaits_ready(&self) -> bool {
        self.hello.flags & FLAG_AWAITS_READY != 0
    }

    /// Whether the source sends its checkpoints at switchover (this side accepted them).
    pub(super) fn carries_checkpoints(&self) -> bool {
        self.hello.flags & FLAG_CHECKPOINTS != 0 && !self.shared()
    }
}

/// Takes the checkpoints a source carried (`None`: it sent none), before the destination goes
/// live: see [`IncomingMigration::on_checkpoints`](super::IncomingMigration::on_checkpoints).
pub type CheckpointsHook = Box<dyn FnOnce(Option<CarriedCheckpoints>) + Send>;

/// Where the carried checkpoints are between their arrival and the daemon.
#[derive(Default)]
pub(super) enum CheckpointsSlot {
    #[default]
    Waiting,
    Hook(CheckpointsHook),
    Arrived(Option<CarriedCheckpoints>),
    Delivered,
}

pub(super) struct DState {
    pub(super) phase: Phase,
    pub(super) error: Option<String>,
    pub(super) session: Option<[u8; SESSION_ID_LEN]>,
    pub(super) bulk_writer: Option<SharedWriter>,
    pub(super) urgent_writer: Option<SharedWriter>,
    pub(super) closers: Vec<Closer>,
    pub(super) generation: u64,
    pub(super) missing_listed: bool,
    pub(super) bytes_received: u64,
    pub(super) zero_bytes: u64,
    pub(super) chunks: u64,
    pub(super) passes: u32,
    pub(super) urgent_requests: u64,
    pub(super) latency: LatencyHistogram,
    pub(super) live_at: Option<Instant>,
    pub(super) finished_at: Option<Instant>,
    /// The failed migration's image could not be removed while open: removed on drop.
    pub(super) remove_pending: bool,
    /// Shared storage: the source named the image this side serves.
    pub(super) identity_confirmed: bool,
    /// The source sent its checkpoints (once only).
    pub(super) checkpoints_received: bool,
    /// `IncomingMigration::ready` was called: the disk serves (I/O waits for the switchover).
    pub(super) ready: bool,
}

pub(super) struct DShared {
    pub(super) state: Mutex<DState>,
    pub(super) cond: Condvar,
    /// Orders writes of arriving data against guest writes (postcopy).
    pub(super) apply: Mutex<()>,
    /// `phase` as a number, for the I/O fast path.
    pub(super) phase_fast: AtomicU8,
    pub(super) created: OnceLock<Created>,
    pub(super) store: Arc<dyn IncomingStore>,
    pub(super) checkpoints: Mutex<CheckpointsSlot>,
    pub(super) listener: MigrationListener,
    pub(super) started: Instant,
    /// This side says `Ready` to a source that waits for it (`ListenOptions::announces_ready`).
    pub(super) announces_ready: bool,
}

impl Drop for DShared {
    fn drop(&mut self) {
        let pending = self
            .state
            .get_mut()
            .map(|s| s.remove_pending)
            .unwrap_or(false);
        if pending {
            // Close the image first, then remove it.
            drop(self.created.take());
            if !self.store.remove() {
                tracing::warn!(
                    image = %self.store.name().display(),
                    "could not remove the image of a failed incoming migration; remove it by hand"
                );
            }
        }
    }
}

pub(super) fn phase_code(p: Phase) -> u8 {
    p as u8
}

impl DShared {
    pub(super) fn lock(&self) -> MutexGuard<'_, DState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn set_phase(&self, s: &mut DState, phase: Phase) {
        s.phase = phase;
        self.phase_fast.store(phase_code(phase), Ordering::Release);
        if phase == Phase::Postcopy && s.live_at.is_none() {
            s.live_at = Some(Instant::now());
        }
        if phase.is_final() {
            s.finished_at = Some(Instant::now());
            // After Complete the source hangs up once it has read our answer; closing first
            // could let it see a broken channel before that answer.
            if phase != Phase::Completed {
                for c in s.closers.drain(..) {
                    c.close();
                }
            }
            self.listener.shutdown();
        }
        self.cond.notify_all();
    }

    /// Hands the carried checkpoints on (`Some`: the frame arrived), or at the switchover
    /// (`None`) says that none came if none did; the hook, when set, runs now, on this thread,
    /// before the caller lets the destination go live.
    pub(super) fn deliver_checkpoints(&self, carried: Option<CarriedCheckpoints>) {
        let mut slot = self
            .checkpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match std::mem::take(&mut *slot) {
            CheckpointsSlot::Hook(hook) => {
                *slot = CheckpointsSlot::Delivered;
                hook(carried);
            }
            CheckpointsSlot::Waiting => *slot = CheckpointsSlot::Arrived(carried),
            CheckpointsSlot::Arrived(Some(c)) => *slot = CheckpointsSlot::Arrived(Some(c)),
            CheckpointsSlot::Arrived(None) => *slot = CheckpointsSlot::Arrived(carried),
            CheckpointsSlot::Delivered => *slot = CheckpointsSlot::Delivered,
        }
    }

    pub(super) fn created(&self) -> Result<&Created, MigrationError> {
        self.created
            .get()
            .ok_or_else(|| MigrationError::Protocol("data before Hello".into()))
    }

    /// Ends the migration before the destination went live: the half-written image is
    /// removed (it was created by this migration and holds nothing usable).
    pub(super) fn fail(&self, s: &mut DState, phase: Phase, error: String) {
        tracing::warn!("incoming migration {phase}: {error}");
        s.error = Some(error);
        self.set_phase(s, phase);
        if self.created.get().is_some() && !self.store.remove() {
            s.remove_pending = true;
        }
    }
}
