//! Dirty tracking for a migration: which blocks of a disk changed since they were last sent
//! ([`DirtyBitmap`]), recorded by a disk wrapper that can also be fenced at switchover
//! ([`DirtyTracker`]), on the synchronous path and, as a stage, on every queue opened on it.

mod bitmap;
mod stage;
mod state;
mod tracker;

pub use bitmap::DirtyBitmap;
pub use tracker::DirtyTracker;
