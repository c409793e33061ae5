//! What the source's threads share: the migration's state under one mutex and condvar (phase,
//! counters, queued urgent requests, what other threads asked of the sender), and the channels'
//! writing halves.

use super::options::SourceOptions;
use crate::channel::Closer;
use crate::wire::{
    Hello, Role, FLAG_AWAITS_READY, FLAG_CHECKPOINTS, FLAG_POSTCOPY, FLAG_PREEMPT, FLAG_SHARED,
    PROTOCOL_VERSION, SESSION_ID_LEN,
};
use crate::{DirtyBitmap, DirtyTracker, MigrationError, Phase};
use cryptblk_block::{BlockDevice, Container, SharedStorage};
use std::collections::VecDeque;
use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

pub(super) struct State {
    pub(super) phase: Phase,
    pub(super) error: Option<String>,
    pub(super) bytes_sent: u64,
    pub(super) zero_bytes: u64,
    pub(super) chunks: u64,
    pub(super) passes: u32,
    pub(super) urgent_served: u64,
    pub(super) urgent: VecDeque<(u64, u64)>,
    /// `Some(postcopy)` once a switchover was asked for.
    pub(super) switchover: Option<bool>,
    /// `Some(postcopy)`: a switchover was asked for before the destination served the disk;
    /// the sender fences and switches over when its `Ready` comes (the disk serves meanwhile).
    pub(super) deferred_switchover: Option<bool>,
    /// The destination promised to say `Ready` (its Hello said so): switchovers wait for it.
    pub(super) awaits_ready: bool,
    /// The destination said `Ready`: it serves the disk.
    pub(super) peer_ready: bool,
    pub(super) fenced_at: Option<Instant>,
    pub(super) downtime: Option<Duration>,
    pub(super) cancel: bool,
    /// The destination confirmed Complete.
    pub(super) peer_complete: bool,
    /// Channels of the current generation broke (reader saw an error or an Error frame).
    pub(super) broken: Option<String>,
    pub(super) generation: u64,
    /// New channels from `recover`, for the sender to take.
    pub(super) recovered: Option<Channels>,
    pub(super) finished_at: Option<Instant>,
    /// The bulk sender is inside a chunk (without break-chunks, urgent answers wait for it).
    pub(super) bulk_in_chunk: bool,
    /// Shared storage: this side released the image's lock (and did not take it back).
    pub(super) lock_released: bool,
    /// The destination takes the disk's checkpoints (its Hello said so).
    pub(super) checkpoints_accepted: bool,
}

impl State {
    pub(super) fn new() -> State {
        State {
            phase: Phase::Setup,
            error: None,
            bytes_sent: 0,
            zero_bytes: 0,
            chunks: 0,
            passes: 0,
            urgent_served: 0,
            urgent: VecDeque::new(),
            switchover: None,
            deferred_switchover: None,
            awaits_ready: false,
            peer_ready: false,
            fenced_at: None,
            downtime: None,
            cancel: false,
            peer_complete: false,
            broken: None,
            generation: 0,
            recovered: None,
            finished_at: None,
            bulk_in_chunk: false,
            lock_released: false,
            checkpoints_accepted: false,
        }
    }
}

/// A migration of a disk on shared storage: what the destination reaches too.
pub(super) struct HandOff {
    pub(super) image: Arc<dyn Container>,
    /// The image's identity, which the destination must report as its own.
    pub(super) identity: String,
}

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    pub(super) cond: Condvar,
    pub(super) file: Arc<dyn BlockDevice>,
    /// Set for a shared-storage migration: no data is sent, the image's lock is handed over.
    pub(super) hand_off: Option<HandOff>,
    pub(super) tracker: Arc<DirtyTracker>,
    pub(super) opts: SourceOptions,
    pub(super) session: [u8; SESSION_ID_LEN],
    pub(super) started: Instant,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Shared storage: the image whose lock is handed over.
    pub(super) fn shared_storage(&self) -> &dyn SharedStorage {
        self.hand_off
            .as_ref()
            .and_then(|h| h.image.shared_storage())
            .expect("start_shared checked the image is shared storage")
    }

    /// Fences the disk for a switchover in `postcopy` mode and tells the sender to switch
    /// over; a migration that ended (or was cancelled) meanwhile leaves the disk unfenced.
    pub(super) fn fence_for_switchover(&self, postcopy: bool) -> Result<(), MigrationError> {
        self.tracker.fence();
        let mut s = self.lock();
        if s.phase != Phase::Precopy || s.cancel {
            // It failed while we were fencing: the source carries on.
            self.tracker.unfence();
            return Err(MigrationError::WrongPhase {
                phase: s.phase,
                action: "switch over",
            });
        }
        s.fenced_at = Some(Instant::now());
        s.switchover = Some(postcopy);
        self.cond.notify_all();
        Ok(())
    }

    pub(super) fn bitmap(&self) -> &DirtyBitmap {
        self.tracker
            .bitmap()
            .expect("tracking started before the sender runs")
    }

    pub(super) fn hello(&self, role: Role) -> Hello {
        let mut flags = FLAG_AWAITS_READY;
        if self.opts.postcopy {
            flags |= FLAG_POSTCOPY;
        }
        if self.opts.preempt {
            flags |= FLAG_PREEMPT;
        }
        if self.hand_off.is_some() {
            flags |= FLAG_SHARED;
        } else if self.opts.checkpoints.is_some() {
            flags |= FLAG_CHECKPOINTS;
        }
        Hello {
            version: PROTOCOL_VERSION,
            disk_size_bytes: self.file.size(),
            granularity: self.tracker.granularity() as u32,
            header_len: self.tracker.payload_offset(),
            role,
            flags,
            session: self.session,
        }
    }
}

/// The writing halves the sender owns, and what closes them.
pub(super) struct Channels {
    pub(super) bulk: Box<dyn Write + Send>,
    pub(super) urgent: Option<Box<dyn Write + Send>>,
    pub(super) closers: Vec<Closer>,
}

impl Channels {
    pub(super) fn close(&self) {
        for c in &self.closers {
            c.close();
        }
    }
}
