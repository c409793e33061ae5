//! The volume's tracking stage: which blocks of a disk changed since they were last sent
//! ([`DirtyBitmap`]), recorded by a disk wrapper that can also be fenced at a hand-over
//! ([`DirtyTracker`]), on the synchronous path and, as a stage, on every queue opened on it.
//! A migration (`cryptblk-migration`) reads and clears the bitmap and fences the disk at
//! switchover.

mod background;
mod backup_view;
mod bitmap;
mod checkpoint_stage;
mod copy_before_write;
mod stage;
mod state;
mod tracker;

pub use background::{BackgroundReads, GuestActivity};
pub use backup_view::BackupView;
pub use bitmap::DirtyBitmap;
pub use copy_before_write::{CopyBeforeWrite, COPY_REGION, RELEASE_GRANULE};
pub(crate) use state::TrackState;
pub use tracker::DirtyTracker;

/// Tracking cannot be set up as asked (a granularity that is not a power of two, a disk too
/// large to track, an offset past the disk).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TrackingError(pub String);

#[cfg(test)]
mod copy_before_write_tests;
