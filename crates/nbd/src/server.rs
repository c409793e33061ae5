//! The listener: accepts clients on a Unix or TCP socket and runs each connection on its own
//! thread until told to stop.

use crate::export::ExportRegistry;
use crate::handshake::{negotiate, HandshakeSettings};
use crate::socket::Socket;
use crate::transmission::{serve, ConnectionConfig};
use crate::{Error, NbdAddress, TlsCreds};
use cryptblk_net::{Listener, ListenerWaker};
use std::collections::HashMap;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// Group read/write: a VM manager running as another user in the group can connect.
const UNIX_SOCKET_MODE: u32 = 0o660;

/// A bound NBD server; `run` serves it.
pub struct NbdServer {
    listener: Listener,
    local_addr: String,
    settings: Arc<HandshakeSettings>,
    config: ConnectionConfig,
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
    /// Binds `addr`. With `tls`, every client must upgrade with NBD_OPT_STARTTLS before it
    /// can do anything but abort.
    pub fn bind(
        addr: &NbdAddress,
        exports: Arc<ExportRegistry>,
        tls: Option<TlsCreds>,
    ) -> Result<Self, Error> {
        let bind_error = |source| Error::Bind {
            address: addr.to_string(),
            source,
        };
        let listener =
            Listener::bind(addr, Some(UNIX_SOCKET_MODE)).map_err(|e| bind_error(e.source))?;
        let local_addr = match listener.local_addr().map_err(bind_error)? {
            NbdAddress::Unix(path) => path.display().to_string(),
            NbdAddress::Tcp(host_port) => host_port,
        };
        let waker = listener.waker().map_err(bind_error)?;
        Ok(NbdServer {
            listener,
            local_addr,
            settings: Arc::new(HandshakeSettings {
                registry: exports,
                tls: tls.map(|creds| creds.config),
            }),
            config: ConnectionConfig::default(),
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

    /// Payload bytes one connection may have in flight before it stops reading requests.
    /// Default 64 MiB.
    pub fn with_max_in_flight_bytes(mut self, bytes: u64) -> Self {
        self.config.max_in_flight_bytes = bytes;
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
            let accepted = self.listener.accept().map(|(socket, _)| socket);
            if self.stop.is_stopped() {
                break;
            }
            let socket = match accepted {
                Ok(socket) => socket,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    // Out of descriptors or memory: back off instead of spinning.
                    std::thread::sleep(Duration::from_millis(50));
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
                    handle_connection(socket, &settings, &config);
                    lock(&live_for_thread).remove(&id);
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

fn handle_connection(socket: Socket, settings: &HandshakeSettings, config: &ConnectionConfig) {
    if let Err(e) = socket.set_timeouts(Some(config.io_timeout)) {
        tracing::warn!("cannot set socket timeouts: {e}");
        return;
    }
    let result = match negotiate(socket, settings) {
        Ok(Some(negotiated)) => serve(negotiated, config),
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        tracing::debug!("connection ended: {e}");
    }
}
