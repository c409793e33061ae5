//! Running the daemon. Every disk named at start is checked first (its configuration), then
//! the disks are opened and unlocked in parallel (`start`), each served on its vhost-user
//! socket as soon as its key is derived; a disk that cannot be opened fails the whole start,
//! and every socket is removed again. The NBD server and the control socket start once every
//! disk serves (who waits for them finds every export there). A daemon started to take
//! over from a running one (`--take-over-fd`, `handover`) gets its disks, sockets and keys
//! from it instead. It then serves until SIGTERM or SIGINT, until a server fails, or until it
//! hands over to a successor (`ctl upgrade`), and stops every disk cleanly. Under systemd
//! (`Type=notify`) it reports `READY=1` once every disk serves, `STOPPING=1` when it begins
//! to stop, and `STATUS=` lines along the way.
use crate::error::{chain, Context, Error, Result};
use crate::handover::{ControlSocket, InheritedServers, Process};
use crate::key_cache::KeyCache;
use crate::notify::ServiceManager;
use crate::registry::{Daemon, DaemonOptions};
use crate::rpc::ControlHandler;
use crate::secret::MasterKey;
use crate::start::{attach_all, label, StartDisk, UnlockBudget};
use crate::Event;
use cryptblk_control::api::DiskConfig;
use cryptblk_control::ControlServer;
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::UnlockOptions;
use cryptblk_nbd::{ConnectionLimits, ExportRegistry, NbdAddress, NbdServer, TlsCreds};
use std::ffi::OsString;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// Everything `serve` runs.
pub struct ServeConfig {
    pub disks: Vec<StartDisk>,
    /// Also serve every disk over NBD here.
    pub nbd: Option<NbdAddress>,
    /// Require TLS on the NBD server (client certificates, and the allow-list in it).
    pub nbd_tls: Option<TlsCreds>,
    /// Serve NBD without TLS even on an address other machines reach (logged as a warning);
    /// otherwise plain NBD is refused there.
    pub nbd_insecure: bool,
    /// Connections the NBD server serves at once (in all, per peer address).
    pub nbd_limits: ConnectionLimits,
    /// The control socket.
    pub control: Option<PathBuf>,
    /// Answer Prometheus scrapes (`GET /metrics`) here; bound after every other socket.
    pub metrics: Option<cryptblk_net::Address>,
    pub pool: Arc<CryptoPool>,
    pub unlock: UnlockOptions,
    /// Decrypts passphrases given as `key-secret` (read from `--master-key-file` at start).
    pub master_key: Option<MasterKey>,
    /// Name disks in messages by name and image (several disks from a config file) rather
    /// than by image alone.
    pub name_disks: bool,
    /// Bytes of request data every queue of every disk may make the daemon hold at once, all
    /// together (`--memory-budget`); `None` for the default (`memory::budget`).
    pub memory_budget: Option<u64>,
    /// Keep each disk's volume keys in the kernel keyring, for this long after the daemon
    /// last renewed them (`--key-cache keyring`), so a restart after a crash needs no KDF.
    pub key_cache: Option<Duration>,
    /// Memory the key derivations at start may use at once, in KiB (`--unlock-memory`).
    pub unlock_memory_kib: u64,
    /// The hand-over channel from a running daemon to take over from (`--take-over-fd`).
    pub take_over: Option<OwnedFd>,
    /// How to start this daemon again (program, arguments), for `ctl upgrade`.
    pub restart: Option<(PathBuf, Vec<OsString>)>,
}

/// The servers besides the disks: NBD, control, metrics, each on a thread of its own.
#[derive(Default)]
struct Servers {
    nbd: Option<(cryptblk_nbd::StopHandle, JoinHandle<()>)>,
    control: Option<(cryptblk_control::StopHandle, JoinHandle<()>)>,
    metrics: Option<crate::metrics::Metrics>,
    /// Copies of their listening sockets for a successor (`ctl upgrade`).
    nbd_socket: Option<cryptblk_net::ListeningSocket>,
    control_socket: Option<(OwnedFd, PathBuf, cryptblk_net::unix_socket::FileId)>,
}

impl Servers {
    /// Stops them in order (metrics, control: no request during shutdown) and waits; the NBD
    /// server is stopped last by `stop_nbd`, after the disks.
    fn stop_front(&mut self) {
        if let Some(metrics) = self.metrics.take() {
            metrics.stop.stop();
            let _ = metrics.thread.join();
        }
        if let Some((stop, thread)) = self.control.take() {
            stop.stop();
            let _ = thread.join();
        }
    }

