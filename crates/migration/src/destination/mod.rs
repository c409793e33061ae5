//! The destination side of a migration: a listener that takes one migration's channels (bulk,
//! urgent, and later resumes), writes what arrives into a new image file, and
//! [`IncomingDisk`], the device the destination serves while blocks may still be missing.
//!
//! Every frame is checked before it has any effect (checksum by the parser; range, alignment
//! and phase here), and a refused frame marks nothing as received. In postcopy, received data
//! never overwrites a block the destination already has (the guest may have written it since),
//! which is why writes of arriving data and guest writes are ordered by one lock, and why a
//! block counts as received before a guest write to it lands.
//!
//! - `state`: what the threads share (session, phase, counters).
//! - `session`: accepting connections, the handshake, refusals, broken channels.
//! - `apply`: checking and writing what arrives.
//! - `requests`: on-demand requests to the source.
//! - `incoming_disk`: [`IncomingDisk`].

mod apply;
mod incoming_disk;
mod requests;
mod session;
mod state;
mod store;

pub use incoming_disk::IncomingDisk;
pub use state::CheckpointsHook;
pub use store::{IncomingStore, NewFile};

use crate::channel::{ListenOptions, MigrationAddress, MigrationListener};
use crate::latency::{LatencyHistogram, LatencySummary};
use crate::{MigrationError, Phase};
use cryptblk_block::{BlockDevice, Container};
use rustls::ServerConfig;
use state::{phase_code, CheckpointsSlot, DShared, DState};
use std::path::Path;
use std::sync::atomic::AtomicU8;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// A snapshot of the destination's progress.
#[derive(Debug, Clone)]
pub struct IncomingStatus {
    pub phase: Phase,
    pub error: Option<String>,
    /// Where it listens.
    pub address: String,
    pub disk_size: Option<u64>,
    pub bytes_received: u64,
    pub zero_bytes: u64,
    pub chunks: u64,
    pub passes: u32,
    /// Blocks still missing (postcopy), of `granularity` bytes.
    pub missing_blocks: u64,
    pub granularity: u64,
    /// On-demand fetches and how long reads waited for them.
    pub urgent_requests: u64,
    pub latency: LatencySummary,
    pub elapsed: Duration,
}

/// What the destination needs to open the disk: the image, whose header has arrived.
#[derive(Clone)]
pub struct HeaderReady {
    pub file: Arc<dyn Container>,
    /// Bytes of format header (LUKS data offset) at the start of the file; 0 for raw.
    pub header_len: u64,
    pub disk_size: u64,
}

/// An incoming migration of one disk.
pub struct IncomingMigration {
    shared: Arc<DShared>,
    address: MigrationAddress,
}

impl std::fmt::Debug for IncomingMigration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncomingMigration")
            .field("address", &self.address)
            .field("phase", &self.shared.lock().phase)
            .finish()
    }
}

impl IncomingMigration {
    /// Listens on `addr` for a migration into a new image file at `image` (which must not
    /// exist; it is created when the source says how large it is). With `tls`, every channel
    /// is TLS and the source must present a certificate signed by the CA.
    pub fn listen(
        addr: &MigrationAddress,
        image: &Path,
        tls: Option<Arc<ServerConfig>>,
    ) -> Result<Arc<IncomingMigration>, MigrationError> {
        Self::listen_into(addr, Arc::new(NewFile(image.to_path_buf())), tls)
    }

    /// As [`listen`](Self::listen), into an image `store` creates (e.g. a new RBD image), or
    /// taking over the image the source serves when `store` is shared storage.
    pub fn listen_into(
        addr: &MigrationAddress,
        store: Arc<dyn IncomingStore>,
        tls: Option<Arc<ServerConfig>>,
    ) -> Result<Arc<IncomingMigration>, MigrationError> {
        Self::listen_with(addr, store, ListenOptions::tls(tls))
    }

