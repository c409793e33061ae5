//! What may change a disk's header or hand the disk over: keyslot changes, an online
//! reencryption and the outgoing migration, one at a time; and a backup, during which none of
//! them may start (the export serves the header and the ciphertext as they are).
//!
//! # Locks
//!
//! The daemon has three kinds of lock, and **no code holds two of them at once**, so they
//! have no order to get wrong:
//! - the registry (`Daemon::disks`, name -> disk),
//! - the incoming migrations (`Daemon::incoming`, name -> migration),
//! - each disk's [`DiskActivity`] state (below).
//!
//! Each is held only to read or change the state it guards, never across I/O, a key
//! derivation, a connect, a handshake or a wait: `key-add` marks the header as changing and
//! then derives keys and writes without any lock; `migrate-start` marks the disk as starting a
//! migration and then connects without any lock. A request that finds the disk busy with the
//! other gets a "busy" error at once instead of waiting. (`migrate-cancel` and `disk-remove`
//! may wait for a start to finish, on a condition variable, bounded by the start's own
//! connect timeout.)
use crate::error::{Error, Result};
use cryptblk_migration::{Phase, SourceMigration};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The outgoing migration of a disk.
enum Outgoing {
    None,
    /// `migrate-start` is connecting. `previous` is shown again if the start fails;
    /// `cancelled` is set by `migrate-cancel` or `disk-remove` meanwhile, and the start stops
    /// the migration as soon as it exists.
    Starting {
        previous: Option<Arc<SourceMigration>>,
        cancelled: bool,
    },
    /// The latest migration, in any phase.
    Started(Arc<SourceMigration>),
}

struct State {
    /// A `key-add` or `key-remove` is rewriting the header.
    header_change: bool,
    /// An online reencryption is running (`reencrypt-start` until it ends or pauses).
    reencrypting: bool,
    /// A backup export serves the image (`backup-start` until `backup-end`).
    backup: bool,
    outgoing: Outgoing,
}

pub(crate) struct DiskActivity {
    state: Mutex<State>,
    /// Signalled when a start or a header change ends.
    changed: Condvar,
}

/// What `migrate-cancel` found.
pub(crate) enum CancelTarget {
    /// A start was under way; it was told to stop.
    Starting,
    Started(Arc<SourceMigration>),
    Nothing,
}

