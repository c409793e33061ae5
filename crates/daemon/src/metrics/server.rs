//! The metrics listener: one accepting thread, and a thread per connection up to
//! [`LIMITS`]: [`LIMITS`]`.total` in all and `per_peer` from one TCP address (more are
//! answered 503 at once), so idle connections from one peer never lock a scraper out. A
//! connection gets [`REQUEST_TIMEOUT`] in all to send a head of at most [`MAX_HEAD`] bytes, is
//! answered once, and is closed, so a slow or hostile client holds one thread and 8 KiB for at
//! most that long.
use super::http::{error_response, head_end, response, route, Route, MAX_HEAD};
use crate::registry::Daemon;
use cryptblk_net::{
    Address, BindError, ConnectionGate, ConnectionLimits, Listener, ListenerWaker, Stream,
};
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Connections served at once, in all and from one TCP peer address.
pub const LIMITS: ConnectionLimits = ConnectionLimits {
    total: 16,
    per_peer: 4,
};
/// Time a client has to send its request head.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a client has to take the response.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// A bound metrics endpoint; [`run`](MetricsServer::run) serves it.
pub struct MetricsServer {
    listener: Listener,
    daemon: Arc<Daemon>,
    stopping: Arc<AtomicBool>,
    gate: ConnectionGate,
}

/// Ends [`MetricsServer::run`] from another thread.
#[derive(Clone)]
pub struct MetricsStop {
    stopping: Arc<AtomicBool>,
    waker: ListenerWaker,
}

impl MetricsStop {
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.waker.wake();
    }

    /// As `stop`, when a successor daemon took the listening socket over (its file stays).
    pub fn hand_over(&self) {
        self.waker.hand_over();
        self.stop();
    }
}

impl MetricsServer {
    /// Binds `address` (a Unix socket file gets the umask's mode: metrics hold no secret).
    pub fn bind(address: &Address, daemon: Arc<Daemon>) -> Result<MetricsServer, BindError> {
        Ok(Self::on(Listener::bind(address, None)?, daemon))
    }

    /// Serves on `listener` (bound here, or handed over by a predecessor daemon).
    pub fn on(listener: Listener, daemon: Arc<Daemon>) -> MetricsServer {
        MetricsServer {
            listener,
            daemon,
            stopping: Arc::default(),
            gate: ConnectionGate::new(LIMITS),
        }
    }

    pub fn listener(&self) -> &Listener {
        &self.listener
    }

    /// The address bound (a TCP port 0 resolved).
    pub fn local_addr(&self) -> io::Result<Address> {
        self.listener.local_addr()
    }

    pub fn stop_handle(&self) -> io::Result<MetricsStop> {
        Ok(MetricsStop {
            stopping: self.stopping.clone(),
            waker: self.listener.waker()?,
        })
    }

    /// Accepts and answers until stopped. Connection threads still running then end by
    /// their own timeouts.
    pub fn run(self) -> io::Result<()> {
        loop {
            let accepted = self.listener.accept();
            if self.stopping.load(Ordering::SeqCst) {
                return Ok(());
            }
            let (stream, peer) = match accepted {
                Ok(accepted) => accepted,
                // A client that gave up before being accepted, or a descriptor limit: the
                // next accept may well succeed.
                Err(e) => {
                    tracing::warn!("metrics: accepting a connection: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            let permit = match self.gate.admit(stream.peer_ip()) {
                Ok(permit) => permit,
                Err(e) => {
                    tracing::debug!(%peer, "metrics: refusing a connection: {e}");
                    let mut stream = stream;
                    let _ = stream.set_timeouts(Some(Duration::from_millis(100)));
                    let _ = stream.write_all(&error_response("503 Service Unavailable", ""));
                    stream.shutdown(std::net::Shutdown::Write);
                    continue;
                }
            };
            let daemon = self.daemon.clone();
            // A failed spawn drops the closure, and the permit with it.
            let _ = std::thread::Builder::new()
                .name("metrics-conn".into())
                .spawn(move || {
                    let _ = answer(stream, REQUEST_TIMEOUT, || daemon.render_metrics());
                    drop(permit);
                });
        }
    }
}

/// Reads one request head within `timeout` (in all, however slowly it trickles in) and
/// answers it, with `render()` for the metrics page.
fn answer(
    mut stream: Stream,
    timeout: Duration,
    render: impl FnOnce() -> String,
) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; MAX_HEAD];
    let mut len = 0;
    let head = loop {
        if let Some(end) = head_end(&buf[..len]) {
            break end;
        }
        if len == buf.len() {
            return reply(
                &mut stream,
                &error_response("431 Request Header Fields Too Large", ""),
            );
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return reply(&mut stream, &error_response("408 Request Timeout", ""));
        }
        stream.set_timeouts(Some(left))?;
        match stream.read(&mut buf[len..]) {
            Ok(0) => return Ok(()),
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return reply(&mut stream, &error_response("408 Request Timeout", ""));
            }
            Err(e) => return Err(e),
        }
    };
    let out = match route(&buf[..head]) {
        Route::Metrics { head_only } => {
            let body = render();
            response(
                "200 OK",
                "",
                super::exposition::CONTENT_TYPE,
                body.as_bytes(),
                head_only,
            )
        }
        Route::NotFound => error_response("404 Not Found", ""),
        Route::MethodNotAllowed => error_response("405 Method Not Allowed", "Allow: GET, HEAD\r\n"),
        Route::BadRequest => error_response("400 Bad Request", ""),
        Route::VersionNotSupported => error_response("505 HTTP Version Not Supported", ""),
    };
    reply(&mut stream, &out)
}

fn reply(stream: &mut Stream, bytes: &[u8]) -> io::Result<()> {
    stream.set_timeouts(Some(WRITE_TIMEOUT))?;
    stream.write_all(bytes)?;
    stream.flush()?;
    stream.shutdown(std::net::Shutdown::Write);
    // Take what the client still sends (a body we ignore) until it closes, briefly and
    // boundedly: closing with unread data would reset the connection and could destroy the
    // response before the client has read it.
    stream.set_timeouts(Some(Duration::from_secs(1)))?;
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < 64 * 1024 {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn serve_one(timeout: Duration) -> (UnixStream, std::thread::JoinHandle<io::Result<()>>) {
        let (client, server) = UnixStream::pair().unwrap();
        let thread = std::thread::spawn(move || {
            answer(Stream::Unix(server), timeout, || "m 1\n".to_string())
        });
        (client, thread)
    }

    fn response_of(mut client: UnixStream) -> String {
        let mut text = String::new();
        client.read_to_string(&mut text).unwrap();
        text
    }

    #[test]
    fn a_trickling_client_is_cut_off_at_the_deadline() {
        let (mut client, thread) = serve_one(Duration::from_millis(300));
        let start = Instant::now();
        // One byte every 50 ms never completes a head; each read alone would be in time.
        for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" {
            if client.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
            if start.elapsed() > Duration::from_millis(600) {
                break;
            }
        }
        client.shutdown(std::net::Shutdown::Write).unwrap();
        thread.join().unwrap().unwrap();
        assert!(start.elapsed() < Duration::from_millis(1500));
        assert!(response_of(client).starts_with("HTTP/1.1 408 Request Timeout\r\n"));
    }

    #[test]
    fn a_complete_request_is_answered_and_closed() {
        let (mut client, thread) = serve_one(Duration::from_secs(5));
        client
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        let text = response_of(client);
        thread.join().unwrap().unwrap();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(
            text.contains("Content-Length: 4\r\n") && text.ends_with("\r\n\r\nm 1\n"),
            "{text}"
        );
    }
}
