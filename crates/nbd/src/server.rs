//! The listener: accepts clients on a Unix or TCP socket and runs each connection on its own
//! thread until told to stop.

use crate::export::ExportRegistry;
use crate::handshake::{negotiate, HandshakeSettings};
use crate::socket::Socket;
use crate::transmission::{serve, ConnectionConfig};
use crate::{Error, NbdAddress, TlsCreds};
use cryptblk_net::{ConnectionGate, ConnectionLimits, Listener, ListenerWaker};
use std::collections::HashMap;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// Group read/write: a VM manager running as another user in the group can connect.
const UNIX_SOCKET_MODE: u32 = 0o660;

/// Connections served at once unless [`NbdServer::with_connection_limits`] says otherwise:
/// 128 in all, 32 from one TCP peer address (QEMU with multi-conn and nbdcopy open a handful
/// per disk). Each connection is a thread and may hold 64 MiB of requests in flight.
pub const DEFAULT_CONNECTION_LIMITS: ConnectionLimits = ConnectionLimits {
    total: 128,
    per_peer: 32,
};

/// A bound NBD server; `run` serves it.
pub struct NbdServer {
    listener: Listener,
    local_addr: String,
    settings: Arc<HandshakeSettings>,
    config: ConnectionConfig,
    gate: ConnectionGate,
    stop: StopHandle,
}

/// Stops a running server from another thread (or a signal handler thread).
#[derive(Clone)]
pub struct StopHandle {
    state: Arc<StopState>,
}

struct StopState {
    stopped: AtomicBool,
    /// Wakes a blocked `accept()`, even when the socket file is gone.
    waker: ListenerWaker,
}

impl StopHandle {
    /// Asks the server to stop: `run` stops accepting, winds down every connection (in-flight
    /// requests are finished and answered) and returns. Idempotent.
    pub fn stop(&self) {
        if !self.state.stopped.swap(true, Ordering::SeqCst) {
            self.state.waker.wake();
        }
    }

    /// The listening socket now belongs to a successor daemon: a Unix socket's file stays
    /// where it is when the server stops. (Stopping never shuts the shared socket down.)
    pub fn hand_over(&self) {
        self.state.waker.hand_over();
    }