impl DiskActivity {
    pub(crate) fn new() -> Arc<DiskActivity> {
        Arc::new(DiskActivity {
            state: Mutex::new(State {
                header_change: false,
                reencrypting: false,
                backup: false,
                outgoing: Outgoing::None,
            }),
            changed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The latest outgoing migration that has started (in any phase).
    pub(crate) fn migration(&self) -> Option<Arc<SourceMigration>> {
        match &self.lock().outgoing {
            Outgoing::Started(m) => Some(m.clone()),
            Outgoing::Starting { previous, .. } => previous.clone(),
            Outgoing::None => None,
        }
    }

    /// Whether a migration is starting.
    pub(crate) fn is_starting(&self) -> bool {
        matches!(self.lock().outgoing, Outgoing::Starting { .. })
    }

    /// Marks the header as changing, unless a migration needs it unchanged or another change
    /// is under way. The mark is lifted when the returned guard drops.
    pub(crate) fn begin_header_change(self: &Arc<Self>, name: &str) -> Result<HeaderChange> {
        let migrating = || {
            Error::busy(format!(
                "disk \"{name}\" is being migrated: change its keyslots or size before or after"
            ))
        };
        // A started migration's phase is read without our lock held (it has a lock of its
        // own); the state is then checked again before it is changed.
        loop {
            let seen = {
                let s = self.lock();
                if s.header_change {
                    return Err(Error::busy(format!(
                        "another change of disk \"{name}\"'s header or size (key-add, \
                         key-remove, disk-resize) is under way; retry when it has returned"
                    )));
                }
                if s.reencrypting {
                    return Err(reencrypting(name, "change its keyslots or size"));
                }
                if s.backup {
                    return Err(backing_up(name, "change its keyslots or size"));
                }
                match &s.outgoing {
                    Outgoing::Starting { .. } => return Err(migrating()),
                    Outgoing::Started(m) => Some(m.clone()),
                    Outgoing::None => None,
                }
            };
            if seen.as_ref().is_some_and(|m| !m.status().phase.is_final()) {
                return Err(migrating());
            }
            let mut s = self.lock();
            let unchanged = match (&s.outgoing, &seen) {
                (Outgoing::None, None) => true,
                (Outgoing::Started(now), Some(then)) => Arc::ptr_eq(now, then),
                _ => false,
            };
            if unchanged && !s.header_change && !s.backup {
                s.header_change = true;
                return Ok(HeaderChange(self.clone()));
            }
        }
    }

    /// Marks the disk as starting a migration, unless its header is changing or a migration
    /// is starting or running. Finish with [`StartTicket::finish`].
    pub(crate) fn begin_start(self: &Arc<Self>, name: &str) -> Result<StartTicket> {
        loop {
            let seen = {
                let s = self.lock();
                if s.header_change {
                    return Err(Error::busy(format!(
                        "the keyslots or size of disk \"{name}\" are being changed; start \
                         the migration when key-add, key-remove or disk-resize has returned"
                    )));
                }
                if s.reencrypting {
                    return Err(reencrypting(name, "migrate it"));
                }
                if s.backup {
                    return Err(backing_up(name, "migrate it"));
                }
                match &s.outgoing {
                    Outgoing::Starting { .. } => {
                        return Err(Error::busy(format!(
                            "disk \"{name}\" is already starting a migration"
                        )))
                    }
                    Outgoing::Started(m) => Some(m.clone()),
                    Outgoing::None => None,
                }
            };
            if let Some(m) = &seen {
                let phase = m.status().phase;
                if !matches!(phase, Phase::Failed | Phase::Cancelled) {
                    return Err(Error::busy(format!(
                        "disk \"{name}\" already has a migration in phase {phase}"
                    )));
                }
            }
            let mut s = self.lock();
            let unchanged = match (&s.outgoing, &seen) {
                (Outgoing::None, None) => true,
                (Outgoing::Started(now), Some(then)) => Arc::ptr_eq(now, then),
                _ => false,
            };
            if unchanged && !s.header_change && !s.backup {
                s.outgoing = Outgoing::Starting {
                    previous: seen,
                    cancelled: false,
                };
                return Ok(StartTicket {
                    activity: self.clone(),
                    finished: false,
                });
            }
        }
    }

    /// Marks the disk as re-encrypting, unless its header is changing, a migration is
    /// starting or running, or a reencryption runs already. The mark is lifted when the
    /// returned guard drops (the reencryption ended or paused).
    pub(crate) fn begin_reencryption(self: &Arc<Self>, name: &str) -> Result<Reencrypting> {
        let refusal = |s: &State| {
            if s.reencrypting {
                Some(Error::busy(format!(
                    "disk \"{name}\" is already being re-encrypted (see reencrypt-status)"
                )))
            } else if s.header_change {
                Some(Error::busy(format!(
                    "the keyslots of disk \"{name}\" are being changed; start the \
                     reencryption when key-add or key-remove has returned"
                )))
            } else if s.backup {
                Some(backing_up(name, "re-encrypt it"))
            } else {
                None
            }
        };
        self.mark_unless_migrating(name, "re-encrypt it", refusal, |s| s.reencrypting = true)?;
        Ok(Reencrypting(self.clone()))
    }

    /// Marks the disk as served by a backup export, unless its header is changing, it is
    /// being re-encrypted or migrated, or a backup runs already. The mark is lifted when the
    /// returned guard drops (`backup-end`).
    pub(crate) fn begin_backup(self: &Arc<Self>, name: &str) -> Result<BackingUp> {
        let refusal = |s: &State| {
            if s.backup {
                Some(Error::busy(format!(
                    "disk \"{name}\" already has a backup export; end it first \
                     (backup-end, with failed if it did not complete)"
                )))
            } else if s.header_change {
                Some(Error::busy(format!(
                    "the keyslots or size of disk \"{name}\" are being changed; start the \
                     backup when key-add, key-remove or disk-resize has returned"
                )))
            } else if s.reencrypting {
                Some(reencrypting(name, "back it up"))
            } else {
                None
            }
        };
        self.mark_unless_migrating(name, "back it up", refusal, |s| s.backup = true)?;
        Ok(BackingUp(self.clone()))
    }

    /// Sets a mark with `mark` unless `refusal` objects to the state or a migration of the
    /// disk is starting or running (`to_do` names what to do before or after it). The
    /// migration's phase is read without our lock (it takes the migration's own), so the state
    /// is checked again, unchanged, before the mark is set.
    fn mark_unless_migrating(
        self: &Arc<Self>,
        name: &str,
        to_do: &str,
        refusal: impl Fn(&State) -> Option<Error>,
        mark: impl FnOnce(&mut State),
    ) -> Result<()> {
        let migrating = || {
            Error::busy(format!(
                "disk \"{name}\" is being migrated: {to_do} before or after the migration"
            ))
        };
        loop {
            let seen = {
                let s = self.lock();
                if let Some(e) = refusal(&s) {
                    return Err(e);
                }
                match &s.outgoing {
                    Outgoing::Starting { .. } => None,
                    Outgoing::Started(m) => Some(Some(m.clone())),
                    Outgoing::None => Some(None),
                }
            };
            let Some(seen) = seen else {
                return Err(migrating());
            };
            if seen.as_ref().is_some_and(|m| !m.status().phase.is_final()) {
                return Err(migrating());
            }
            let mut s = self.lock();
            let unchanged = match (&s.outgoing, &seen) {
                (Outgoing::None, None) => true,
                (Outgoing::Started(now), Some(then)) => Arc::ptr_eq(now, then),
                _ => false,
            };
            if unchanged && refusal(&s).is_none() {
                mark(&mut s);
                return Ok(());
            }
        }
    }

    /// For `migrate-cancel`: tells a start under way to stop, or returns the migration to
    /// cancel (the caller cancels it, without our lock).
    pub(crate) fn cancel_target(&self) -> CancelTarget {
        let mut s = self.lock();
        match &mut s.outgoing {
            Outgoing::Starting { cancelled, .. } => {
                *cancelled = true;
                CancelTarget::Starting
            }
            Outgoing::Started(m) => CancelTarget::Started(m.clone()),
            Outgoing::None => CancelTarget::Nothing,
        }
    }

    /// For `disk-remove`: stops a start under way and waits (at most `timeout`) until it has
    /// ended; returns the migration that remains, for the caller to cancel.
    pub(crate) fn stop_starting(&self, timeout: Duration) -> Option<Arc<SourceMigration>> {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        if let Outgoing::Starting { cancelled, .. } = &mut s.outgoing {
            *cancelled = true;
        }
        while matches!(s.outgoing, Outgoing::Starting { .. }) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        match &s.outgoing {
            Outgoing::Started(m) => Some(m.clone()),
            _ => None,
        }
    }
}

fn reencrypting(name: &str, what: &str) -> Error {
    Error::busy(format!(
        "disk \"{name}\" is being re-encrypted: {what} once it has finished, or after \
         reencrypt-pause has taken effect (reencrypt-status shows phase paused)"
    ))
}

fn backing_up(name: &str, what: &str) -> Error {
    Error::busy(format!(
        "disk \"{name}\" has a backup export: {what} after backup-end"
    ))
}

/// A backup export serving; dropping it ends the mark.
pub(crate) struct BackingUp(Arc<DiskActivity>);

impl Drop for BackingUp {
    fn drop(&mut self) {
        self.0.lock().backup = false;
        self.0.changed.notify_all();
    }
}

/// A reencryption running; dropping it ends the mark.
pub(crate) struct Reencrypting(Arc<DiskActivity>);

impl Drop for Reencrypting {
    fn drop(&mut self) {
        self.0.lock().reencrypting = false;
        self.0.changed.notify_all();
    }
}

/// A header change under way; dropping it ends the change.
pub(crate) struct HeaderChange(Arc<DiskActivity>);

impl Drop for HeaderChange {
    fn drop(&mut self) {
        self.0.lock().header_change = false;
        self.0.changed.notify_all();
    }
}

/// A migration start under way.
pub(crate) struct StartTicket {
    activity: Arc<DiskActivity>,
    finished: bool,
}

impl StartTicket {
    /// Records the outcome of the start: the new migration, or `None` when it failed (the
    /// previous one, if any, is shown again). Returns whether the start was cancelled
    /// meanwhile; the caller then cancels the new migration.
    pub(crate) fn finish(mut self, started: Option<Arc<SourceMigration>>) -> bool {
        self.finished = true;
        self.record(started)
    }

    fn record(&self, started: Option<Arc<SourceMigration>>) -> bool {
        let mut s = self.activity.lock();
        let (previous, cancelled) = match std::mem::replace(&mut s.outgoing, Outgoing::None) {
            Outgoing::Starting {
                previous,
                cancelled,
            } => (previous, cancelled),
            // Not ours (cannot happen: only the ticket's holder leaves Starting).
            other => {
                s.outgoing = other;
                return false;
            }
        };
        s.outgoing = match started.or(previous) {
            Some(m) => Outgoing::Started(m),
            None => Outgoing::None,
        };
        drop(s);
        self.activity.changed.notify_all();
        cancelled
    }
}

impl Drop for StartTicket {
    fn drop(&mut self) {
        // A start that returned early (an error, a panic) leaves the disk as it was.
        if !self.finished {
            self.record(None);
        }
    }
}
