//! The source side of a migration: one sender thread that owns the outgoing half of every
//! channel, plus a reader thread per channel for what the destination says.
//!
//! ```text
//! connect bulk (+ urgent with preempt), Hello both ways
//! header ............................... Chunk*           (never dirtied: header changes are
//!                                                          refused while migrating)
//! precopy sweeps ....................... Chunk/Zero* PassDone, again and again, each sweep
//!                                        taking what the guest dirtied since
//!                                        <-- Ready (the destination serves the disk)
//! switchover (frontend stopped or asked, and not before Ready; the disk is fenced first)
//!   precopy mode:   remaining dirty ..... Chunk/Zero*, Complete  <-- Complete (flushed)
//!   postcopy mode:  Missing* Postcopy    (destination live; it asks with Request for what a
//!                                         read needs, answered first, on the urgent channel
//!                                         with preempt, between bulk slices with break-chunks)
//!                   rest of the bulk .... Chunk*, Complete       <-- Complete (flushed)
//! ```
//!
//! Shared storage ([`SourceMigration::start_shared`], an RBD image both daemons reach): no
//! header, no sweeps. At switchover the fenced disk is flushed and the image's exclusive lock
//! released, then Complete; the destination takes the lock before it answers Complete. If
//! that fails, the source takes the lock back and carries on; the lock decides, so the two
//! never both write.
//!
//! Failures: before the destination is live (precopy, or a precopy-mode switchover that did not
//! get its Complete back), the source simply carries on: tracking stops and the disk is
//! unfenced. In postcopy the destination holds the newest data, so a broken channel *pauses*
//! the migration until [`SourceMigration::recover`] reconnects and the destination says what it
//! still lacks.
//!
//! - `options`: [`SourceOptions`] and [`SourceStatus`].
//! - `state`: what the threads share.
//! - `handshake`: connecting the channels, Hello both ways, the resume's list of missing
//!   ranges.
//! - `reader`: a thread per channel for what the destination says.
//! - `sender`: the sender thread: header, precopy sweeps, switchover, postcopy.
//! - `pacing`: the bandwidth cap, one clock for every channel.
//! - `urgent`: answering the destination's on-demand requests.

mod handshake;
mod options;
mod pacing;
mod read_ahead;
mod reader;
mod sender;
mod state;
mod stop;
mod urgent;

pub use options::{CheckpointSource, SourceOptions, SourceStatus};

use crate::channel::MigrationAddress;
use crate::wire::Role;
use crate::{DirtyBitmap, DirtyTracker, MigrationError, Phase};
use cryptblk_block::{BlockDevice, Container};
use handshake::{connect_all, random_session};
use sender::run_sender;
use state::{HandOff, Shared, State};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A running outgoing migration of one disk.
pub struct SourceMigration {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for SourceMigration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceMigration")
            .field("phase", &self.shared.lock().phase)
            .finish()
    }
}

impl SourceMigration {
    /// Connects to the destination at `to` (all channels, handshakes done, so that a wrong
    /// address, refused TLS or a busy destination is reported here) and starts sending.
    /// `file` is the image file under the encryption; `tracker` wraps the disk the guest uses.
    pub fn start(
        file: Arc<dyn BlockDevice>,
        tracker: Arc<DirtyTracker>,
        to: &MigrationAddress,
        opts: SourceOptions,
    ) -> Result<Arc<SourceMigration>, MigrationError> {
        Self::begin(file, None, tracker, to, opts)
    }