    fn is_stopped(&self) -> bool {
        self.state.stopped.load(Ordering::SeqCst)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl NbdServer {
    /// Binds `addr`. With `tls`, every client must upgrade with NBD_OPT_STARTTLS and present
    /// a certificate the CA signed before it can do anything but abort. Without `tls`, `addr`
    /// must be a Unix socket or a loopback TCP address ([`Error::PlainTcp`] otherwise): plain
    /// NBD carries disk contents unauthenticated and unencrypted, so it is offered to the
    /// network only on purpose, with [`bind_plain_tcp`](Self::bind_plain_tcp).
    pub fn bind(
        addr: &NbdAddress,
        exports: Arc<ExportRegistry>,
        tls: Option<TlsCreds>,
    ) -> Result<Self, Error> {
        if tls.is_none() {
            let local = addr.is_loopback().map_err(|source| Error::Bind {
                address: addr.to_string(),
                source,
            })?;
            if !local {
                return Err(Error::PlainTcp {
                    address: addr.to_string(),
                });
            }
        }
        Self::bind_unchecked(addr, exports, tls)
    }

    /// Binds `addr` without TLS wherever it is, a non-loopback address included: anyone who
    /// can reach it reads and writes every export. Logged as a warning.
    pub fn bind_plain_tcp(addr: &NbdAddress, exports: Arc<ExportRegistry>) -> Result<Self, Error> {
        let server = Self::bind_unchecked(addr, exports, None)?;
        if !addr.is_loopback().unwrap_or(false) {
            tracing::warn!(
                address = %server.local_addr,
                "NBD without TLS on a non-loopback address: anyone who reaches {} can read and \
                 write every export",
                server.local_addr
            );
        }
        Ok(server)
    }

    fn bind_unchecked(
        addr: &NbdAddress,
        exports: Arc<ExportRegistry>,
        tls: Option<TlsCreds>,
    ) -> Result<Self, Error> {
        let bind_error = |source| Error::Bind {
            address: addr.to_string(),
            source,
        };
        let (tls, authz) = match tls {
            Some(creds) => (Some(creds.config), creds.authz),
            None => (None, None),
        };
        let listener =
            Listener::bind(addr, Some(UNIX_SOCKET_MODE)).map_err(|e| bind_error(e.source))?;
        Self::serving(listener, exports, tls, authz).map_err(bind_error)
    }

    /// Serves on a listening socket a predecessor daemon handed over (bound, with TLS or
    /// without, as that daemon's was: the checks of `bind` were made when it was bound).
    pub fn from_listener(
        listener: Listener,
        exports: Arc<ExportRegistry>,
        tls: Option<TlsCreds>,
    ) -> Result<Self, Error> {
        let address = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let (tls, authz) = match tls {
            Some(creds) => (Some(creds.config), creds.authz),
            None => (None, None),
        };
        Self::serving(listener, exports, tls, authz)
            .map_err(|source| Error::Bind { address, source })
    }

    /// The listening socket, to hand over to a successor daemon.
    pub fn listener(&self) -> &Listener {
        &self.listener
    }

    fn serving(
        listener: Listener,
        exports: Arc<ExportRegistry>,
        tls: Option<Arc<rustls::ServerConfig>>,
        authz: Option<Arc<crate::AllowList>>,
    ) -> std::io::Result<Self> {
        let local_addr = match listener.local_addr()? {
            NbdAddress::Unix(path) => path.display().to_string(),
            NbdAddress::Tcp(host_port) => host_port,
        };
        let waker = listener.waker()?;
        Ok(NbdServer {
            listener,
            local_addr,
            settings: Arc::new(HandshakeSettings {
                registry: exports,
                tls,
                authz,
            }),
            config: ConnectionConfig::default(),
            gate: ConnectionGate::new(DEFAULT_CONNECTION_LIMITS),
            stop: StopHandle {
                state: Arc::new(StopState {
                    stopped: AtomicBool::new(false),
                    waker,
                }),
            },
        })
    }

    /// The socket path, or `ip:port` actually bound (useful after binding port 0).
    pub fn local_addr(&self) -> String {
        self.local_addr.clone()
    }

    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// How long a client may stall inside the handshake or a request (or leave replies
    /// unread) before it is disconnected; idle time between requests is not limited.
    /// Default 30 s.
    pub fn with_io_timeout(mut self, timeout: Duration) -> Self {
        self.config.io_timeout = timeout;
        self
    }

    /// Requests one connection keeps in flight on the device at most (its I/O queue's
    /// depth). Default 128.
    pub fn with_queue_depth(mut self, depth: usize) -> Self {
        self.config.queue_depth = depth.max(1);
        self
    }

    /// Payload bytes of the requests one connection may have under way (read, not yet
    /// answered) before it stops reading requests. Default 64 MiB.
    pub fn with_max_pending_bytes(mut self, bytes: u64) -> Self {
        self.config.max_pending_bytes = bytes;
        self
    }

    /// Connections served at once, in all and from one TCP peer address (Unix socket clients
    /// count towards the total only). A connection beyond them is closed at once, with a
    /// warning naming the peer and the limit; open connections are not affected. Default
    /// [`DEFAULT_CONNECTION_LIMITS`].
    pub fn with_connection_limits(mut self, limits: ConnectionLimits) -> Self {
        self.gate = ConnectionGate::new(limits);
        self
    }

    /// Serves clients, one thread per connection, until `StopHandle::stop`; then stops every
    /// connection gracefully, waits for them (in-flight requests answered, written devices
    /// flushed) and removes the Unix socket file.
    pub fn run(self) -> Result<(), Error> {
        let live: Arc<Mutex<HashMap<u64, Socket>>> = Arc::default();
        let next_id = AtomicU64::new(0);
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
        while !self.stop.is_stopped() {
            // TCP connections come with Nagle off: replies are single writes already.
            let accepted = self.listener.accept();
            if self.stop.is_stopped() {
                break;
            }
            let (socket, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    // Out of descriptors or memory: back off instead of spinning.
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            // Refused before any thread or buffer is spent on it; NBD has no way to say why
            // before the handshake, so the log says it.
            let permit = match self.gate.admit(socket.peer_ip()) {
                Ok(permit) => permit,
                Err(e) => {
                    tracing::warn!(peer = %peer, "refusing NBD connection from {peer}: {e}");
                    socket.shutdown(Shutdown::Both);
                    continue;
                }
            };
            let id = next_id.fetch_add(1, Ordering::Relaxed);
            match socket.try_clone() {
                Ok(handle) => {
                    lock(&live).insert(id, handle);
                }
                Err(e) => {
                    tracing::warn!("cannot track a new connection, dropping it: {e}");
                    continue;
                }
            }
            let settings = Arc::clone(&self.settings);
            let config = self.config;
            let live_for_thread = Arc::clone(&live);
            let spawned = std::thread::Builder::new()
                .name("nbd-conn".into())
                .spawn(move || {
                    handle_connection(socket, &peer, &settings, &config);
                    lock(&live_for_thread).remove(&id);
                    drop(permit);
                });
            match spawned {
                Ok(thread) => threads.push(thread),
                Err(e) => {
                    tracing::warn!("cannot start a connection thread: {e}");
                    lock(&live).remove(&id);
                }
            }
            threads.retain(|thread| !thread.is_finished());
        }
        for socket in lock(&live).values() {
            socket.shutdown(Shutdown::Read);
        }
        for thread in threads {
            // A panicking connection thread has already logged; the others still matter.
            let _ = thread.join();
        }
        Ok(())
    }
}

fn handle_connection(
    socket: Socket,
    peer: &str,
    settings: &HandshakeSettings,
    config: &ConnectionConfig,
) {
    if let Err(e) = socket.set_timeouts(Some(config.io_timeout)) {
        tracing::warn!("cannot set socket timeouts: {e}");
        return;
    }
    let result = match negotiate(socket, peer, settings) {
        Ok(Some(negotiated)) => serve(negotiated, config),
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        tracing::debug!("connection ended: {e}");
    }
}
