//! `serve --metrics ADDR`: a deliberately small HTTP/1.1 responder for Prometheus' scrapes.
//! `GET /metrics` gets the text exposition format; any other path 404, any other method 405,
//! anything that is not an HTTP request line 400. One connection at a time on one thread (a
//! scrape takes well under a millisecond), each answered and closed; a request head is read
//! up to 8 KiB with a 5-second timeout, so a slow or hostile client holds the thread for
//! seconds at most and never makes it allocate more.
use crate::registry::Daemon;
use cryptblk_net::{Address, Listener, ListenerWaker, Stream};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const MAX_HEAD: usize = 8 * 1024;
const TIMEOUT: Duration = Duration::from_secs(5);

/// The answer to one request head: status line and body.
pub(crate) fn respond(head: &[u8], metrics: impl FnOnce() -> String) -> (&'static str, String) {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return ("400 Bad Request", "not an HTTP request\n".into());
    };
    if !version.starts_with("HTTP/1.") || method.is_empty() || !target.starts_with('/') {
        return ("400 Bad Request", "not an HTTP request\n".into());
    }
    // The query string (e.g. Prometheus' ?name[]=...) does not change the answer.
    let path = target.split('?').next().unwrap_or(target);
    if path != "/metrics" {
        return ("404 Not Found", "only /metrics is served here\n".into());
    }
    if method != "GET" && method != "HEAD" {
        return ("405 Method Not Allowed", "use GET\n".into());
    }
    ("200 OK", metrics())
}

/// Serves scrapes until stopped.
pub struct MetricsServer {
    listener: Listener,
    daemon: Arc<Daemon>,
    stop: Arc<AtomicBool>,
}

/// Stops a running [`MetricsServer`] from another thread.
pub struct MetricsStop {
    stop: Arc<AtomicBool>,
    waker: ListenerWaker,
}

impl MetricsStop {
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.waker.wake();
    }
}

impl MetricsServer {
    pub fn bind(address: &Address, daemon: Arc<Daemon>) -> std::io::Result<MetricsServer> {
        let listener = Listener::bind(address, None).map_err(std::io::Error::other)?;
        Ok(MetricsServer {
            listener,
            daemon,
            stop: Arc::default(),
        })
    }

    pub fn local_addr(&self) -> std::io::Result<Address> {
        self.listener.local_addr()
    }

    pub fn stop_handle(&self) -> std::io::Result<MetricsStop> {
        Ok(MetricsStop {
            stop: self.stop.clone(),
            waker: self.listener.waker()?,
        })
    }

    pub fn run(self) {
        while !self.stop.load(Ordering::SeqCst) {
            match self.listener.accept() {
                Ok((stream, _peer)) if !self.stop.load(Ordering::SeqCst) => {
                    if let Err(e) = self.answer(stream) {
                        tracing::debug!("metrics: {e}");
                    }
                }
                Ok(_) => break,
                Err(e) if self.stop.load(Ordering::SeqCst) => {
                    let _ = e;
                    break;
                }
                Err(e) => {
                    tracing::warn!("metrics: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    fn answer(&self, mut stream: Stream) -> std::io::Result<()> {
        stream.set_timeouts(Some(TIMEOUT))?;
        let mut head = Vec::with_capacity(1024);
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
            let n = stream.read(&mut buf)?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
            if head.len() > MAX_HEAD {
                let _ = reply(
                    &mut stream,
                    "431 Request Header Fields Too Large",
                    "request head over 8 KiB\n",
                    false,
                );
                return Ok(());
            }
        }
        let is_head = head.starts_with(b"HEAD ");
        let (status, body) = respond(&head, || self.daemon.metrics());
        reply(&mut stream, status, &body, is_head)
    }
}

fn reply(stream: &mut Stream, status: &str, body: &str, head_only: bool) -> std::io::Result<()> {
    let content_type = if status.starts_with("200") {
        "text/plain; version=0.0.4; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    let header = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(header.as_bytes())?;
    if !head_only {
        stream.write_all(body.as_bytes())?;
    }
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_their_answers() {
        let m = || "m 1\n".to_string();
        assert_eq!(
            respond(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", m).0,
            "200 OK"
        );
        assert_eq!(respond(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n", m).1, "m 1\n");
        assert_eq!(respond(b"GET / HTTP/1.1\r\n\r\n", m).0, "404 Not Found");
        assert_eq!(
            respond(b"POST /metrics HTTP/1.1\r\n\r\n", m).0,
            "405 Method Not Allowed"
        );
        for bad in [
            &b""[..],
            b"\xff\xfe",
            b"GET /metrics\r\n\r\n",
            b"GET metrics HTTP/1.1\r\n",
            b"GET /metrics SPDY/3 x\r\n",
            b"GET  /metrics HTTP/1.1\r\n",
        ] {
            assert_eq!(respond(bad, m).0, "400 Bad Request", "{bad:?}");
        }
    }
}
