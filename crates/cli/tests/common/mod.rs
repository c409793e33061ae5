//! What the `cryptblk` integration tests share: the fixture layer (crates/fixture: images,
//! the daemon handle, the test guest, running the binary and the real tools, see its
//! README.md), and the few helpers only these tests use.
#![allow(dead_code)]

pub use cryptblk_fixture::*;

pub mod backup;
pub mod online;
pub mod secret;
pub mod xts;