    fn stop_nbd(&mut self) {
        if let Some((stop, thread)) = self.nbd.take() {
            stop.stop();
            let _ = thread.join();
        }
    }

    fn stop_all(&mut self) {
        self.stop_front();
        self.stop_nbd();
    }
}

/// Runs the daemon until SIGTERM/SIGINT (then returns `Ok` once every disk is flushed and
/// closed), until a server fails, or until it has handed everything to a successor.
pub fn serve(mut config: ServeConfig) -> Result<()> {
    let take_over = config.take_over.take();
    if take_over.is_none() {
        for d in &config.disks {
            crate::config::validate(&d.config).map_err(|e| {
                Error::usage(format!("{}: {}", label(&d.config, config.name_disks), e.0))
            })?;
            let nbd = d.config.nbd_export.unwrap_or(true) && config.nbd.is_some();
            if d.config.vhost_user_blk.is_none() && !nbd {
                return Err(Error::usage(format!(
                    "disk \"{}\" would not be exported: give it a vhost-user-blk socket, or serve --nbd ADDR",
                    d.config.name
                )));
            }
        }
    }
    let budget = crate::memory::budget(config.memory_budget).map_err(Error::usage)?;
    crate::memory::apply(&budget);
    tracing::info!(
        "memory budget for request data: {} MiB ({})",
        budget.bytes >> 20,
        budget.source
    );
    let manager = ServiceManager::from_env();
    ignore_file_size_signal()?;
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .context("installing signal handlers")?;
    let (events_tx, events) = crossbeam_channel::unbounded();
    let registry = config.nbd.as_ref().map(|_| ExportRegistry::new());
    let key_cache = config
        .key_cache
        .and_then(|timeout| match KeyCache::open(timeout) {
            Ok(cache) => Some(cache),
            Err(e) => {
                tracing::warn!("--key-cache: {e}; serving without a key cache");
                None
            }
        });
    let daemon = Daemon::new(DaemonOptions {
        pool: config.pool.clone(),
        unlock: config.unlock.clone(),
        nbd: registry.clone(),
        nbd_tls: config.nbd_tls.is_some(),
        events: events_tx.clone(),
        master_key: config.master_key.take(),
        key_cache,
        backup_listener: crate::backup_export::BackupListener {
            tls: config.nbd_tls.clone(),
            plain_tcp: config.nbd_insecure,
            limits: config.nbd_limits,
        },
    });

    let mut servers = Servers::default();
    // What `ctl upgrade` hands a successor: filled in once the servers run.
    let process = Arc::new(OnceLock::new());
    match take_over {
        Some(fd) => {
            if let Some(m) = &manager {
                m.status("taking over from the running daemon");
            }
            let (inherited, predecessor) = crate::handover::take_over(&daemon, fd)?;
            if let Err(e) = start_servers(
                &config,
                &daemon,
                registry.as_ref(),
                inherited,
                &process,
                &mut servers,
            ) {
                let _ = daemon.shutdown();
                servers.stop_all();
                return Err(e);
            }
            predecessor.serving();
        }
        None => {
            if let Some(m) = &manager {
                m.status(&format!(
                    "opening and unlocking {} disk(s)",
                    config.disks.len()
                ));
            }
            let budget = UnlockBudget::new(config.unlock_memory_kib);
            let disks = std::mem::take(&mut config.disks);
            let name_disks = config.name_disks;
            if let Err(e) = attach_all(&daemon, disks, name_disks, &budget, |disk, info, took| {
                log_serving(disk, info, name_disks, took)
            }) {
                let _ = daemon.shutdown();
                return Err(e);
            }
            // The NBD and control sockets appear once every disk of the start serves, so that
            // whoever waits for them finds every export and disk there.
            if let Err(e) = start_servers(
                &config,
                &daemon,
                registry.as_ref(),
                InheritedServers::default(),
                &process,
                &mut servers,
            ) {
                servers.stop_front();
                let _ = daemon.shutdown();
                servers.stop_nbd();
                return Err(e);
            }
        }
    }
    // Set here only, once: `set` cannot find it taken.
    let _ = process.set(Process {
        program: config
            .restart
            .as_ref()
            .map(|r| r.0.clone())
            .unwrap_or_default(),
        args: config
            .restart
            .as_ref()
            .map(|r| r.1.clone())
            .unwrap_or_default(),
        nbd: match (&servers.nbd_socket, &servers.nbd) {
            (Some(socket), Some((stop, _))) => Some((duplicate(socket)?, stop.clone())),
            _ => None,
        },
        control: match (&servers.control_socket, &servers.control) {
            (Some((fd, path, file)), Some((stop, _))) => Some(ControlSocket {
                listener: fd.try_clone().context("copying the control socket")?,
                path: path.clone(),
                file: *file,
                stop: stop.clone(),
            }),
            _ => None,
        },
        metrics: match &servers.metrics {
            Some(m) => Some((duplicate(&m.socket)?, m.stop.clone())),
            None => None,
        },
        events: events_tx.clone(),
    });

    if let Some(m) = &manager {
        let names: Vec<String> = daemon.list().disks.into_iter().map(|d| d.name).collect();
        m.send(&format!(
            "READY=1\nSTATUS=serving {} disk(s){}{}",
            names.len(),
            if names.is_empty() { "" } else { ": " },
            names.join(", ")
        ));
    }
    let refresher = daemon
        .key_cache
        .is_some()
        .then(|| KeyCacheRefresher::start(daemon.clone()));
    let signal_handle = signals.handle();
    let signal_thread = std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            let _ = events_tx.send(Event::Signal(sig));
        }
    });

    // Run until a signal, a server's failure (the daemon never keeps running with some of its
    // disks gone) or a hand-over.
    let mut failure = None;
    let mut handed_over = false;
    if let Ok(event) = events.recv() {
        match event {
            Event::Signal(sig) => tracing::info!(signal = sig, "stopping"),
            Event::ServerFailed { disk, error } => {
                tracing::error!(disk = %disk, "server failed: {error}; stopping every disk");
                failure = Some(Error::new(
                    cryptblk_control::api::ErrorKind::Other,
                    format!("serving disk {disk}: {error}"),
                ));
            }
            Event::HandedOver => {
                tracing::info!("handed over to the new daemon; exiting");
                handed_over = true;
            }
        }
    }
    if let Some(refresher) = refresher {
        refresher.stop();
    }
    if !handed_over {
        if let Some(m) = &manager {
            m.send("STOPPING=1\nSTATUS=stopping: draining requests in flight, flushing every disk");
        }
    }
    // Control first (no disk-add during shutdown), then every disk (in-flight requests
    // finish, images are flushed), then the NBD listener. After a hand-over the disks are
    // gone already and the servers stopped without removing their sockets.
    servers.stop_front();
    let detached = daemon.shutdown();
    servers.stop_nbd();
    signal_handle.close();
    let _ = signal_thread.join();
    match (failure, detached) {
        (Some(e), _) | (None, Err(e)) => Err(e),
        (None, Ok(())) => Ok(()),
    }
}

