//! Block devices for cryptblk: the `BlockDevice` abstraction, the raw and qcow2 backends and
//! what a LUKS volume sits on (`Container`), and the asynchronous I/O framework (`aio`: queues,
//! pipelines of stages, engines, the memory budget and buffer cache).
//!
//! Data flows one way: a frontend (convert, vhost-user, NBD) talks to a volume
//! (`cryptblk-volume`), which talks to a backend (`RawFile`, `Qcow2`, an RBD image). Backends
//! know nothing about LUKS and the volume knows nothing about the protocol in front of it.

pub mod aio;
mod aligned;
pub mod budget;
pub mod buffers;
mod container;
mod device;
mod error;
mod format;
mod image;
mod io_options;
mod latency_buckets;
mod notifier;
pub mod qcow2;
pub mod raw;
pub mod stats;

pub use aligned::{is_direct_aligned, AlignedBuf, DIRECT_IO_ALIGN};
pub use budget::{BudgetShare, BudgetUsage, MemoryBudget};
pub use buffers::PooledBuf;
pub use container::{Container, SharedStorage};
pub use device::{open_pipeline, open_queue, BlockDevice, Extent, ExtentKind};
pub use error::{check_range, BlockError, BlockErrorKind};
pub use format::{probe_format, Format};
pub use image::open_image;
pub use io_options::{AioEngine, CacheMode, UnknownName};
pub use latency_buckets::{BucketCounts, LatencyBuckets, LATENCY_BOUNDS_NS, LATENCY_BUCKETS};
pub use qcow2::{Qcow2, MAX_BACKING_DEPTH};
pub use raw::{IoSettings, OpenOptions, RawFile};
pub use stats::{IoKind, IoStats, IoStatsSnapshot};
