//! One disk's listening socket and the frontend connections it serves, one at a time.
//!
//! A `Server` is bound (or taken over from a predecessor daemon) but does not accept by
//! itself: an [`Acceptor`](crate::Acceptor) watches every disk's listener from one thread and
//! gives each accepted frontend a thread of its own for as long as it stays connected
//! (vhost-user-backend's message thread and the queue workers come and go with it). So an
//! idle disk costs a socket and no thread. `Server::run` is the one-disk shortcut: its own
//! acceptor, until stopped.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cryptblk_block::{BlockDevice, IoStats, IoStatsSnapshot};
use cryptblk_net::unix_socket::{bind_private, remove_if_ours, FileId};
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::GuestMemoryAtomic;

use crate::backend::{self, BackendOptions, BlkBackend};
use crate::device::VirtioBlkDevice;
use crate::frontend::FrontendState;
use crate::{guest_fd, Error, EventListener, GuestMem, ServeOptions, MAX_QUEUES, MAX_QUEUE_SIZE};

/// Stops a served disk, or asks about its frontend, from another thread (the control socket,
/// a signal handler thread, a test).
#[derive(Clone)]
pub struct StopHandle {
    shared: Arc<Shared>,
}

/// What the acceptor, the connection thread and the handles share.
pub(crate) struct Shared {
    /// No new frontend is accepted; a connection that starts finds this and closes at once.
    pub(crate) stop: AtomicBool,
    /// The socket file now belongs to a successor daemon: leave it at its path when stopping.
    handed_over: AtomicBool,
    connection: Mutex<Option<Connection>>,
    /// A frontend is connected.
    connected: AtomicBool,
    /// One per queue; kept across connections.
    queue_stats: Vec<Arc<IoStats>>,
    /// Queue starts/stops and LOG_ALL of the current connection, and the event listener.
    frontend: Arc<FrontendState>,
    /// Signalled by `StopHandle::stop` (what `Server::run` waits for).
    pub(crate) stopped: (
        crossbeam_channel::Sender<()>,
        crossbeam_channel::Receiver<()>,
    ),
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
    /// Accepts no new frontend; the current connection (if any) stops taking requests, its
    /// requests taken complete and are signalled to the guest, then it is closed. Blocks
    /// until the connection is closed. (Flushing the disk and removing the socket file is
    /// [`Served::stop`](crate::Served::stop)'s, or `Server::run`'s.)
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = self.shared.stopped.0.try_send(());
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