/// Starts the NBD server and the control socket (bound here, or handed over), then the
/// metrics endpoint.
fn start_servers(
    config: &ServeConfig,
    daemon: &Arc<Daemon>,
    registry: Option<&Arc<ExportRegistry>>,
    inherited: InheritedServers,
    process: &Arc<OnceLock<Process>>,
    servers: &mut Servers,
) -> Result<()> {
    let events = daemon.events();
    if let (Some(addr), Some(registry)) = (&config.nbd, registry) {
        let server = match inherited.nbd {
            Some(listener) => {
                NbdServer::from_listener(listener, registry.clone(), config.nbd_tls.clone())
            }
            None => match config.nbd_tls.clone() {
                None if config.nbd_insecure => NbdServer::bind_plain_tcp(addr, registry.clone()),
                tls => NbdServer::bind(addr, registry.clone(), tls),
            },
        }
        .map_err(|e| Error::caused(format!("NBD server on {addr}"), e))?
        .with_connection_limits(config.nbd_limits);
        tracing::info!(address = %server.local_addr(), "NBD server listening");
        servers.nbd_socket = Some(
            server
                .listener()
                .handover_copy()
                .context("the NBD server's socket")?,
        );
        let stop = server.stop_handle();
        let events = events.clone();
        let thread = std::thread::Builder::new()
            .name("nbd".into())
            .spawn(move || {
                if let Err(e) = server.run() {
                    let _ = events.send(Event::ServerFailed {
                        disk: "(NBD server)".into(),
                        error: chain(&e),
                    });
                }
            })
            .context("starting the NBD server thread")?;
        servers.nbd = Some((stop, thread));
    }

    if let Some(path) = &config.control {
        let handler = Arc::new(ControlHandler {
            daemon: daemon.clone(),
            process: process.clone(),
        });
        let server = match inherited.control {
            Some((path, listener, file)) => {
                ControlServer::from_listener(path, listener, file, handler)
            }
            None => ControlServer::bind(path, handler),
        }
        .map_err(|e| Error::caused(format!("control socket {}", path.display()), e))?;
        if let Some((listener, file)) = server.listener() {
            servers.control_socket = Some((
                listener
                    .as_fd()
                    .try_clone_to_owned()
                    .context("copying the control socket")?,
                server.path().to_path_buf(),
                file,
            ));
        }
        tracing::info!(path = %path.display(), "control socket listening");
        let stop = server.stop_handle();
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                if let Err(e) = server.run() {
                    tracing::warn!("control socket: {}", chain(&e));
                }
            })
            .context("starting the control thread")?;
        servers.control = Some((stop, thread));
    }

    if let Some(address) = &config.metrics {
        servers.metrics = Some(crate::metrics::start(
            address,
            inherited.metrics,
            daemon.clone(),
        )?);
    }
    Ok(())
}