    /// As [`listen_into`](Self::listen_into), with every admission setting of the listener
    /// (TLS, the pinned peer name, timeouts, connection limits).
    pub fn listen_with(
        addr: &MigrationAddress,
        store: Arc<dyn IncomingStore>,
        options: ListenOptions,
    ) -> Result<Arc<IncomingMigration>, MigrationError> {
        if !store.is_shared() && store.exists() {
            return Err(MigrationError::DestinationExists {
                path: store.name().to_path_buf(),
            });
        }
        let announces_ready = options.announces_ready;
        let listener = MigrationListener::bind(addr, options).map_err(MigrationError::Listen)?;
        let address = listener.local_addr().map_err(MigrationError::Listen)?;
        let shared = Arc::new(DShared {
            state: Mutex::new(DState {
                phase: Phase::Setup,
                error: None,
                session: None,
                bulk_writer: None,
                urgent_writer: None,
                closers: Vec::new(),
                generation: 0,
                missing_listed: false,
                bytes_received: 0,
                zero_bytes: 0,
                chunks: 0,
                passes: 0,
                urgent_requests: 0,
                latency: LatencyHistogram::default(),
                live_at: None,
                finished_at: None,
                remove_pending: false,
                identity_confirmed: false,
                checkpoints_received: false,
                ready: false,
            }),
            cond: Condvar::new(),
            apply: Mutex::new(()),
            phase_fast: AtomicU8::new(phase_code(Phase::Setup)),
            created: OnceLock::new(),
            store,
            checkpoints: Mutex::new(CheckpointsSlot::Waiting),
            listener,
            started: Instant::now(),
            announces_ready,
        });
        let acceptor = shared.clone();
        std::thread::Builder::new()
            .name("migrate-listen".into())
            .spawn(move || session::accept_loop(acceptor))
            .map_err(MigrationError::Listen)?;
        Ok(Arc::new(IncomingMigration { shared, address }))
    }

    pub fn address(&self) -> &MigrationAddress {
        &self.address
    }

    pub fn phase(&self) -> Phase {
        self.shared.lock().phase
    }

    pub fn status(&self) -> IncomingStatus {
        let s = self.shared.lock();
        let created = self.shared.created.get();
        let missing_blocks = match created {
            Some(c) if matches!(s.phase, Phase::Postcopy | Phase::PostcopyPaused) => {
                c.received.blocks() - c.received.count()
            }
            _ => 0,
        };
        let end = s.finished_at.unwrap_or_else(Instant::now);
        IncomingStatus {
            phase: s.phase,
            error: s.error.clone(),
            address: self.address.to_string(),
            disk_size: created.map(|c| c.hello.disk_size_bytes),
            bytes_received: s.bytes_received,
            zero_bytes: s.zero_bytes,
            chunks: s.chunks,
            passes: s.passes,
            missing_blocks,
            granularity: created.map_or(0, |c| u64::from(c.hello.granularity)),
            urgent_requests: s.urgent_requests,
            latency: s.latency.summary(),
            elapsed: end.duration_since(self.shared.started),
        }
    }

