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
//! - `guest_fd`: which files may be mapped as guest memory (sealed memfds only).
//! - `guest_log`: the log of guest pages the device wrote (`MemoryLog`), for live migration.
//! - `fault`: crash points for the restart tests (only with the `fault-injection` feature).
//!
//! Live migration: the backend offers VHOST_F_LOG_ALL and the LOG_SHMFD protocol feature,
//! so QEMU can migrate a VM using it. Guest memory is `GuestMem`, whose per-region dirty
//! bitmap starts empty and is replaced by the frontend's shared log on SET_LOG_BASE; from
//! then on every guest page the device writes (read data, status bytes, GET_ID, used ring)
//! is marked in the log. The daemon learns that the VM was stopped for migration through
//! `Server::set_event_listener` (`FrontendEvent::Stopped { dirty_logging: true }`).
//! - this file: the listening loop (`Server`), reconnects and shutdown.

pub mod accept;
pub mod backend;
pub mod chain;
pub mod config;
pub mod device;
pub mod fault;
pub mod frontend;
pub mod guest_fd;
pub mod guest_log;
pub mod inflight;
pub mod request;
mod worker;

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cryptblk_block::{BlockDevice, IoStats, IoStatsSnapshot};
use cryptblk_net::unix_socket::{bind_private, remove_if_ours, FileId, SocketFileError};
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub use accept::{AllowedPeer, SocketFile};
pub use backend::{BackendOptions, BlkBackend};
pub use device::Disk;
use frontend::FrontendState;
pub use frontend::{EventListener, FrontendEvent};
pub use guest_log::MemoryLog;
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

/// Stops a running `Server` from another thread (a signal handler thread, a test).
#[derive(Clone)]
pub struct StopHandle {
    shared: Arc<Shared>,
}

struct Shared {
    stop: AtomicBool,
    wake: EventFd,
    connection: Mutex<Option<Connection>>,
    /// A frontend is connected.
    connected: AtomicBool,
    /// One per queue; kept across connections.
    queue_stats: Vec<Arc<IoStats>>,
    /// Queue starts/stops and LOG_ALL of the current connection, and the event listener.
    frontend: Arc<FrontendState>,
}

/// The connection being served: its backend, to drain, and the handle that closes it.
#[derive(Clone)]
struct Connection {
    backend: BlkBackend,
    shutdown: ShutdownHandle,
}

impl Connection {
    /// Takes no more requests from the guest, answers and signals every one taken, then closes
    /// the socket. The frontend never sees the connection end while completions are still
    /// landing on its used rings, so a QEMU that restarts them at used->idx (what it does
    /// when its backend goes away) repeats and loses nothing.
    fn close(&self) {
        self.backend.drain();
        self.shutdown.shutdown();
    }
}

impl StopHandle {
    /// Asks the server to stop: the current connection (if any) stops taking requests, its
    /// requests taken complete and are signalled to the guest, then it is closed; the disk
    /// is flushed, and `Server::run` returns. Blocks until the connection is closed.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = self.shared.wake.write(1);
        let connection = self
            .shared
            .connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(connection) = connection {
            connection.close();
        }
    }

    /// True while a frontend (a VM) is connected.
    pub fn is_connected(&self) -> bool {
        self.shared.connected.load(Ordering::SeqCst)
    }

    /// True while the connected frontend has VHOST_F_LOG_ALL negotiated, i.e. asks for
    /// dirty page logging: QEMU sets it while it live-migrates the VM.
    pub fn dirty_logging(&self) -> bool {
        self.shared.connected.load(Ordering::SeqCst) && self.shared.frontend.log_all()
    }

    /// Tells the connected frontend that the config space changed (the disk was resized: its
    /// capacity is read from the device at each GET_CONFIG, so it already shows the new size):
    /// VHOST_USER_BACKEND_CONFIG_CHANGE_MSG on the backend request channel, after which QEMU
    /// reads the config again and raises the virtio config interrupt, and the guest's kernel
    /// picks up the capacity. Returns whether a frontend was told: false when none is
    /// connected or it gave no backend channel (it sees the size at its next GET_CONFIG, e.g.
    /// a reboot). Call it from a thread other than the connection's (the control thread):
    /// the frontend answers with a GET_CONFIG that thread serves.
    pub fn notify_config_change(&self) -> io::Result<bool> {
        // The channel is the connection's: set by its SET_BACKEND_REQ_FD, dropped when it
        // ends (not `is_connected`, which the server thread sets a moment after the
        // frontend's first messages are already being answered).
        self.shared.frontend.config_changed()
    }

    /// Counters of each queue since the server started (all connections).
    pub fn queue_stats(&self) -> Vec<IoStatsSnapshot> {
        self.shared
            .queue_stats
            .iter()
            .map(|s| s.snapshot())
            .collect()
    }
}

/// A listening vhost-user-blk socket serving one disk, one frontend at a time; accepts a new
/// connection after the previous frontend disconnects.
pub struct Server {
    listener: UnixListener,
    path: PathBuf,
    /// The socket file we created, removed when the server goes (if still ours).
    file: FileId,
    device: Arc<dyn BlockDevice>,
    opts: ServeOptions,
    shared: Arc<Shared>,
}

