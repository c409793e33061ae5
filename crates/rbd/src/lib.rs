//! Ceph RBD images through librbd's and librados' C API, loaded at run time so that a binary
//! built with this crate runs on machines without Ceph and only needs librbd1 when an `rbd:`
//! image is actually named.

mod aio;
mod device;
mod error;
mod ffi;
mod handle;
mod image;
mod spec;

pub use aio::RbdEngine;
pub use device::{block_error, open_error, RbdDevice};
pub use error::RbdError;
pub use image::{Allocation, Image, OpenMode};
pub use spec::RbdSpec;

/// How long connecting to the cluster, and each monitor or OSD operation, may take before it
/// fails instead of hanging (librados' own defaults wait for ever on an unreachable cluster).
pub const CLUSTER_TIMEOUT_SECS: u32 = 30;