    /// The socket file now belongs to a successor daemon (which took the listener over):
    /// stopping leaves it where it is.
    pub fn hand_over(&self) {
        self.shared.handed_over.store(true, Ordering::SeqCst);
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
        // ends (not `is_connected`, which the connection thread sets a moment after the
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

/// A listening vhost-user-blk socket serving one disk, one frontend at a time; a new frontend
/// is accepted after the previous one disconnects.
pub struct Server {
    pub(crate) listener: UnixListener,
    pub(crate) path: PathBuf,
    /// The socket file we created, removed when the server goes (if still ours).
    file: FileId,
    device: Arc<dyn BlockDevice>,
    pub(crate) opts: ServeOptions,
    pub(crate) shared: Arc<Shared>,
}

impl Server {
    /// Binds the socket (replacing a stale one at that path).
    pub fn bind(
        socket_path: impl AsRef<Path>,
        device: Arc<dyn BlockDevice>,
        opts: ServeOptions,
    ) -> Result<Self, Error> {
        check_options(&opts)?;
        let path = socket_path.as_ref().to_path_buf();
        // Replaces only a stale socket, never a file someone pointed us at by mistake (e.g.
        // the image); owner and mode are set before the file appears at `path`.
        let (listener, file) = bind_private(&path, &opts.socket)?;
        Self::with_listener(listener, path, file, device, opts)
    }

    /// Serves on a listening socket a predecessor daemon handed over: `file` names the socket
    /// file it created at `path`, which stays where it is (frontends reconnect to it; no
    /// moment passes without a listener).
    pub fn from_listener(
        listener: UnixListener,
        path: PathBuf,
        file: FileId,
        device: Arc<dyn BlockDevice>,
        opts: ServeOptions,
    ) -> Result<Self, Error> {
        check_options(&opts)?;
        Self::with_listener(listener, path, file, device, opts)
    }

    fn with_listener(
        listener: UnixListener,
        path: PathBuf,
        file: FileId,
        device: Arc<dyn BlockDevice>,
        opts: ServeOptions,
    ) -> Result<Self, Error> {
        // A connection that vanishes between the acceptor's wake-up and accept must not block.
        listener.set_nonblocking(true)?;
        Ok(Server {
            listener,
            path,
            file,
            device,
            shared: Arc::new(Shared {
                stop: AtomicBool::new(false),
                handed_over: AtomicBool::new(false),
                connection: Mutex::new(None),
                connected: AtomicBool::new(false),
                queue_stats: (0..opts.num_queues)
                    .map(|_| Arc::new(IoStats::default()))
                    .collect(),
                frontend: Arc::default(),
                stopped: crossbeam_channel::bounded(1),
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

    /// The listening socket, e.g. to hand it to a successor daemon.
    pub fn listener_fd(&self) -> BorrowedFd<'_> {
        self.listener.as_fd()
    }

    /// The socket file's identity, which a successor daemon taking the listener over needs.
    pub fn file_id(&self) -> FileId {
        self.file
    }

    /// Serves frontends one after another until stopped (`StopHandle::stop` from another
    /// thread); then flushes the disk and removes the socket file. One disk, one acceptor
    /// thread of its own: a daemon with many disks shares one [`Acceptor`](crate::Acceptor).
    pub fn run(self) -> Result<(), Error> {
        let acceptor = crate::Acceptor::start()?;
        let (failed_tx, failed) = crossbeam_channel::bounded(1);
        let served = acceptor.serve(
            self,
            Some(Box::new(move |e| {
                let _ = failed_tx.try_send(e);
            })),
        )?;
        let stopped = served.stopped_signal();
        crossbeam_channel::select! {
            recv(stopped) -> _ => served.stop(),
            recv(failed) -> e => {
                let flushed = served.stop();
                match e {
                    Ok(e) => Err(e),
                    Err(_) => flushed,
                }
            }
        }
    }

    /// Runs one frontend connection to its end; every request popped from its queues is
    /// answered before this returns.
    pub(crate) fn serve_connection(&self, stream: UnixStream) -> Result<(), Error> {
        let mem = GuestMemoryAtomic::new(GuestMem::new());
        let disk =
            VirtioBlkDevice::new(self.device.clone(), self.opts.read_only, &self.opts.serial)
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
        // Requests taken and still on the device complete before the memory they point into is
        // released and before a new frontend may connect.
        backend.stop_workers();
        self.shared.connected.store(false, Ordering::SeqCst);
        match result {
            Ok(()) => tracing::info!("vhost-user frontend disconnected"),
            // A frontend that goes away mid-message (killed VM) is a normal disconnect.
            Err(e) => tracing::info!("vhost-user connection ended: {e}"),
        }
        Ok(())
    }

    /// After the last connection: the disk flushed, the socket file removed (unless a
    /// successor daemon took it over).
    pub(crate) fn finish(&self) -> Result<(), Error> {
        let flushed = self.device.flush().map_err(Error::Flush);
        self.remove_socket_file();
        flushed
    }

    fn remove_socket_file(&self) {
        if !self.shared.handed_over.load(Ordering::SeqCst) {
            remove_if_ours(&self.path, self.file);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.remove_socket_file();
    }
}

fn check_options(opts: &ServeOptions) -> Result<(), Error> {
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
    Ok(())
}
