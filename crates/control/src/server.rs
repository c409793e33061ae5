//! The server: one listening socket, one thread per client connection.
//!
//! A thread per client (rather than an event loop) because handlers are ordinary blocking code
//! (unlocking a LUKS keyslot takes a second or more of argon2) and the number of control
//! clients is small; a slow request then delays only its own connection, while each
//! connection stays strictly sequential, so its responses come back in request order.
use crate::error::Error;
use crate::fds::FdReader;
use crate::protocol::{self, Handler, MAX_LINE};
use crate::rpc_error::RpcError;
use crate::socket::{self, FileId};
use rustix::event::{poll, PollFd, PollFlags};
use rustix::io::Errno;
use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// A client that stops reading its responses must not pin a connection thread (and so
/// [`ControlServer::run`]'s shutdown) forever; after this long a blocked write gives up.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// The stop request, seen by the server, its stop handles and its connection threads.
struct StopSignal {
    stopping: AtomicBool,
    /// The socket belongs to a successor daemon: its file stays at its path.
    handed_over: AtomicBool,
    /// Writing a byte here wakes the accept loop out of `poll`; non-blocking, so `stop` never
    /// blocks even if the buffer is already full of earlier wake-ups.
    wake: UnixStream,
}

impl StopSignal {
    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }
}

/// Stops a running [`ControlServer`] from any thread (e.g. a signal-handling one).
#[derive(Clone)]
pub struct StopHandle {
    stop: Arc<StopSignal>,
}

impl StopHandle {
    /// Asks the server to stop: it stops accepting, removes its socket file, lets requests
    /// already being handled finish and send their responses, then `run` returns. Requests
    /// read after this get [`crate::SERVER_SHUTTING_DOWN`]. Does not wait; idempotent.
    pub fn stop(&self) {
        self.stop.stopping.store(true, Ordering::SeqCst);
        let _ = (&self.stop.wake).write(&[1]);
    }

    /// As `stop`, for a daemon handing its control socket to a successor that took the
    /// listener over: the socket file stays where it is.
    pub fn hand_over(&self) {
        self.stop.handed_over.store(true, Ordering::SeqCst);
        self.stop();
    }
}

impl std::fmt::Debug for StopHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopHandle")
            .field("stopping", &self.stop.stopping())
            .finish()
    }
}

/// A bound control socket. Nothing is served until [`ControlServer::run`]; dropping it
/// without running removes the socket file.
pub struct ControlServer {
    path: PathBuf,
    /// `None` once closed, so cleanup is idempotent between `run` and `Drop`.
    listener: Option<UnixListener>,
    file: FileId,
    handler: Arc<dyn Handler>,
    stop: Arc<StopSignal>,
    wake_rx: UnixStream,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl ControlServer {
    /// Creates the socket at `path` with mode 0600 (never more open, even briefly: see the
    /// `socket` module), listening at once so clients may connect before `run` starts.
    /// A stale socket file (nobody accepting) is replaced; a live one is an
    /// [`Error::InUse`], anything that is not a socket an [`Error::NotASocket`].
    pub fn bind(path: &Path, handler: Arc<dyn Handler>) -> Result<ControlServer, Error> {
        // Absolute, so removing the file at shutdown does not depend on the working
        // directory at that time.
        let path = std::path::absolute(path).map_err(|e| Error::Io {
            what: "cannot resolve",
            path: path.to_owned(),
            source: e,
        })?;
        let (listener, file) = socket::bind_private(&path)?;
        Self::serving(path, listener, file, handler)
    }

    /// Serves on a control socket a predecessor daemon handed over: `file` names the socket
    /// file it created at `path` (absolute), which stays where it is.
    pub fn from_listener(
        path: PathBuf,
        listener: UnixListener,
        file: FileId,
        handler: Arc<dyn Handler>,
    ) -> Result<ControlServer, Error> {
        Self::serving(path, listener, file, handler)
    }

    /// The listening socket and its file's identity, to hand over to a successor daemon.
    pub fn listener(&self) -> Option<(&UnixListener, FileId)> {
        self.listener.as_ref().map(|l| (l, self.file))
    }

    fn serving(
        path: PathBuf,
        listener: UnixListener,
        file: FileId,
        handler: Arc<dyn Handler>,
    ) -> Result<ControlServer, Error> {
        let io = |what, source| Error::Io {
            what,
            path: path.clone(),
            source,
        };
        // Non-blocking so a connection that vanishes between poll and accept cannot block
        // the loop where it no longer sees stop requests.
        listener
            .set_nonblocking(true)
            .map_err(|e| io("cannot configure", e))?;
        let (wake, wake_rx) = UnixStream::pair().map_err(|e| io("cannot set up", e))?;
        wake.set_nonblocking(true)
            .map_err(|e| io("cannot configure", e))?;
        wake_rx
            .set_nonblocking(true)
            .map_err(|e| io("cannot configure", e))?;
        Ok(ControlServer {
            path,
            listener: Some(listener),
            file,
            handler,
            stop: Arc::new(StopSignal {
                stopping: AtomicBool::new(false),
                handed_over: AtomicBool::new(false),
                wake,
            }),
            wake_rx,
        })
    }

    /// The absolute socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn stop_handle(&self) -> StopHandle {
        StopHandle {
            stop: self.stop.clone(),
        }
    }

