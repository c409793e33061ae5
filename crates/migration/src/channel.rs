//! The connections of a migration: TCP or Unix sockets, optionally under mutually
//! authenticated TLS, each split into a reader and a writer that two threads use at once (one
//! thread waits for the peer's frames while another sends).
//!
//! A destination's listener admits a bounded number of connections ([`ListenOptions`]), gives
//! each a bounded time to finish its TLS handshake and Hello, and with TLS can pin the name
//! the source's certificate must carry; the source can pin the name the destination's
//! certificate must carry ([`connect`]'s `server_name`).

use cryptblk_net::tls::{complete_handshake, AllowList};
use cryptblk_net::{ConnectionGate, ConnectionLimits, Listener, ListenerWaker, Stream};
use rustls::{ClientConfig, ClientConnection, Connection, ServerConfig, ServerConnection};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// How long a connecting peer may take to complete the TLS handshake and send its Hello
/// (the destination's side; the source's is `SourceOptions::connect_timeout`).
pub const ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a frame may stall once its first byte has arrived, and a write to the peer may
/// block, after the Hello. Time *between* frames is not bounded: a source legitimately says
/// nothing while it waits for the switchover.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(60);

/// Connections a destination's listener serves at once unless told otherwise: a migration
/// uses one or two (bulk, urgent) plus a resume now and then.
pub const DEFAULT_LIMITS: ConnectionLimits = ConnectionLimits {
    total: 8,
    per_peer: 4,
};

/// How a destination's listener admits peers.
#[derive(Debug, Clone)]
pub struct ListenOptions {
    /// Every channel is TLS, and the source must present a certificate the CA signed.
    pub tls: Option<Arc<ServerConfig>>,
    /// With `tls`: the source's certificate must also carry one of these names (subject CN or
    /// DNS subjectAltName), or the connection is refused after the TLS handshake.
    pub peer_names: Option<AllowList>,
    /// From connect to the end of the source's Hello, TLS handshake included.
    pub hello_timeout: Duration,
    /// See [`FRAME_TIMEOUT`].
    pub frame_timeout: Duration,
    pub limits: ConnectionLimits,
    /// The destination tells a source that waits for it when it serves the disk
    /// ([`IncomingMigration::ready`](crate::IncomingMigration::ready)), and that source's
    /// switchover waits for it. Off: the source switches over when asked, whatever this side
    /// is doing (for a user that serves the disk before any source connects).
    pub announces_ready: bool,
}

impl Default for ListenOptions {
    fn default() -> Self {
        ListenOptions {
            tls: None,
            peer_names: None,
            hello_timeout: ACCEPT_TIMEOUT,
            frame_timeout: FRAME_TIMEOUT,
            limits: DEFAULT_LIMITS,
            announces_ready: false,
        }
    }
}

impl ListenOptions {
    /// TLS with the defaults for everything else.
    pub fn tls(tls: Option<Arc<ServerConfig>>) -> Self {
        ListenOptions {
            tls,
            ..Default::default()
        }
    }
}

/// Where a migration destination listens: `tcp:HOST:PORT` (or just `HOST:PORT`) or
/// `unix:PATH` — the address type every cryptblk socket uses.
pub use cryptblk_net::Address as MigrationAddress;

type Socket = Stream;

/// Closes a channel from any thread: a reader blocked on it returns at once.
#[derive(Debug, Clone)]
pub struct Closer(Arc<Socket>);

impl Closer {
    pub fn close(&self) {
        self.0.shutdown(Shutdown::Both);
    }
}

/// One established connection, split.
pub struct Channel {
    pub reader: Box<dyn Read + Send>,
    pub writer: Box<dyn Write + Send>,
    pub closer: Closer,
    /// Who is on the other end, for messages.
    pub peer: String,
}

/// A reader that holds an accepted connection's slot under the listener's limits: the reader
/// lives as long as the connection is served.
struct PermitReader {
    inner: Box<dyn Read + Send>,
    _permit: cryptblk_net::ConnectionPermit,
}

impl Read for PermitReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf)
    }
}

impl Channel {
    /// Bounds every read and write of the connection (`None`: no bound). Set while the
    /// connection is being set up (handshakes), cleared once it carries the migration.
    pub fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        self.closer.0.set_timeouts(t)
    }
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel").field("peer", &self.peer).finish()
    }
}

fn split_plain(socket: Socket, peer: String) -> io::Result<Channel> {
    let reader = socket.try_clone()?;
    let closer = Closer(Arc::new(socket.try_clone()?));
    Ok(Channel {
        reader: Box::new(reader),
        writer: Box::new(socket),
        closer,
        peer,
    })
}

