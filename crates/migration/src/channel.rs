//! The connections of a migration: TCP or Unix sockets, optionally under mutually
//! authenticated TLS, each split into a reader and a writer that two threads use at once (one
//! thread waits for the peer's frames while another sends).

use cryptblk_net::tls::complete_handshake;
use cryptblk_net::{Listener, ListenerWaker, Stream};
use rustls::{ClientConfig, ClientConnection, Connection, ServerConfig, ServerConnection};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// How long a connecting peer may take to complete the TLS handshake and send its Hello
/// (the destination's side; the source's is `SourceOptions::connect_timeout`).
pub const ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);

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

/// Whether an I/O error is a socket timeout firing.
pub fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// One established connection, split.
pub struct Channel {
    pub reader: Box<dyn Read + Send>,
    pub writer: Box<dyn Write + Send>,
    pub closer: Closer,
    /// Who is on the other end, for messages.
    pub peer: String,
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
/// certificate against the address's host and presenting ours). `timeout` bounds the TCP
/// connect and every read and write of the connection, the TLS handshake included, until
/// [`Channel::set_timeouts`] changes it.
pub fn connect(
    addr: &MigrationAddress,
    tls: Option<&Arc<ClientConfig>>,
    timeout: Duration,
) -> io::Result<Channel> {
    let mut socket = cryptblk_net::connect(addr, timeout)?;
    socket.set_timeouts(Some(timeout))?;
    let peer = addr.to_string();
    match tls {
        None => split_plain(socket, peer),
        Some(config) => {
            let mut conn =
                ClientConnection::new(config.clone(), cryptblk_net::tls::server_name(addr)?)
                    .map_err(io::Error::other)?;
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
    tls: Option<Arc<ServerConfig>>,
}

/// An accepted connection whose TLS handshake (if any) has not run yet; `establish` it on
/// its own thread so a slow or hostile peer cannot hold up the listener.
#[derive(Debug)]
pub struct Incoming {
    socket: Socket,
    tls: Option<Arc<ServerConfig>>,
    peer: String,
}

impl Incoming {
    /// Runs the TLS handshake (if any). Reads and writes stay bounded by [`ACCEPT_TIMEOUT`]
    /// until [`Channel::set_timeouts`] lifts it, so that a peer that connects and stays silent
    /// cannot hold the connection's thread.
    pub fn establish(mut self) -> io::Result<Channel> {
        self.socket.set_timeouts(Some(ACCEPT_TIMEOUT))?;
        match self.tls {
            None => split_plain(self.socket, self.peer),
            Some(config) => {
                let mut config = (*config).clone();
                // Tickets are for resuming sessions, which migration channels never do; not
                // sending them keeps the connection quiet after the handshake.
                config.send_tls13_tickets = 0;
                let mut conn = ServerConnection::new(Arc::new(config)).map_err(io::Error::other)?;
                complete_handshake(&mut conn, &mut self.socket, &self.peer)?;
                split_tls(self.socket, conn, self.peer)
            }
        }
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
    pub fn bind(addr: &MigrationAddress, tls: Option<Arc<ServerConfig>>) -> io::Result<Self> {
        let listener = Listener::bind(addr, None)
            .map_err(|e| io::Error::new(e.source.kind(), format!("{e}: {}", e.source)))?;
        let waker = listener.waker()?;
        Ok(MigrationListener {
            listener,
            waker,
            tls,
        })
    }

    /// The address actually bound (a TCP port of 0 resolved).
    pub fn local_addr(&self) -> io::Result<MigrationAddress> {
        self.listener.local_addr()
    }

    pub fn accept(&self) -> io::Result<Incoming> {
        let (socket, peer) = self.listener.accept()?;
        Ok(Incoming {
            socket,
            tls: self.tls.clone(),
            peer,
        })
    }

    /// Wakes a thread blocked in `accept` (it gets an error or a dead connection) so that it
    /// can see it should stop. The listener is unusable afterwards.
    pub fn shutdown(&self) {
        self.waker.wake();
    }
}
