//! Live migration of cryptblk disks between two daemons.
//!
//! Migration moves **ciphertext only**. The source reads the image file *below* the encryption
//! layer (for LUKS: the header and the encrypted payload, byte for byte) and the destination
//! writes the same bytes into its own image file, so no key ever crosses the wire and the
//! destination needs the passphrase only to open the volume it received.
//!
//! - The dirty tracking it reads (`DirtyBitmap`, `DirtyTracker`: which blocks guest writes
//!   changed, and the fence at switchover) is the volume's (`cryptblk-volume`).
//! - [`wire`]: the versioned, framed, checksummed protocol, with pure parsers for untrusted
//!   input.
//! - [`channel`]: TCP/Unix connections, optionally mutually authenticated TLS, split into
//!   reader and writer halves.
//! - [`source`]: the sender (precopy sweeps, switchover, postcopy with urgent requests first,
//!   preempt channel, pause and recover).
//! - [`destination`]: the receiver and [`IncomingDisk`], the `BlockDevice` the destination
//!   serves while blocks are still arriving (reads of missing blocks fetch them first).

#![forbid(unsafe_code)]

pub mod channel;
pub mod destination;
mod error;
mod latency;
pub mod source;
pub mod wire;

pub use channel::MigrationAddress;
use cryptblk_volume::{DirtyBitmap, DirtyTracker};
pub use destination::{
    CheckpointsHook, IncomingDisk, IncomingMigration, IncomingStatus, IncomingStore, NewFile,
};
pub use error::MigrationError;
pub use latency::{LatencyHistogram, LatencySummary};
pub use source::{CheckpointSource, SourceMigration, SourceOptions, SourceStatus};
pub use wire::{Frame, WireError, PROTOCOL_VERSION};

/// Where a migration is, on either side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Destination: listening, no source connected yet. Source: connecting.
    Setup,
    /// Bulk copy while the source serves the disk.
    Precopy,
    /// The destination serves the disk and fetches what it lacks on demand.
    Postcopy,
    /// Postcopy with its channels broken: reads of missing blocks wait for `recover`.
    PostcopyPaused,
    Completed,
    /// Failed before the destination went live; the source carries on.
    Failed,
    Cancelled,
}

impl Phase {
    pub fn is_final(self) -> bool {
        matches!(self, Phase::Completed | Phase::Failed | Phase::Cancelled)
    }

    pub fn name(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::Precopy => "precopy",
            Phase::Postcopy => "postcopy",
            Phase::PostcopyPaused => "postcopy-paused",
            Phase::Completed => "completed",
            Phase::Failed => "failed",
            Phase::Cancelled => "cancelled",
        }
    }
}

/// Waits on `cond` until `done` holds for the guarded state or `timeout` has passed; returns
/// the guard either way (the caller looks at the state again).
pub(crate) fn wait_until<'a, T>(
    cond: &std::sync::Condvar,
    mut guard: std::sync::MutexGuard<'a, T>,
    timeout: std::time::Duration,
    done: impl Fn(&T) -> bool,
) -> std::sync::MutexGuard<'a, T> {
    let deadline = std::time::Instant::now() + timeout;
    while !done(&guard) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            break;
        }
        guard = cond
            .wait_timeout(guard, left)
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0;
    }
    guard
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