/// The TLS state both halves share. Lock order: `write_socket`, then `conn`; the socket is
/// written outside `conn`'s lock so that a writer blocked on a full socket never stops the
/// reader from taking in the peer's data.
struct TlsShared {
    conn: Mutex<Connection>,
    write_socket: Mutex<Socket>,
}

impl TlsShared {
    /// Sends whatever TLS records the connection has queued. Caller holds `write_socket`.
    fn send_pending(&self, socket: &mut Socket) -> io::Result<()> {
        let mut out = Vec::new();
        {
            let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
            while conn.wants_write() {
                conn.write_tls(&mut out)?;
            }
        }
        socket.write_all(&out)
    }
}

struct TlsReader {
    shared: Arc<TlsShared>,
    socket: Socket,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Read for TlsReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        loop {
            let (fed, wants_write) = {
                let mut conn = self
                    .shared
                    .conn
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                match conn.reader().read(out) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                if self.start == self.end {
                    (false, false)
                } else {
                    let mut pending = &self.buf[self.start..self.end];
                    let n = conn.read_tls(&mut pending)?;
                    if n == 0 {
                        return Err(io::Error::other("TLS receive buffer stuck"));
                    }
                    self.start += n;
                    conn.process_new_packets()
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                    (true, conn.wants_write())
                }
            };
            if wants_write {
                let mut socket = self
                    .shared
                    .write_socket
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                self.shared.send_pending(&mut socket)?;
            }
            if self.start != self.end || fed {
                // Fed the connection: look for plaintext again before reading more.
                continue;
            }
            let n = self.socket.read(&mut self.buf)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the TLS connection without close_notify",
                ));
            }
            self.start = 0;
            self.end = n;
        }
    }
}

struct TlsWriter {
    shared: Arc<TlsShared>,
}

impl Write for TlsWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut socket = self
            .shared
            .write_socket
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // rustls takes only as much plaintext as its send buffer holds; hand it a record's
        // worth at a time and send that before taking more.
        let n = self
            .shared
            .conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .writer()
            .write(&buf[..buf.len().min(16 << 10)])?;
        self.shared.send_pending(&mut socket)?;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Splits a TLS connection whose handshake is done (see `complete_handshake`).
fn split_tls(mut socket: Socket, conn: impl Into<Connection>, peer: String) -> io::Result<Channel> {
    let mut conn: Connection = conn.into();
    while conn.wants_write() {
        conn.write_tls(&mut socket)?;
    }
    let closer = Closer(Arc::new(socket.try_clone()?));
    let reader_socket = socket.try_clone()?;
    let shared = Arc::new(TlsShared {
        conn: Mutex::new(conn),
        write_socket: Mutex::new(socket),
    });
    Ok(Channel {
        reader: Box::new(TlsReader {
            shared: shared.clone(),
            socket: reader_socket,
            buf: vec![0u8; 64 << 10].into_boxed_slice(),
            start: 0,
            end: 0,
        }),
        writer: Box::new(TlsWriter { shared }),
        closer,
        peer,
    })
}

/// Connects to a destination, with TLS when `tls` is given (verifying the destination's
/// certificate against `server_name`, or the address's host without one, and presenting
/// ours). `timeout` bounds the TCP connect and every read and write of the connection, the
/// TLS handshake included, until [`Channel::set_timeouts`] changes it.
pub fn connect(
    addr: &MigrationAddress,
    tls: Option<&Arc<ClientConfig>>,
    server_name: Option<&str>,
    timeout: Duration,
) -> io::Result<Channel> {
    let mut socket = cryptblk_net::connect(addr, timeout)?;
    socket.set_timeouts(Some(timeout))?;
    let peer = addr.to_string();
    match tls {
        None => split_plain(socket, peer),
        Some(config) => {
            let name = match server_name {
                Some(name) => {
                    rustls::pki_types::ServerName::try_from(name.to_owned()).map_err(|e| {
                        io::Error::new(
                            io::ErrorKind::InvalidInput,
                            format!(
                                "peer name '{name}' cannot be checked against a certificate: {e}"
                            ),
                        )
                    })?
                }
                None => cryptblk_net::tls::server_name(addr)?,
            };
            let mut conn = ClientConnection::new(config.clone(), name).map_err(io::Error::other)?;
            complete_handshake(&mut conn, &mut socket, &peer)?;
            split_tls(socket, conn, peer)
        }
    }
}

