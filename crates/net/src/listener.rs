//! Listening on an address.
use crate::unix_socket::{bind_private, remove_if_ours, FileId, SocketFile};
use crate::{Address, Stream};
use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

/// Why an address could not be bound; the message names the address.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {address}")]
pub struct BindError {
    pub address: Address,
    #[source]
    pub source: io::Error,
}

/// A bound listening socket. A Unix socket's file is removed when it drops.
#[derive(Debug)]
pub struct Listener {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Unix(UnixListener, PathBuf, FileId),
    Tcp(TcpListener),
}

/// Wakes a thread blocked in [`Listener::accept`] from another thread: the accept fails (or
/// returns a dead connection) so that the thread can see it should stop. Works even when the
/// socket file is gone.
#[derive(Debug)]
pub struct ListenerWaker(Stream);

impl ListenerWaker {
    pub fn wake(&self) {
        // shutdown(2) on a listening socket makes a blocked accept() return (Linux); the
        // stream type is only what std offers for calling it on the duplicated descriptor.
        self.0.shutdown(Shutdown::Both);
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
        Ok(Listener { inner })
    }

    /// The address actually bound (a TCP port 0 resolved).
    pub fn local_addr(&self) -> io::Result<Address> {
        Ok(match &self.inner {
            Inner::Tcp(l) => Address::Tcp(l.local_addr()?.to_string()),
            Inner::Unix(_, p, _) => Address::Unix(p.clone()),
        })
    }

    /// Waits for a connection; returns it and who is on the other end (for messages).
    pub fn accept(&self) -> io::Result<(Stream, String)> {
        match &self.inner {
            Inner::Tcp(l) => {
                let (s, peer) = l.accept()?;
                s.set_nodelay(true)?;
                Ok((Stream::Tcp(s), peer.to_string()))
            }
            Inner::Unix(l, p, _) => {
                let (s, _) = l.accept()?;
                Ok((Stream::Unix(s), format!("unix:{}", p.display())))
            }
        }
    }

    /// A handle that wakes `accept` from another thread.
    pub fn waker(&self) -> io::Result<ListenerWaker> {
        Ok(ListenerWaker(match &self.inner {
            Inner::Tcp(l) => Stream::Tcp(TcpStream::from(OwnedFd::from(l.try_clone()?))),
            Inner::Unix(l, _, _) => Stream::Unix(UnixStream::from(OwnedFd::from(l.try_clone()?))),
        }))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Inner::Unix(_, p, id) = &self.inner {
            remove_if_ours(p, *id);
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
