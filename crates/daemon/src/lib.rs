//! The cryptblk daemon as a library: the disk registry (attach and detach at run time, with
//! rollback of a failed attach), keyslot changes on served disks, statistics, live migration,
//! the control socket's methods and the `serve` loop with its signal handling. `cryptblk
//! serve` is a thin binary over [`serve`]; other programs can embed [`Daemon`].
//!
//! Locks: no code holds two of the daemon's locks at once, and none is held across I/O, a
//! key derivation, a connect or a handshake; `activity` has the details.
mod activity;
mod backup;
mod backup_export;
mod checkpoints;
pub mod config;
mod disk;
mod disk_checkpoints;
mod dumps;
pub mod error;
mod handover;
mod image;
mod io_options;
pub mod key_cache;
pub mod key_file;
mod key_source;
mod keys;
pub mod memory;
pub mod metrics;
mod migrate;
pub mod notify;
mod rbd;
mod reencrypt;
mod reencrypt_job;
mod registry;
mod resize;
mod rpc;
pub mod secret;
mod serve;
pub mod size;
pub mod socket_access;
mod start;
mod stats;
mod token_unlock;

pub use backup_export::BackupListener;
pub use cryptblk_net::Address;
pub use dumps::{forbid_core_dumps, is_dumpable};
pub use error::{chain, kind_of, Error, Result};
pub use handover::{restart_args, TAKE_OVER_OPTION};
pub use image::Secret;
pub use keys::pbkdf_options;
pub use registry::{Daemon, DaemonOptions, PreparedDisk};
pub use rpc::ControlHandler;
pub use serve::{ignore_file_size_signal, serve, ServeConfig};
pub use start::StartDisk;
pub use start::UnlockBudget;

/// Something the serve loop must react to.
#[derive(Debug)]
pub enum Event {
    /// SIGTERM or SIGINT.
    Signal(i32),
    /// A disk's server stopped with an error (not by a stop request).
    ServerFailed { disk: String, error: String },
    /// An upgrade handed everything to a successor daemon: exit, touching nothing.
    HandedOver,
}