/// A destination's listening socket.
#[derive(Debug)]
pub struct MigrationListener {
    listener: Listener,
    waker: ListenerWaker,
    options: Arc<ListenOptions>,
    gate: ConnectionGate,
}

/// An accepted connection whose TLS handshake (if any) has not run yet; `establish` it on
/// its own thread so a slow or hostile peer cannot hold up the listener.
#[derive(Debug)]
pub struct Incoming {
    socket: Socket,
    options: Arc<ListenOptions>,
    peer: String,
    /// Its slot under the listener's connection limits, freed when the connection is gone.
    permit: cryptblk_net::ConnectionPermit,
}

impl Incoming {
    /// Runs the TLS handshake (if any) and checks the source's certificate name (if pinned).
    /// Reads and writes stay bounded by the hello timeout until [`Channel::set_timeouts`]
    /// changes it, so that a peer that connects and stays silent cannot hold the connection's
    /// thread. The channel keeps the connection's slot under the listener's limits.
    pub fn establish(mut self) -> io::Result<Channel> {
        self.socket.set_timeouts(Some(self.options.hello_timeout))?;
        let permit = self.permit;
        let mut ch = match &self.options.tls {
            None => split_plain(self.socket, self.peer)?,
            Some(config) => {
                let mut config = ServerConfig::clone(config);
                // Tickets are for resuming sessions, which migration channels never do; not
                // sending them keeps the connection quiet after the handshake.
                config.send_tls13_tickets = 0;
                let mut conn = ServerConnection::new(Arc::new(config)).map_err(io::Error::other)?;
                complete_handshake(&mut conn, &mut self.socket, &self.peer)?;
                let refusal = match &self.options.peer_names {
                    Some(names) => names.check(conn.peer_certificates()).err(),
                    None => None,
                };
                let mut ch = split_tls(self.socket, conn, self.peer)?;
                if let Some(why) = refusal {
                    // Said over the authenticated channel, so the source can report it
                    // instead of a bare hang-up.
                    let _ = crate::wire::write_frame(
                        &mut ch.writer,
                        &crate::wire::Frame::Error {
                            message: "this destination accepts another source (its peer-name \
                                      does not match your certificate)"
                                .into(),
                        },
                    );
                    ch.closer.close();
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!("not the pinned migration peer: {why}"),
                    ));
                }
                ch
            }
        };
        ch.reader = Box::new(PermitReader {
            inner: ch.reader,
            _permit: permit,
        });
        Ok(ch)
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Drops the connection without a handshake.
    pub fn refuse(self) {
        self.socket.shutdown(Shutdown::Both);
    }
}

impl MigrationListener {
    /// Binds `addr` (a stale Unix socket there is replaced; a live one or another file is
    /// refused).
    pub fn bind(addr: &MigrationAddress, options: ListenOptions) -> io::Result<Self> {
        if options.peer_names.is_some() && options.tls.is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a pinned peer name needs TLS: only a certificate can prove it",
            ));
        }
        let listener = Listener::bind(addr, None)
            .map_err(|e| io::Error::new(e.source.kind(), format!("{e}: {}", e.source)))?;
        let waker = listener.waker()?;
        Ok(MigrationListener {
            listener,
            waker,
            gate: ConnectionGate::new(options.limits),
            options: Arc::new(options),
        })
    }

    /// See [`ListenOptions::frame_timeout`].
    pub fn frame_timeout(&self) -> Duration {
        self.options.frame_timeout
    }

    /// The address actually bound (a TCP port of 0 resolved).
    pub fn local_addr(&self) -> io::Result<MigrationAddress> {
        self.listener.local_addr()
    }

    /// The next connection within the listener's limits; those beyond them are closed at
    /// once with a warning naming the peer and the limit.
    pub fn accept(&self) -> io::Result<Incoming> {
        loop {
            let (socket, peer) = self.listener.accept()?;
            match self.gate.admit(socket.peer_ip()) {
                Ok(permit) => {
                    return Ok(Incoming {
                        socket,
                        options: self.options.clone(),
                        peer,
                        permit,
                    })
                }
                Err(e) => {
                    tracing::warn!(%peer, "refusing a migration connection from {peer}: {e}");
                    socket.shutdown(Shutdown::Both);
                }
            }
        }
    }

    /// Wakes a thread blocked in `accept` (it gets an error or a dead connection) so that it
    /// can see it should stop. The listener is unusable afterwards.
    pub fn shutdown(&self) {
        self.waker.wake();
    }
}
