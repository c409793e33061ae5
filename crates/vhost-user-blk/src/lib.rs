//! vhost-user-blk backend for cryptblk: exports one `BlockDevice` (a LUKS volume or a raw
//! file) to a VM over a vhost-user socket.
//!
//! - `request`: parses a virtio-blk request out of a descriptor chain (untrusted input).
//! - `chain`: walks a chain from its head index (requests resubmitted after a restart).
//! - `device`: executes a parsed request against the `BlockDevice`.
//! - `config`: the feature bits and the virtio-blk config space.
//! - `backend`: the `VhostUserBackend` impl: answers the message thread, hands rings to
//!   the workers.
//! - `worker`: one thread per virtqueue owning its ring, I/O queue, tags and inflight record.
//! - `frontend`: queue start/stop events for the daemon (`FrontendEvent`).
//! - `inflight`: vhost-user inflight I/O tracking, so that a restarted daemon resubmits what
//!   its predecessor had taken from the rings and not completed.
//! - `accept`: the socket file's owner and mode, and the peer-credential check at accept.
//! - `acceptor`: one thread accepting frontends on every disk's socket (`Acceptor`).
//! - `server`: one disk's socket and its connections (`Server`, `StopHandle`).
//! - `guest_fd`: which files may be mapped as guest memory (sealed memfds only).
//! - `guest_ram`: guest memory as the owner of requests' buffers (`GuestRam`), where a
//!   descriptor's range is checked and becomes an address.
//! - `guest_log`: the log of guest pages the device wrote (`MemoryLog`), for live migration.
//! - `fault`: crash points for the restart tests (only with the `fault-injection` feature).
//!
//! Live migration: the backend offers VHOST_F_LOG_ALL and the LOG_SHMFD protocol feature,
//! so QEMU can migrate a VM using it. Guest memory is `GuestMem`, whose per-region dirty
//! bitmap starts empty and is replaced by the frontend's shared log on SET_LOG_BASE; from
//! then on every guest page the device writes (read data, status bytes, GET_ID, used ring)
//! is marked in the log. The daemon learns that the VM was stopped for migration through
//! `Server::set_event_listener` (`FrontendEvent::Stopped { dirty_logging: true }`).
//! - this file: the options and errors, and `serve` (one disk until the process ends).

pub mod accept;
mod acceptor;
pub mod backend;
pub mod chain;
pub mod config;
pub mod device;
pub mod fault;
pub mod frontend;
pub mod guest_fd;
pub mod guest_log;
pub mod guest_ram;
pub mod inflight;
pub mod request;
mod server;
mod worker;

use std::io;
use std::path::Path;
use std::sync::Arc;

use cryptblk_block::BlockDevice;
use cryptblk_net::unix_socket::SocketFileError;
use vm_memory::GuestMemoryMmap;

pub use accept::{AllowedPeer, SocketFile};
pub use acceptor::{Acceptor, FailureListener, Served};
pub use backend::{BackendOptions, BlkBackend};
pub use device::VirtioBlkDevice;
pub use frontend::{EventListener, FrontendEvent};
pub use guest_log::MemoryLog;
pub use guest_ram::GuestRam;
pub use server::{Server, StopHandle};
pub use worker::RingDriver;

/// Guest memory as the backend maps it: each region carries a dirty bitmap (`MemoryLog`)
/// that is empty (marking costs one atomic load) until the frontend shares its dirty log with
/// SET_LOG_BASE.
pub type GuestMem = GuestMemoryMmap<MemoryLog>;

/// Largest queue size accepted.
pub const MAX_QUEUE_SIZE: u16 = 1024;
/// Most queues accepted (one worker thread each).
pub const MAX_QUEUES: u16 = 64;

/// How to export the disk.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub num_queues: u16,
    pub queue_size: u16,
    pub read_only: bool,
    /// GET_ID answer; cut to 20 bytes.
    pub serial: String,
    /// Offer VIRTIO_BLK_F_DISCARD and pass guest discards to the device (punched holes),
    /// like dm-crypt's `allow_discards`. Off by default: on an encrypted disk, discards
    /// reveal which blocks are unused. Ignored on a read-only export.
    pub discard: bool,
    /// Name of the disk in log lines.
    pub name: String,
    /// Busy-poll each queue's completions this long before sleeping, like QEMU's
    /// `aio-poll`: lower latency for a core spent spinning. Zero (the default) never polls.
    pub poll: std::time::Duration,
    /// Owner, group and mode of the socket file (default: the daemon's user, 0600).
    pub socket: SocketFile,
    /// The only frontend accepted (`SO_PEERCRED`); default: anyone who can open the socket.
    pub allowed_peer: AllowedPeer,
    /// Also map guest memory whose file is not sealed against shrinking (libblkio's buffers;
    /// QEMU's `memory-backend-file`): a frontend that truncates it then crashes the daemon
    /// with SIGBUS, every disk with it. Off by default (`guest_fd`).
    pub unsealed_memory: bool,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            num_queues: 1,
            queue_size: 256,
            read_only: false,
            serial: String::new(),
            discard: false,
            name: String::new(),
            poll: std::time::Duration::ZERO,
            socket: SocketFile::default(),
            allowed_peer: AllowedPeer::default(),
            unsealed_memory: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid options: {0}")]
    Options(String),
    #[error("cannot listen: {0}")]
    Listen(#[from] SocketFileError),
    #[error("vhost-user daemon: {0}")]
    Daemon(String),
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("flush at shutdown: {0}")]
    Flush(cryptblk_block::BlockError),
    #[error("opening the disk's I/O queues: {0}")]
    Queues(cryptblk_block::BlockError),
}

/// Serves `device` on `socket_path` until the process ends, accepting a new frontend after
/// each disconnect. Use `Server` directly to be able to stop it.
pub fn serve(
    socket_path: impl AsRef<Path>,
    device: Arc<dyn BlockDevice>,
    opts: ServeOptions,
) -> Result<(), Error> {
    Server::bind(socket_path, device, opts)?.run()
}