    /// Hands a disk whose `image` the destination reaches too (shared storage: an RBD image
    /// of the same cluster) over without copying it: only the right to write moves, at the
    /// switchover. The destination must be listening on the same image.
    pub fn start_shared(
        image: Arc<dyn Container>,
        tracker: Arc<DirtyTracker>,
        to: &MigrationAddress,
        opts: SourceOptions,
    ) -> Result<Arc<SourceMigration>, MigrationError> {
        if opts.postcopy || opts.preempt {
            return Err(MigrationError::InvalidOptions(
                "a shared-storage migration copies nothing, so it has no postcopy".into(),
            ));
        }
        let Some(storage) = image.shared_storage() else {
            return Err(MigrationError::InvalidOptions(format!(
                "{} is not shared storage (only an rbd: image can be handed over without                  copying); migrate it without --shared",
                image.name().display()
            )));
        };
        let identity = storage.identity()?;
        let file: Arc<dyn BlockDevice> = image.clone();
        Self::begin(file, Some(HandOff { image, identity }), tracker, to, opts)
    }

    fn begin(
        file: Arc<dyn BlockDevice>,
        hand_off: Option<HandOff>,
        tracker: Arc<DirtyTracker>,
        to: &MigrationAddress,
        opts: SourceOptions,
    ) -> Result<Arc<SourceMigration>, MigrationError> {
        opts.validate()?;
        if tracker.payload_offset() + tracker.size() != file.size() {
            return Err(MigrationError::InvalidOptions(format!(
                "the disk ({} bytes at offset {}) does not end where its image file does ({} \
                 bytes)",
                tracker.size(),
                tracker.payload_offset(),
                file.size()
            )));
        }
        if tracker.is_fenced() {
            return Err(MigrationError::InvalidOptions(
                "the disk was already handed over to a destination".into(),
            ));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new()),
            cond: Condvar::new(),
            file,
            hand_off,
            tracker,
            opts,
            session: random_session(),
            started: Instant::now(),
        });
        let channels = connect_all(&shared, to, Role::Bulk, 0)?;
        // Tracking (everything dirty) starts before the first byte of payload is read. Shared
        // storage sends no payload, so there is nothing to track.
        if shared.hand_off.is_none() {
            shared.tracker.start_tracking()?;
        }
        shared.lock().phase = Phase::Precopy;
        let sender_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("migrate-send".into())
            .spawn(move || run_sender(sender_shared, channels))
            .map_err(|e| MigrationError::InvalidOptions(format!("cannot start a thread: {e}")))?;
        Ok(Arc::new(SourceMigration {
            shared,
            thread: Mutex::new(Some(thread)),
        }))
    }

    pub fn status(&self) -> SourceStatus {
        let s = self.shared.lock();
        let bitmap = self.shared.tracker.bitmap();
        let end = s.finished_at.unwrap_or_else(Instant::now);
        let elapsed = end.duration_since(self.shared.started);
        let secs = elapsed.as_secs_f64();
        SourceStatus {
            phase: s.phase,
            error: s.error.clone(),
            bytes_sent: s.bytes_sent,
            zero_bytes: s.zero_bytes,
            chunks: s.chunks,
            passes: s.passes,
            dirty_blocks: bitmap.map_or(0, DirtyBitmap::count),
            dirty_bytes: bitmap.map_or(0, DirtyBitmap::dirty_bytes),
            granularity: self.shared.tracker.granularity(),
            elapsed,
            throughput_bytes_per_sec: if secs > 0.0 {
                s.bytes_sent as f64 / secs
            } else {
                0.0
            },
            urgent_served: s.urgent_served,
            downtime: s.downtime,
            postcopy: self.shared.opts.postcopy,
            preempt: self.shared.opts.preempt,
            shared: self.shared.hand_off.is_some(),
            switchover_pending: s.deferred_switchover.is_some(),
        }
    }

    /// Hands the disk over: fences it (every later guest I/O fails; I/O under way finishes
    /// first), then has the sender send what is left (`postcopy: false`) or only the list of
    /// what is missing (`postcopy: true`). Returns once the disk is fenced; `wait` for the end.
    ///
    /// A destination that says when it serves the disk (its header arrived and was opened,
    /// its exports are up) is never switched to before that: asked earlier, the switchover
    /// is deferred, as QEMU's `migrate-start-postcopy` is. This returns at once with the disk
    /// still serving here, the status says `switchover_pending`, and the sender fences and
    /// switches over as soon as the destination's `Ready` comes. Until then `cancel` still
    /// stops the migration, and a destination that fails fails it as in any precopy.
    pub fn switchover(&self, postcopy: bool) -> Result<(), MigrationError> {
        if postcopy && !self.shared.opts.postcopy {
            return Err(MigrationError::InvalidOptions(
                "this migration was started without postcopy".into(),
            ));
        }
        {
            let mut s = self.shared.lock();
            if s.deferred_switchover.is_some() {
                return Err(MigrationError::WrongPhase {
                    phase: s.phase,
                    action: "switch over again (the switchover asked for waits for the \
                             destination to serve the disk; see migrate-status)",
                });
            }
            if s.phase != Phase::Precopy || s.switchover.is_some() {
                return Err(MigrationError::WrongPhase {
                    phase: s.phase,
                    action: "switch over",
                });
            }
            if s.awaits_ready && !s.peer_ready {
                tracing::info!(
                    "switchover asked for before the destination serves the disk: it happens \
                     when the destination says it is ready"
                );
                s.deferred_switchover = Some(postcopy);
                self.shared.cond.notify_all();
                return Ok(());
            }
        }
        self.shared.fence_for_switchover(postcopy)
    }

    /// Shared storage: whether this side let go of the image's lock (the destination writes
    /// it now, or may): the image is no longer this side's to flush or write.
    pub fn handed_over(&self) -> bool {
        self.shared.lock().lock_released
    }

    /// Switches over in the mode the migration was started with.
    pub fn switchover_default(&self) -> Result<(), MigrationError> {
        self.switchover(self.shared.opts.postcopy)
    }

    /// Stops a migration whose destination is not live yet; the source keeps serving.
    pub fn cancel(&self) -> Result<(), MigrationError> {
        let mut s = self.shared.lock();
        match s.phase {
            Phase::Setup | Phase::Precopy => {
                s.cancel = true;
                self.shared.cond.notify_all();
                Ok(())
            }
            phase => Err(MigrationError::WrongPhase {
                phase,
                action: "cancel (the destination already holds the newest data)",
            }),
        }
    }

    /// Resumes a paused postcopy over new connections to `to`.
    pub fn recover(&self, to: &MigrationAddress) -> Result<(), MigrationError> {
        // The new generation is current before its readers start, so that what they hear
        // counts; the old channels are dead already.
        let generation = {
            let mut s = self.shared.lock();
            if s.phase != Phase::PostcopyPaused || s.recovered.is_some() {
                return Err(MigrationError::WrongPhase {
                    phase: s.phase,
                    action: "recover",
                });
            }
            s.generation += 1;
            s.broken = None;
            s.generation
        };
        let channels = connect_all(&self.shared, to, Role::Resume, generation)?;
        let mut s = self.shared.lock();
        s.error = None;
        s.recovered = Some(channels);
        self.shared.cond.notify_all();
        Ok(())
    }

    /// Waits until the migration completed, failed or was cancelled, or `timeout` passed;
    /// returns the phase it is in.
    pub fn wait(&self, timeout: Duration) -> Phase {
        let s = self.shared.lock();
        crate::wait_until(&self.shared.cond, s, timeout, |s| s.phase.is_final()).phase
    }

    /// Waits until the phase is `phase` or final (or `timeout` passed).
    pub fn wait_for(&self, phase: Phase, timeout: Duration) -> Phase {
        let s = self.shared.lock();
        crate::wait_until(&self.shared.cond, s, timeout, |s| {
            s.phase == phase || s.phase.is_final()
        })
        .phase
    }
}

impl Drop for SourceMigration {
    fn drop(&mut self) {
        {
            let mut s = self.shared.lock();
            if matches!(s.phase, Phase::Setup | Phase::Precopy) {
                s.cancel = true;
            }
            self.shared.cond.notify_all();
        }
        let done = self.shared.lock().phase.is_final();
        if done {
            if let Some(t) = self
                .thread
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
            {
                let _ = t.join();
            }
        }
    }
}
