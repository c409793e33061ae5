//! Block devices for cryptblk: the `BlockDevice` abstraction, raw and qcow2 backends, and the
//! encrypted volume that sits between frontends and backends.
//!
//! Data flows one way: a frontend (convert, vhost-user, NBD) talks to a volume (`CryptDevice`,
//! usually opened with `open_luks_volume`), which talks to a backend (`RawFile`, `Qcow2`).
//! Backends know nothing about LUKS and the volume knows nothing about the protocol in front
//! of it.

pub mod aio;
mod aligned;
pub mod budget;
pub mod buffers;
mod container;
mod crypt;
mod device;
mod error;
mod format;
mod image;
mod io_options;
mod latency_buckets;
mod luks_reencrypting;
mod luks_volume;
pub mod qcow2;
pub mod raw;
mod resize;
pub mod stats;

pub use aligned::{is_direct_aligned, AlignedBuf, DIRECT_IO_ALIGN};
pub use budget::{BudgetShare, BudgetUsage, MemoryBudget};
pub use buffers::PooledBuf;
pub use container::{Container, SharedStorage};
pub use crypt::{CryptDevice, CryptLayout, SegmentCiphers, SegmentMap, DRAIN_TIMEOUT};
pub use device::{BlockDevice, Extent, ExtentKind};
pub use error::{BlockError, BlockErrorKind};
pub use format::{probe_format, Format};
pub use image::open_image;
pub use io_options::{AioEngine, CacheMode, UnknownName};
pub use latency_buckets::{BucketCounts, LatencyBuckets, LATENCY_BOUNDS_NS, LATENCY_BUCKETS};
pub use luks_reencrypting::data_cipher;
pub use luks_volume::{
    open_luks_volume, open_luks_volume_on, open_luks_volume_with, LuksVolume, VolumeError,
    VolumeOptions,
};
pub use qcow2::{Qcow2, MAX_BACKING_DEPTH};
pub use raw::{IoSettings, OpenOptions, RawFile};
pub use resize::{resize_luks, resize_raw, ResizeError, Resized, RAW_SECTOR};
pub use stats::{IoKind, IoStats, IoStatsSnapshot};