/// A copy of a listening socket for a successor.
fn duplicate(socket: &cryptblk_net::ListeningSocket) -> Result<cryptblk_net::ListeningSocket> {
    Ok(cryptblk_net::ListeningSocket {
        fd: socket
            .fd
            .try_clone()
            .context("copying a listening socket")?,
        address: socket.address.clone(),
        file: socket.file,
    })
}

/// One line a person reads ("serving vm1.luks (luks) on vhost-user-blk /run/vm1.sock"), with
/// the disk as a field for log shippers.
fn log_serving(
    disk: &DiskConfig,
    info: &cryptblk_control::api::DiskInfo,
    name_disks: bool,
    opened_in: Duration,
) {
    let format = info.attached.as_ref().map_or("?", |a| a.format.as_str());
    let exports: Vec<String> = disk
        .vhost_user_blk
        .iter()
        .map(|s| format!("vhost-user-blk {}", s.display()))
        .chain(
            info.attached
                .as_ref()
                .is_some_and(|a| a.nbd_export)
                .then(|| format!("NBD export \"{}\"", disk.name)),
        )
        .collect();
    tracing::info!(
        disk = %disk.name,
        opened_ms = opened_in.as_millis() as u64,
        "serving {} ({format}) on {}",
        label(disk, name_disks),
        exports.join(", ")
    );
}

/// Renews the key cache's timeouts while the daemon runs.
struct KeyCacheRefresher {
    stop: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    thread: JoinHandle<()>,
}

impl KeyCacheRefresher {
    fn start(daemon: Arc<Daemon>) -> KeyCacheRefresher {
        let stop = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("key-cache".into())
            .spawn(move || {
                let Some(cache) = daemon.key_cache.as_ref() else {
                    return;
                };
                let (stopped, wake) = &*flag;
                let mut stopped = stopped.lock().unwrap_or_else(|p| p.into_inner());
                while !*stopped {
                    stopped = wake
                        .wait_timeout(stopped, cache.refresh_interval())
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    cache.refresh();
                }
            })
            .expect("starting the key cache thread");
        KeyCacheRefresher { stop, thread }
    }

    fn stop(self) {
        *self.stop.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.stop.1.notify_all();
        let _ = self.thread.join();
    }
}

/// A file size limit (RLIMIT_FSIZE, systemd's LimitFSIZE=) reached by a write or a resize
/// must fail that one request with EFBIG, not kill the daemon and every disk it serves with
/// SIGXFSZ's default action (nor `cryptblk resize` before it can say what happened).
pub fn ignore_file_size_signal() -> Result<()> {
    // SAFETY: SIG_IGN installs no handler code; changing a signal's disposition has no
    // memory-safety precondition.
    let previous = unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    if previous == libc::SIG_ERR {
        return Err(Error::caused(
            "ignoring SIGXFSZ",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}
