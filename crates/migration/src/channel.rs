//! The connections of a migration: TCP or Unix sockets, optionally under mutually
//! authenticated TLS, each split into a reader and a writer that two threads use at once (one
//! thread waits for the peer's frames while another sends).

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, Connection, ServerConfig, ServerConnection};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// How long a connecting peer may take to complete the TLS handshake and send its Hello
/// (the destination's side; the source's is `SourceOptions::connect_timeout`).
pub const ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a migration destination listens: `tcp:HOST:PORT` (or just `HOST:PORT`) or
/// `unix:PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigrationAddress {
    Tcp(String),
    Unix(PathBuf),
}

impl std::str::FromStr for MigrationAddress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path".into());
            }
            return Ok(MigrationAddress::Unix(PathBuf::from(path)));
        }
        let hostport = s.strip_prefix("tcp:").unwrap_or(s);
        match hostport.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                Ok(MigrationAddress::Tcp(hostport.to_string()))
            }
            _ => Err(format!(
                "'{s}' is not a migration address: use tcp:HOST:PORT or unix:PATH"
            )),
        }
    }
}

impl std::fmt::Display for MigrationAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MigrationAddress::Tcp(hp) => write!(f, "tcp:{hp}"),
            MigrationAddress::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl MigrationAddress {
    /// The name a TLS client expects in the server's certificate: the host (an IP address or
    /// a DNS name), or `localhost` for a Unix socket.
    fn server_name(&self) -> io::Result<ServerName<'static>> {
        let host = match self {
            MigrationAddress::Tcp(hp) => {
                let host = hp.rsplit_once(':').map_or(hp.as_str(), |(h, _)| h);
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string()
            }
            MigrationAddress::Unix(_) => "localhost".to_string(),
        };
        ServerName::try_from(host.clone()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("'{host}' cannot be checked against a certificate: {e}"),
            )
        })
    }
}

/// A connected socket of either family.
#[derive(Debug)]
enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    fn try_clone(&self) -> io::Result<Socket> {
        Ok(match self {
            Socket::Tcp(s) => Socket::Tcp(s.try_clone()?),
            Socket::Unix(s) => Socket::Unix(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        let _ = match self {
            Socket::Tcp(s) => s.shutdown(Shutdown::Both),
            Socket::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    /// Read and write timeouts of the socket (shared by every clone of it).
    fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Socket::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
    }
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.read(buf),
            Socket::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write(buf),
            Socket::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Closes a channel from any thread: a reader blocked on it returns at once.
#[derive(Debug, Clone)]
pub struct Closer(Arc<Socket>);

impl Closer {
    pub fn close(&self) {
        self.0.shutdown();
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

/// Runs the TLS handshake on `socket`, whose timeouts bound it, and splits the connection.
fn split_tls(mut socket: Socket, conn: impl Into<Connection>, peer: String) -> io::Result<Channel> {
    let mut conn: Connection = conn.into();
    while conn.is_handshaking() {
        conn.complete_io(&mut socket).map_err(|e| {
            let what = if is_timeout(&e) {
                "timed out".to_string()
            } else {
                e.to_string()
            };
            io::Error::new(
                e.kind(),
                format!("TLS handshake with {peer} failed: {what}"),
            )
        })?;
    }
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
    let socket = match addr {
        MigrationAddress::Tcp(hp) => {
            let mut last = None;
            let mut found = None;
            for a in hp.to_socket_addrs()? {
                match TcpStream::connect_timeout(&a, timeout) {
                    Ok(s) => {
                        found = Some(s);
                        break;
                    }
                    Err(e) => last = Some(e),
                }
            }
            let s = found.ok_or_else(|| {
                last.unwrap_or_else(|| io::Error::other(format!("{hp} resolves to nothing")))
            })?;
            s.set_nodelay(true)?;
            Socket::Tcp(s)
        }
        MigrationAddress::Unix(p) => Socket::Unix(UnixStream::connect(p)?),
    };
    socket.set_timeouts(Some(timeout))?;
    let peer = addr.to_string();
    match tls {
        None => split_plain(socket, peer),
        Some(config) => {
            let conn = ClientConnection::new(config.clone(), addr.server_name()?)
                .map_err(io::Error::other)?;
            split_tls(socket, conn, peer)
        }
    }
}

/// A destination's listening socket.
#[derive(Debug)]
pub struct MigrationListener {
    inner: ListenerKind,
    tls: Option<Arc<ServerConfig>>,
}

#[derive(Debug)]
enum ListenerKind {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
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
    pub fn establish(self) -> io::Result<Channel> {
        self.socket.set_timeouts(Some(ACCEPT_TIMEOUT))?;
        match self.tls {
            None => split_plain(self.socket, self.peer),
            Some(config) => {
                let mut config = (*config).clone();
                // Tickets are for resuming sessions, which migration channels never do; not
                // sending them keeps the connection quiet after the handshake.
                config.send_tls13_tickets = 0;
                let conn = ServerConnection::new(Arc::new(config)).map_err(io::Error::other)?;
                split_tls(self.socket, conn, self.peer)
            }
        }
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Drops the connection without a handshake.
    pub fn refuse(self) {
        self.socket.shutdown();
    }
}

impl MigrationListener {
    pub fn bind(addr: &MigrationAddress, tls: Option<Arc<ServerConfig>>) -> io::Result<Self> {
        let inner = match addr {
            MigrationAddress::Tcp(hp) => ListenerKind::Tcp(TcpListener::bind(hp.as_str())?),
            MigrationAddress::Unix(p) => ListenerKind::Unix(bind_unix(p)?, p.clone()),
        };
        Ok(MigrationListener { inner, tls })
    }

    /// The address actually bound (a TCP port of 0 resolved).
    pub fn local_addr(&self) -> io::Result<MigrationAddress> {
        Ok(match &self.inner {
            ListenerKind::Tcp(l) => MigrationAddress::Tcp(l.local_addr()?.to_string()),
            ListenerKind::Unix(_, p) => MigrationAddress::Unix(p.clone()),
        })
    }

    pub fn accept(&self) -> io::Result<Incoming> {
        let (socket, peer) = match &self.inner {
            ListenerKind::Tcp(l) => {
                let (s, a) = l.accept()?;
                s.set_nodelay(true)?;
                (Socket::Tcp(s), a.to_string())
            }
            ListenerKind::Unix(l, p) => {
                let (s, _) = l.accept()?;
                (Socket::Unix(s), format!("unix:{}", p.display()))
            }
        };
        Ok(Incoming {
            socket,
            tls: self.tls.clone(),
            peer,
        })
    }

    /// Wakes a thread blocked in `accept` (it gets an error or a dead connection) so that it
    /// can see it should stop. The listener is unusable afterwards.
    pub fn shutdown(&self) {
        // SAFETY: shutdown(2) on a descriptor we own; it only changes the socket's state.
        unsafe {
            libc::shutdown(self.raw_fd(), libc::SHUT_RDWR);
        }
    }

    fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match &self.inner {
            ListenerKind::Tcp(l) => l.as_raw_fd(),
            ListenerKind::Unix(l, _) => l.as_raw_fd(),
        }
    }
}

impl Drop for MigrationListener {
    fn drop(&mut self) {
        if let ListenerKind::Unix(_, p) = &self.inner {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Binds a Unix socket, replacing a stale socket file but never any other kind of file.
fn bind_unix(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    UnixListener::bind(path)
}
