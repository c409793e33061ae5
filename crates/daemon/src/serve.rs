//! Running the daemon: every disk named at start is opened and unlocked before any socket is
//! bound (one missing image or wrong key fails the whole start and leaves no socket behind),
//! then the exports, the NBD server and the control socket start, and the daemon serves until
//! SIGTERM or SIGINT, or until a server fails, and then stops every disk cleanly. Under
//! systemd (`Type=notify`) it reports `READY=1` once every disk is unlocked and every socket
//! bound, `STOPPING=1` when it begins to stop, and `STATUS=` lines along the way.
use crate::error::{chain, Context, Error, Result};
use crate::key_file::Passphrase;
use crate::notify::ServiceManager;
use crate::registry::{Daemon, DaemonOptions};
use crate::rpc::ControlHandler;
use crate::secret::MasterKey;
use crate::Event;
use cryptblk_control::api::DiskConfig;
use cryptblk_control::ControlServer;
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::UnlockOptions;
use cryptblk_nbd::{ConnectionLimits, ExportRegistry, NbdAddress, NbdServer, TlsCreds};
use std::path::PathBuf;
use std::sync::Arc;

/// A disk to attach at start, with the passphrase when the caller asked for it on a terminal.
pub struct StartDisk {
    pub config: DiskConfig,
    pub passphrase: Option<Passphrase>,
}

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
}

/// Runs the daemon until SIGTERM/SIGINT (then returns `Ok` once every disk is flushed and
/// closed) or until a server fails.
pub fn serve(config: ServeConfig) -> Result<()> {
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
    let budget = crate::memory::budget(config.memory_budget).map_err(Error::usage)?;
    crate::memory::apply(&budget);
    tracing::info!(
        "memory budget for request data: {} MiB ({})",
        budget.bytes >> 20,
        budget.source
    );
    let manager = ServiceManager::from_env();
    if let Some(m) = &manager {
        m.status(&format!(
            "opening and unlocking {} disk(s)",
            config.disks.len()
        ));
    }
    ignore_file_size_signal()?;
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .context("installing signal handlers")?;
    let (events_tx, events) = crossbeam_channel::unbounded();
    let registry = config.nbd.as_ref().map(|_| ExportRegistry::new());
    let daemon = Daemon::new(DaemonOptions {
        pool: config.pool,
        unlock: config.unlock,
        nbd: registry.clone(),
        nbd_tls: config.nbd_tls.is_some(),
        events: events_tx.clone(),
        master_key: config.master_key,
    });

    // Every disk is opened and unlocked before any socket is bound; then all are exported.
    // One failure detaches the others again and fails the start.
    let name_disks = config.name_disks;
    let mut prepared = Vec::with_capacity(config.disks.len());
    for StartDisk { config, passphrase } in config.disks {
        let what = label(&config, name_disks);
        match daemon.prepare(config, passphrase) {
            Ok(p) => prepared.push(p),
            Err(e) => {
                for p in prepared {
                    daemon.abandon(p);
                }
                return Err(e.context(what));
            }
        }
    }
    let mut pending = prepared.into_iter();
    while let Some(p) = pending.next() {
        let disk = p.config.clone();
        let info = match daemon.publish(p) {
            Ok(info) => info,
            Err(e) => {
                for rest in pending {
                    daemon.abandon(rest);
                }
                let _ = daemon.shutdown();
                return Err(e.context(label(&disk, name_disks)));
            }
        };
        // One line a person reads ("serving vm1.luks (luks) on vhost-user-blk /run/vm1.sock"),
        // with the disk as a field for log shippers.
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
            "serving {} ({format}) on {}",
            label(&disk, name_disks),
            exports.join(", ")
        );
    }

    let mut nbd_thread = None;
    if let (Some(addr), Some(registry)) = (&config.nbd, &registry) {
        let bound = match config.nbd_tls {
            None if config.nbd_insecure => NbdServer::bind_plain_tcp(addr, registry.clone()),
            tls => NbdServer::bind(addr, registry.clone(), tls),
        };
        let server = match bound {
            Ok(s) => s.with_connection_limits(config.nbd_limits),
            Err(e) => {
                let _ = daemon.shutdown();
                return Err(Error::caused(format!("NBD server on {addr}"), e));
            }
        };
        tracing::info!(address = %server.local_addr(), "NBD server listening");
        let stop = server.stop_handle();
        let events = events_tx.clone();
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
        nbd_thread = Some((stop, thread));
    }

    let mut control_thread = None;
    if let Some(path) = &config.control {
        let handler = Arc::new(ControlHandler {
            daemon: daemon.clone(),
        });
        let server = match ControlServer::bind(path, handler) {
            Ok(s) => s,
            Err(e) => {
                if let Some((stop, thread)) = nbd_thread.take() {
                    stop.stop();
                    let _ = thread.join();
                }
                let _ = daemon.shutdown();
                return Err(Error::caused(
                    format!("control socket {}", path.display()),
                    e,
                ));
            }
        };
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
        control_thread = Some((stop, thread));
    }

    let metrics_thread = match &config.metrics {
        Some(address) => match crate::metrics::start(address, daemon.clone()) {
            Ok(started) => Some(started),
            Err(e) => {
                if let Some((stop, thread)) = control_thread.take() {
                    stop.stop();
                    let _ = thread.join();
                }
                if let Some((stop, thread)) = nbd_thread.take() {
                    stop.stop();
                    let _ = thread.join();
                }
                let _ = daemon.shutdown();
                return Err(e);
            }
        },
        None => None,
    };

    if let Some(m) = &manager {
        let names: Vec<String> = daemon.list().disks.into_iter().map(|d| d.name).collect();
        m.send(&format!(
            "READY=1\nSTATUS=serving {} disk(s){}{}",
            names.len(),
            if names.is_empty() { "" } else { ": " },
            names.join(", ")
        ));
    }
    let signal_handle = signals.handle();
    let signal_thread = std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            let _ = events_tx.send(Event::Signal(sig));
        }
    });

    // Run until a signal, or until a server fails: the daemon never keeps running with some
    // of its disks gone.
    let mut failure = None;
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
        }
    }

    if let Some(m) = &manager {
        m.send("STOPPING=1\nSTATUS=stopping: draining requests in flight, flushing every disk");
    }
    if let Some((stop, thread)) = metrics_thread {
        stop.stop();
        let _ = thread.join();
    }
    // Control first (no disk-add during shutdown), then every disk (in-flight requests
    // finish, images are flushed), then the NBD listener.
    if let Some((stop, thread)) = control_thread {
        stop.stop();
        let _ = thread.join();
    }
    let detached = daemon.shutdown();
    if let Some((stop, thread)) = nbd_thread {
        stop.stop();
        let _ = thread.join();
    }
    signal_handle.close();
    let _ = signal_thread.join();
    match (failure, detached) {
        (Some(e), _) | (None, Err(e)) => Err(e),
        (None, Ok(())) => Ok(()),
    }
}

/// How messages name a disk at start.
fn label(config: &DiskConfig, by_name: bool) -> String {
    if by_name {
        format!("disk \"{}\" ({})", config.name, config.image)
    } else {
        config.image.to_string()
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