    /// Serves clients until [`StopHandle::stop`], then shuts down as described there and
    /// returns. Each client gets its own thread. A handler call that never returns keeps
    /// `run` from returning: stop waits for requests in progress by design.
    pub fn run(mut self) -> Result<(), Error> {
        // Read halves of the live connections, so stop can wake threads idle in `read`.
        let connections: Arc<Mutex<HashMap<u64, UnixStream>>> = Arc::default();
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
        let result = self.accept_loop(&connections, &mut threads);
        // Whether stopped or failed: stop accepting first so new clients fail fast with
        // "not running" instead of queueing on a listener nobody will accept from.
        self.close();
        self.stop.stopping.store(true, Ordering::SeqCst);
        for stream in connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
        {
            // A thread blocked waiting for its next request sees end-of-file; one running a
            // handler finishes it and still writes its response (the write half stays open).
            let _ = stream.shutdown(Shutdown::Read);
        }
        for thread in threads {
            let _ = thread.join();
        }
        result
    }

    fn accept_loop(
        &self,
        connections: &Arc<Mutex<HashMap<u64, UnixStream>>>,
        threads: &mut Vec<JoinHandle<()>>,
    ) -> Result<(), Error> {
        let Some(listener) = &self.listener else {
            return Ok(());
        };
        let mut next_id = 0u64;
        while !self.stop.stopping() {
            let mut fds = [
                PollFd::new(listener, PollFlags::IN),
                PollFd::new(&self.wake_rx, PollFlags::IN),
            ];
            match poll(&mut fds, None) {
                Ok(_) => {}
                Err(Errno::INTR) => continue,
                Err(e) => {
                    return Err(Error::Io {
                        what: "cannot wait for clients on",
                        path: self.path.clone(),
                        source: e.into(),
                    })
                }
            }
            if !fds[1].revents().is_empty() {
                // Drain wake-ups; the flag, checked by the loop condition, is what counts.
                let mut buf = [0u8; 64];
                while matches!(io::Read::read(&mut &self.wake_rx, &mut buf), Ok(n) if n > 0) {}
            }
            if fds[0].revents().is_empty() {
                continue;
            }
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) => match e.kind() {
                    ErrorKind::WouldBlock
                    | ErrorKind::Interrupted
                    | ErrorKind::ConnectionAborted => continue,
                    _ => {
                        // E.g. out of file descriptors: keep serving the clients we have and
                        // retry shortly rather than spinning or giving up on the daemon.
                        tracing::warn!("control socket {}: accept: {e}", self.path.display());
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                },
            };
            threads.retain(|t| !t.is_finished());
            next_id += 1;
            self.spawn_connection(next_id, stream, connections, threads);
        }
        Ok(())
    }

    fn spawn_connection(
        &self,
        id: u64,
        stream: UnixStream,
        connections: &Arc<Mutex<HashMap<u64, UnixStream>>>,
        threads: &mut Vec<JoinHandle<()>>,
    ) {
        // Some systems let accepted sockets inherit O_NONBLOCK from the listener.
        if stream.set_nonblocking(false).is_err()
            || stream.set_write_timeout(Some(WRITE_TIMEOUT)).is_err()
        {
            return;
        }
        let Ok(control) = stream.try_clone() else {
            return;
        };
        connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, control);
        let handler = self.handler.clone();
        let stop = self.stop.clone();
        let registry = connections.clone();
        let spawned = std::thread::Builder::new()
            .name("control-client".into())
            .spawn(move || {
                serve_connection(stream, &*handler, &stop);
                registry
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&id);
            });
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(e) => {
                tracing::warn!("control socket: cannot start a client thread: {e}");
                connections
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&id);
            }
        }
    }

    /// Closes the listener and removes the socket file, if it is still the one we created.
    fn close(&mut self) {
        if self.listener.take().is_some()
            && !self.stop.handed_over.load(Ordering::SeqCst)
            && FileId::of(&self.path) == Some(self.file)
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.close();
    }
}