impl Server {
    /// Binds the socket (replacing a stale one at that path).
    pub fn bind(
        socket_path: impl AsRef<Path>,
        device: Arc<dyn BlockDevice>,
        opts: ServeOptions,
    ) -> Result<Self, Error> {
        if opts.num_queues == 0 || opts.num_queues > MAX_QUEUES {
            return Err(Error::Options(format!(
                "number of queues must be 1 to {MAX_QUEUES}, not {}",
                opts.num_queues
            )));
        }
        if !opts.queue_size.is_power_of_two() || opts.queue_size > MAX_QUEUE_SIZE {
            return Err(Error::Options(format!(
                "queue size must be a power of two up to {MAX_QUEUE_SIZE}, not {}",
                opts.queue_size
            )));
        }
        let path = socket_path.as_ref().to_path_buf();
        // Replaces only a stale socket, never a file someone pointed us at by mistake (e.g.
        // the image); owner and mode are set before the file appears at `path`.
        let (listener, file) = bind_private(&path, &opts.socket)?;
        // A connection that vanishes between poll and accept must not block the loop.
        listener.set_nonblocking(true)?;
        Ok(Server {
            listener,
            path,
            file,
            device,
            shared: Arc::new(Shared {
                stop: AtomicBool::new(false),
                wake: EventFd::new(EFD_NONBLOCK)?,
                connection: Mutex::new(None),
                connected: AtomicBool::new(false),
                queue_stats: (0..opts.num_queues)
                    .map(|_| Arc::new(IoStats::default()))
                    .collect(),
                frontend: Arc::default(),
            }),
            opts,
        })
    }

    pub fn stop_handle(&self) -> StopHandle {
        StopHandle {
            shared: self.shared.clone(),
        }
    }

    /// Registers the callback told what the frontend does with the device's queues
    /// (`FrontendEvent`): `Started` when it starts them, `Stopped { dirty_logging }` once it
    /// has stopped them all and their requests are answered. With `dirty_logging: true` the
    /// VM was stopped by a live migration (VHOST_F_LOG_ALL negotiated); the device then
    /// touches neither guest memory nor the disk until the next `Started` (on this
    /// connection) or a new connection. The callback runs on the connection's vhost-user
    /// message thread (the frontend waits for it): keep it short. Replaces any earlier one.
    pub fn set_event_listener(&mut self, listener: EventListener) {
        self.shared.frontend.set_listener(Some(listener));
    }

    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// Serves frontends one after another until stopped; then flushes the disk.
    pub fn run(mut self) -> Result<(), Error> {
        while let Some(stream) = self.wait_for_connection()? {
            self.serve_connection(stream)?;
        }
        self.device.flush().map_err(Error::Flush)?;
        remove_if_ours(&self.path, self.file);
        Ok(())
    }

    /// Blocks until an allowed frontend connects, or a stop is requested (`None`).
    fn wait_for_connection(&self) -> Result<Option<UnixStream>, Error> {
        loop {
            if self.shared.stop.load(Ordering::SeqCst) {
                return Ok(None);
            }
            let mut fds = [
                libc::pollfd {
                    fd: self.listener.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.shared.wake.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: `fds` is a valid array of two initialised pollfd structs that lives
            // across the call; the length passed matches it.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err.into());
            }
            if fds[1].revents != 0 {
                let _ = self.shared.wake.read();
                continue;
            }
            if fds[0].revents != 0 {
                let accepted =
                    accept::accept_allowed(&self.listener, &self.opts.allowed_peer, &self.path)?;
                if let Some(stream) = accepted {
                    return Ok(Some(stream));
                }
            }
        }
    }

    /// Runs one frontend connection to its end; every request popped from its queues is
    /// answered before this returns.
    fn serve_connection(&mut self, stream: UnixStream) -> Result<(), Error> {
        let mem = GuestMemoryAtomic::new(GuestMem::new());
        let disk = Disk::new(self.device.clone(), self.opts.read_only, &self.opts.serial)
            .with_discard(self.opts.discard);
        self.shared.frontend.reset();
        let backend = match BlkBackend::with_frontend(
            disk,
            self.opts.num_queues,
            self.opts.queue_size,
            mem.clone(),
            &self.shared.queue_stats,
            BackendOptions {
                name: self.opts.name.clone(),
                poll: self.opts.poll,
            },
            self.shared.frontend.clone(),
        ) {
            Ok(backend) => backend,
            Err(backend::StartError::Queues(e)) => return Err(Error::Queues(e)),
            Err(e @ backend::StartError::Worker(_)) => return Err(Error::Daemon(e.to_string())),
        };
        let mut daemon =
            VhostUserDaemon::new("cryptblk-vhost-user-blk".into(), backend.clone(), mem)
                .map_err(|e| Error::Daemon(e.to_string()))?;
        if !self.opts.unsealed_memory {
            daemon.set_memory_file_check(Arc::new(guest_fd::check_guest_memory_file));
        }
        daemon
            .start_stream(stream)
            .map_err(|e| Error::Daemon(e.to_string()))?;
        let connection = daemon.shutdown_handle().map(|shutdown| Connection {
            backend: backend.clone(),
            shutdown,
        });
        *self
            .shared
            .connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = connection.clone();
        if self.shared.stop.load(Ordering::SeqCst) {
            match &connection {
                Some(connection) => connection.close(),
                None => daemon.request_shutdown(),
            }
        }
        self.shared.connected.store(true, Ordering::SeqCst);
        tracing::info!("vhost-user frontend connected on {}", self.path.display());
        let result = daemon.wait();
        self.shared.frontend.drop_backend_req();
        *self
            .shared
            .connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
        drop(daemon);
        // Requests taken and still on the device complete before the memory they point into is released
        // and before a new frontend may connect.
        backend.stop_workers();
        self.shared.connected.store(false, Ordering::SeqCst);
        match result {
            Ok(()) => tracing::info!("vhost-user frontend disconnected"),
            // A frontend that goes away mid-message (killed VM) is a normal disconnect.
            Err(e) => tracing::info!("vhost-user connection ended: {e}"),
        }
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        remove_if_ours(&self.path, self.file);
    }
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
