//! Listening on an address.
//!
//! A waiting `accept` is woken through a pipe of the listener's own, never by shutting the
//! socket down: the listening socket may be shared with a successor daemon that took it over
//! (`hand_over`), which must go on accepting on it.
use crate::unix_socket::{bind_private, remove_if_ours, FileId, SocketFile};
use crate::{Address, Stream};
use rustix::event::{PollFd, PollFlags};
use std::io::{self, Write};
use std::net::TcpListener;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Why an address could not be bound; the message names the address.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {address}")]
pub struct BindError {
    pub address: Address,
    #[source]
    pub source: io::Error,
}

/// A bound listening socket. A Unix socket's file is removed when it drops, unless it was
/// handed over to a successor.
#[derive(Debug)]
pub struct Listener {
    inner: Inner,
    wake: Arc<Wake>,
}

#[derive(Debug)]
enum Inner {
    Unix(UnixListener, PathBuf, FileId),
    Tcp(TcpListener),
}

#[derive(Debug)]
struct Wake {
    /// Readable once `wake` was called.
    rx: UnixStream,
    tx: UnixStream,
    handed_over: AtomicBool,
}

/// A listening socket on its way to a successor daemon: the descriptor, the address it is
/// bound to and, for a Unix socket, its file's identity (`Listener::from_inherited`).
#[derive(Debug)]
pub struct ListeningSocket {
    pub fd: std::os::fd::OwnedFd,
    pub address: Address,
    pub file: Option<FileId>,
}

impl ListeningSocket {
    pub fn into_listener(self) -> io::Result<Listener> {
        Listener::from_inherited(self.fd, &self.address, self.file)
    }
}

/// Wakes a thread blocked in [`Listener::accept`] from another thread: the accept fails with
/// `Interrupted` so that the thread can see it should stop.
#[derive(Debug, Clone)]
pub struct ListenerWaker(Arc<Wake>);

impl ListenerWaker {
    pub fn wake(&self) {
        let _ = (&self.0.tx).write(&[1]);
    }

    /// The socket now belongs to a successor daemon: its file stays when the listener drops.
    pub fn hand_over(&self) {
        self.0.handed_over.store(true, Ordering::SeqCst);
    }
}

impl Listener {
    /// Binds `address`. A Unix socket path that holds a stale socket (nobody listening) is
    /// replaced; a live socket or any other kind of file is refused. `unix_mode` sets the
    /// socket file's permissions (e.g. 0o660 to let a group connect; default 0600), applied
    /// before the file appears at its path (`unix_socket`).
    pub fn bind(address: &Address, unix_mode: Option<u32>) -> Result<Listener, BindError> {
        let error = |source| BindError {
            address: address.clone(),
            source,
        };
        let inner = match address {
            Address::Unix(path) => {
                let file = SocketFile::with_mode(unix_mode.unwrap_or(0o600));
                let (listener, id) = bind_private(path, &file).map_err(|e| error(e.into_io()))?;
                Inner::Unix(listener, path.clone(), id)
            }
            Address::Tcp(hp) => Inner::Tcp(TcpListener::bind(hp.as_str()).map_err(error)?),
        };
        Self::with_inner(inner).map_err(error)
    }