    /// Waits until the image header has arrived (right after the source connected: it is sent
    /// first), so the volume can be opened and served; I/O on it waits for the switchover.
    pub fn wait_header(&self, timeout: Duration) -> Result<HeaderReady, MigrationError> {
        let deadline = Instant::now() + timeout;
        let mut s = self.shared.lock();
        loop {
            if let Some(c) = self.shared.created.get() {
                if c.received.all_set(0, c.hello.header_len) {
                    return Ok(HeaderReady {
                        file: c.file.clone(),
                        header_len: c.hello.header_len,
                        disk_size: c.hello.disk_size_bytes,
                    });
                }
            }
            if s.phase.is_final() {
                return Err(MigrationError::Refused(
                    s.error
                        .clone()
                        .unwrap_or_else(|| format!("migration {}", s.phase)),
                ));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(MigrationError::Protocol(
                    "timed out waiting for the source to send the image header".into(),
                ));
            }
            s = self
                .shared
                .cond
                .wait_timeout(s, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Says that this side serves the disk now (opened over the received header, its exports
    /// published; I/O on it waits for the switchover): a source that waits for this (both
    /// sides speak it, and [`ListenOptions::announces_ready`] is on) switches over only after
    /// it, so a VM connected here never finds the disk missing. Once per migration; later
    /// calls, and calls after the switchover, do nothing. `Err`: the channel broke (the
    /// migration fails by itself).
    pub fn ready(&self) -> Result<(), MigrationError> {
        let created = self.shared.created()?;
        let writer = {
            let mut s = self.shared.lock();
            if s.ready || s.phase != Phase::Precopy {
                return Ok(());
            }
            s.ready = true;
            if !(self.shared.announces_ready && created.awaits_ready()) {
                return Ok(());
            }
            s.bulk_writer.clone()
        };
        let Some(writer) = writer else {
            return Err(MigrationError::Protocol(
                "the bulk channel is gone; the migration fails".into(),
            ));
        };
        let mut w = writer.lock().unwrap_or_else(PoisonError::into_inner);
        crate::wire::write_frame(&mut *w, &crate::wire::Frame::Ready)?;
        Ok(())
    }

    /// Whether the source carries its disk's checkpoints (both sides speak it; known once the
    /// header arrived): they come at the switchover, to the hook of
    /// [`on_checkpoints`](Self::on_checkpoints).
    pub fn carries_checkpoints(&self) -> bool {
        self.shared
            .created
            .get()
            .is_some_and(|c| c.carries_checkpoints())
    }

    /// Calls `hook` with the checkpoints the source carried (`None`: it sent none), before the
    /// destination goes live: at once (on this thread) if they came already, else on the
    /// migration's thread when they come, before any I/O passes [`IncomingDisk`]. A migration
    /// that fails before the switchover never calls it.
    pub fn on_checkpoints(&self, hook: CheckpointsHook) {
        let mut slot = self
            .shared
            .checkpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match std::mem::take(&mut *slot) {
            CheckpointsSlot::Arrived(carried) => {
                *slot = CheckpointsSlot::Delivered;
                drop(slot);
                hook(carried);
            }
            CheckpointsSlot::Delivered => {
                *slot = CheckpointsSlot::Delivered;
                drop(slot);
                hook(None);
            }
            CheckpointsSlot::Waiting | CheckpointsSlot::Hook(_) => {
                *slot = CheckpointsSlot::Hook(hook)
            }
        }
    }

    /// Waits until the phase is `phase` or final, or `timeout` passed; returns the phase.
    pub fn wait_for(&self, phase: Phase, timeout: Duration) -> Phase {
        let s = self.shared.lock();
        crate::wait_until(&self.shared.cond, s, timeout, |s| {
            s.phase == phase || s.phase.is_final()
        })
        .phase
    }

    /// The device to serve: `inner` is the disk opened over the received image file (the
    /// LUKS volume, or the raw file), whose payload starts `header_len` bytes into the file.
    pub fn disk(&self, inner: Arc<dyn BlockDevice>) -> Result<Arc<IncomingDisk>, MigrationError> {
        let created = self.shared.created()?;
        if inner.size() + created.hello.header_len != created.hello.disk_size_bytes {
            return Err(MigrationError::InvalidOptions(format!(
                "the opened disk ({} bytes) does not fill the image after its {}-byte header",
                inner.size(),
                created.hello.header_len
            )));
        }
        Ok(Arc::new(IncomingDisk::new(
            inner,
            self.shared.clone(),
            created.hello.header_len,
        )))
    }

    /// Gives up before the destination went live; the partial image is removed.
    pub fn cancel(&self) -> Result<(), MigrationError> {
        let mut s = self.shared.lock();
        match s.phase {
            Phase::Setup | Phase::Precopy => {
                self.shared.fail(
                    &mut s,
                    Phase::Cancelled,
                    "cancelled on the destination".into(),
                );
                Ok(())
            }
            phase => Err(MigrationError::WrongPhase {
                phase,
                action: "cancel (the destination is live)",
            }),
        }
    }
}

impl Drop for IncomingMigration {
    fn drop(&mut self) {
        let mut s = self.shared.lock();
        if !s.phase.is_final() {
            match s.phase {
                Phase::Setup | Phase::Precopy => {
                    self.shared
                        .fail(&mut s, Phase::Cancelled, "the destination went away".into())
                }
                _ => {
                    for c in s.closers.drain(..) {
                        c.close();
                    }
                    self.shared.listener.shutdown();
                }
            }
        }
    }
}