enum LineRead {
    /// A line, and how many bytes of the stream it took (newline included).
    Line(usize),
    TooLong,
    Eof,
}

/// Reads one line into `buf` (newline and a preceding `\r` stripped) without ever buffering
/// more than `cap + 1` bytes of it.
fn read_line_capped(
    reader: &mut impl BufRead,
    buf: &mut Vec<u8>,
    cap: usize,
) -> io::Result<LineRead> {
    buf.clear();
    let n = Read::take(&mut *reader, cap as u64 + 1).read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(LineRead::Eof);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        return Ok(LineRead::Line(n));
    }
    if buf.len() > cap {
        return Ok(LineRead::TooLong);
    }
    // The client closed after a last line without a newline: still a request.
    Ok(LineRead::Line(n))
}

fn serve_connection(stream: UnixStream, handler: &dyn Handler, stop: &StopSignal) {
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(FdReader::new(stream));
    let mut line = Vec::new();
    let shutting_down = |_: &str, _| Err(RpcError::shutting_down());
    // Bytes of the stream consumed so far, which tells the descriptors of this line from
    // those of the next (see the `fds` module).
    let mut consumed = 0u64;
    loop {
        let read = read_line_capped(&mut reader, &mut line, MAX_LINE);
        let mut fds = match read {
            Ok(LineRead::Line(n)) => {
                consumed += n as u64;
                reader.get_mut().take_until(consumed)
            }
            _ => Default::default(),
        };
        let response = match read {
            Ok(LineRead::Line(_)) if line.iter().all(u8::is_ascii_whitespace) => continue,
            Ok(LineRead::Line(_)) if stop.stopping() => {
                protocol::process_line(&shutting_down, &line, &mut fds)
            }
            Ok(LineRead::Line(_)) => protocol::process_line(handler, &line, &mut fds),
            Ok(LineRead::TooLong) => {
                // Without reading the rest we cannot find where the next request starts, and
                // reading it is what the cap exists to avoid: answer, then hang up.
                let error =
                    RpcError::invalid_request(format!("request line longer than {MAX_LINE} bytes"));
                let response = protocol::error_response(serde_json::Value::Null, error);
                let _ = write_line(&mut writer, &response.to_string());
                return;
            }
            Ok(LineRead::Eof) | Err(_) => return,
        };
        if let Some(response) = response {
            if write_line(&mut writer, &response).is_err() {
                return;
            }
        }
    }
}

fn write_line(writer: &mut UnixStream, response: &str) -> io::Result<()> {
    // One write per response so a client never sees half a line followed by a stall.
    let mut bytes = Vec::with_capacity(response.len() + 1);
    bytes.extend_from_slice(response.as_bytes());
    bytes.push(b'\n');
    writer.write_all(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capped_lines() {
        let data = b"abc\r\n\nxyzw\nlast";
        let mut reader = BufReader::new(&data[..]);
        let mut buf = Vec::new();
        assert!(matches!(
            read_line_capped(&mut reader, &mut buf, 4),
            Ok(LineRead::Line(_))
        ));
        assert_eq!(buf, b"abc");
        assert!(matches!(
            read_line_capped(&mut reader, &mut buf, 4),
            Ok(LineRead::Line(_))
        ));
        assert_eq!(buf, b"");
        assert!(matches!(
            read_line_capped(&mut reader, &mut buf, 4),
            Ok(LineRead::Line(_))
        ));
        assert_eq!(buf, b"xyzw");
        assert!(matches!(
            read_line_capped(&mut reader, &mut buf, 4),
            Ok(LineRead::Line(_))
        ));
        assert_eq!(buf, b"last");
        assert!(matches!(
            read_line_capped(&mut reader, &mut buf, 4),
            Ok(LineRead::Eof)
        ));
        let mut reader = BufReader::new(&b"abcde\n"[..]);
        assert!(matches!(
            read_line_capped(&mut reader, &mut buf, 4),
            Ok(LineRead::TooLong)
        ));
    }
}