    /// A listening socket a predecessor daemon handed over, bound at `address` (for a Unix
    /// socket, `file` names the socket file it created there).
    pub fn from_inherited(
        fd: std::os::fd::OwnedFd,
        address: &Address,
        file: Option<FileId>,
    ) -> io::Result<Listener> {
        let inner = match (address, file) {
            (Address::Unix(path), Some(id)) => {
                Inner::Unix(UnixListener::from(fd), path.clone(), id)
            }
            (Address::Tcp(_), None) => Inner::Tcp(TcpListener::from(fd)),
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a Unix socket needs its file's identity, a TCP one none",
                ))
            }
        };
        Self::with_inner(inner)
    }

    fn with_inner(inner: Inner) -> io::Result<Listener> {
        // Polled first; a connection that vanishes between the poll and the accept must not
        // block the thread where it no longer sees a wake-up. (Accepted sockets do not
        // inherit O_NONBLOCK on Linux.)
        match &inner {
            Inner::Unix(l, _, _) => l.set_nonblocking(true)?,
            Inner::Tcp(l) => l.set_nonblocking(true)?,
        }
        let (rx, tx) = UnixStream::pair()?;
        rx.set_nonblocking(true)?;
        tx.set_nonblocking(true)?;
        Ok(Listener {
            inner,
            wake: Arc::new(Wake {
                rx,
                tx,
                handed_over: AtomicBool::new(false),
            }),
        })
    }

    /// The address actually bound (a TCP port 0 resolved).
    pub fn local_addr(&self) -> io::Result<Address> {
        Ok(match &self.inner {
            Inner::Tcp(l) => Address::Tcp(l.local_addr()?.to_string()),
            Inner::Unix(_, p, _) => Address::Unix(p.clone()),
        })
    }

    /// The socket file's identity (a Unix socket), for a successor taking the listener over.
    pub fn file_id(&self) -> Option<FileId> {
        match &self.inner {
            Inner::Unix(_, _, id) => Some(*id),
            Inner::Tcp(_) => None,
        }
    }

    /// A copy of the listening socket with its address, to hand over to a successor daemon
    /// (taken before the listener moves to its serving thread).
    pub fn handover_copy(&self) -> io::Result<ListeningSocket> {
        Ok(ListeningSocket {
            fd: self.socket_fd().try_clone_to_owned()?,
            address: self.local_addr()?,
            file: self.file_id(),
        })
    }

    /// The listening socket.
    pub fn socket_fd(&self) -> BorrowedFd<'_> {
        match &self.inner {
            Inner::Unix(l, _, _) => l.as_fd(),
            Inner::Tcp(l) => l.as_fd(),
        }
    }

    /// Waits for a connection; returns it and who is on the other end (for messages). After
    /// [`ListenerWaker::wake`], fails with `Interrupted` (every call from then on).
    pub fn accept(&self) -> io::Result<(Stream, String)> {
        loop {
            let mut fds = [
                PollFd::from_borrowed_fd(self.socket_fd(), PollFlags::IN),
                PollFd::new(&self.wake.rx, PollFlags::IN),
            ];
            match rustix::event::poll(&mut fds, None) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let (listening, woken) = (!fds[0].revents().is_empty(), !fds[1].revents().is_empty());
            if woken {
                // The byte is never read, so later calls return at once too.
                return Err(io::Error::new(
                    io::ErrorKind::Interrupted,
                    "the listener was asked to stop",
                ));
            }
            if listening {
                match self.accept_now() {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    accepted => return accepted,
                }
            }
        }
    }

    fn accept_now(&self) -> io::Result<(Stream, String)> {
        match &self.inner {
            Inner::Tcp(l) => {
                let (s, peer) = l.accept()?;
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                Ok((Stream::Tcp(s), peer.to_string()))
            }
            Inner::Unix(l, p, _) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                Ok((Stream::Unix(s), format!("unix:{}", p.display())))
            }
        }
    }

    /// A handle that wakes `accept` from another thread.
    pub fn waker(&self) -> io::Result<ListenerWaker> {
        Ok(ListenerWaker(self.wake.clone()))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Inner::Unix(_, p, id) = &self.inner {
            if !self.wake.handed_over.load(Ordering::SeqCst) {
                remove_if_ours(p, *id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::fs::PermissionsExt;
    use std::time::Duration;

    #[test]
    fn unix_and_tcp_round_trip_and_socket_files_are_handled_with_care() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let unix = Address::Unix(path.clone());
        for address in [unix.clone(), "tcp:127.0.0.1:0".parse().unwrap()] {
            let listener = Listener::bind(&address, Some(0o660)).unwrap();
            let bound = listener.local_addr().unwrap();
            let client = std::thread::spawn(move || {
                let mut s = crate::connect(&bound, Duration::from_secs(5)).unwrap();
                s.write_all(b"ping").unwrap();
            });
            let (mut s, _peer) = listener.accept().unwrap();
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf).unwrap();
            assert_eq!(&buf, b"ping");
            client.join().unwrap();
            if address == unix {
                let mode = std::fs::metadata(&path).unwrap().permissions().mode();
                assert_eq!(mode & 0o777, 0o660);
                // A live socket is not replaced.
                let err = Listener::bind(&unix, None).unwrap_err();
                assert_eq!(err.source.kind(), io::ErrorKind::AddrInUse);
            }
        }
        assert!(!path.exists(), "the socket file goes with its listener");

        // A stale socket is replaced; a regular file never is.
        let stale = UnixListener::bind(&path).unwrap();
        drop(stale);
        assert!(path.exists());
        drop(Listener::bind(&unix, None).unwrap());
        std::fs::write(&path, b"data").unwrap();
        let err = Listener::bind(&unix, None).unwrap_err();
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"data");
    }

    #[test]
    fn a_waker_ends_a_blocked_accept() {
        let listener = Listener::bind(&"tcp:127.0.0.1:0".parse().unwrap(), None).unwrap();
        let waker = listener.waker().unwrap();
        let t = std::thread::spawn(move || listener.accept().map(|_| ()));
        std::thread::sleep(Duration::from_millis(50));
        waker.wake();
        // Either an error or a dead connection, but it returns.
        let _ = t.join().unwrap();
    }
}
