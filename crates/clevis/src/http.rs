//! The one HTTP request the tang pin makes: `POST {url}/rec/{kid}` with a JWK body, over plain
//! HTTP/1.1 on a `TcpStream`, bounded by one deadline for connect, send and answer. Tang's
//! exchange is blinded, so plain HTTP leaks nothing (as clevis uses it); `https://` is refused.
use crate::error::{Result, TokenError};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The largest answer read: a JWK is a few hundred bytes.
const MAX_REPLY_BYTES: usize = 64 * 1024;

/// A parsed `http://host[:port][/path]` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HttpUrl {
    /// `host:port` as connected to and sent in `Host:` (brackets kept for IPv6).
    pub authority: String,
    /// The path prefix without a trailing `/` (empty for the root).
    pub path: String,
}

impl HttpUrl {
    pub fn parse(url: &str) -> Result<HttpUrl> {
        let bad = |reason: &str| TokenError::BadUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let Some(rest) = url.strip_prefix("http://") else {
            return Err(bad(if url.starts_with("https://") {
                "https is not supported: cryptblk speaks plain HTTP to tang (the exchange is blinded), bind with an http:// URL"
            } else {
                "not an http:// URL"
            }));
        };
        let (host, path) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
        if host.is_empty() || host.contains('@') || host.chars().any(char::is_whitespace) {
            return Err(bad("no usable host"));
        }
        if path.contains(['?', '#']) || path.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("a query, fragment or space in the path"));
        }
        // A port follows the last ':' unless that ':' is inside an IPv6 literal.
        let has_port = host.rfind(':').is_some_and(|i| !host[i..].contains(']'));
        let authority = if has_port {
            host.to_owned()
        } else {
            format!("{host}:80")
        };
        Ok(HttpUrl {
            authority,
            path: path.trim_end_matches('/').to_owned(),
        })
    }
}

/// An HTTP answer: its status code and body.
#[derive(Debug)]
pub(crate) struct Reply {
    pub status: u16,
    /// The status line, for messages.
    pub status_line: String,
    pub body: Vec<u8>,
}

/// POSTs `body` to `url` + `path` and returns the answer, whatever its status.
pub(crate) fn post(
    url: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<Reply> {
    let parsed = HttpUrl::parse(url)?;
    let unreachable = |reason: String| TokenError::Unreachable {
        url: url.to_owned(),
        reason,
    };
    let deadline = Instant::now() + timeout;
    let remaining = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| unreachable(format!("no answer within {timeout:?}")))
    };
    let addrs = parsed
        .authority
        .to_socket_addrs()
        .map_err(|e| unreachable(format!("cannot resolve {}: {e}", parsed.authority)))?;
    let mut last = None;
    let mut stream = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, remaining()?) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(format!("connecting to {addr}: {e}")),
        }
    }
    let mut stream =
        stream.ok_or_else(|| unreachable(last.unwrap_or_else(|| "no address".into())))?;
    let io = |e: std::io::Error| {
        if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            unreachable(format!("no answer within {timeout:?}"))
        } else {
            unreachable(e.to_string())
        }
    };
    let mut request = format!(
        "POST {}{path} HTTP/1.1\r\nHost: {}\r\nContent-Type: {content_type}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        parsed.path,
        parsed.authority,
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    stream.set_write_timeout(Some(remaining()?)).map_err(io)?;
    stream.write_all(&request).map_err(io)?;
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        stream.set_read_timeout(Some(remaining()?)).map_err(io)?;
        let n = stream.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&buf[..n]);
        if reply.len() > MAX_REPLY_BYTES {
            return Err(refused(
                url,
                format!("an answer over {MAX_REPLY_BYTES} bytes"),
            ));
        }
        if complete(&reply) {
            break;
        }
    }
    parse_reply(url, &reply)
}

fn refused(url: &str, reason: String) -> TokenError {
    TokenError::Refused {
        url: url.to_owned(),
        reason,
    }
}

/// The end of the head, and the Content-Length it declares, if both are there yet.
fn head_and_length(reply: &[u8]) -> Option<(usize, Option<usize>)> {
    let end = reply.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&reply[..end]).ok()?;
    let length = head.lines().skip(1).find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| value.trim().parse().ok())?
    });
    Some((end, length))
}

/// True once the whole body a Content-Length announces has arrived.
fn complete(reply: &[u8]) -> bool {
    matches!(head_and_length(reply), Some((end, Some(len))) if reply.len() >= end + len)
}

fn parse_reply(url: &str, reply: &[u8]) -> Result<Reply> {
    let (end, length) =
        head_and_length(reply).ok_or_else(|| refused(url, "not an HTTP answer".into()))?;
    let head = String::from_utf8_lossy(&reply[..end]);
    let status = head.lines().next().unwrap_or_default();
    let code = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok());
    let (true, Some(code)) = (status.starts_with("HTTP/1."), code) else {
        return Err(refused(url, "not an HTTP answer".into()));
    };
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Err(refused(
            url,
            "a chunked answer (tangd sends a Content-Length)".into(),
        ));
    }
    let body = &reply[end..];
    let body = match length {
        Some(len) if body.len() < len => {
            return Err(refused(url, "the answer was cut short".into()))
        }
        Some(len) => body[..len].to_vec(),
        None => body.to_vec(),
    };
    Ok(Reply {
        status: code,
        status_line: status.trim().to_owned(),
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn urls_parse_and_https_is_refused_clearly() {
        let u = HttpUrl::parse("http://127.0.0.1:8080/tang/").unwrap();
        assert_eq!(
            (u.authority.as_str(), u.path.as_str()),
            ("127.0.0.1:8080", "/tang")
        );
        let u = HttpUrl::parse("http://[::1]").unwrap();
        assert_eq!((u.authority.as_str(), u.path.as_str()), ("[::1]:80", ""));
        let e = HttpUrl::parse("https://tang.example")
            .unwrap_err()
            .to_string();
        assert!(e.contains("https is not supported"), "{e}");
        assert!(HttpUrl::parse("ftp://x").is_err());
        assert!(HttpUrl::parse("http://").is_err());
        assert!(HttpUrl::parse("http://a b/").is_err());
    }

    #[test]
    fn a_server_that_never_answers_times_out_with_a_clear_error() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let start = Instant::now();
        let e = post(
            &url,
            "/rec/x",
            "application/jwk+json",
            b"{}",
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(e.is_unreachable(), "{e}");
        let text = e.to_string();
        assert!(
            text.contains(&url) && text.contains("no answer within"),
            "{text}"
        );
        drop(listener);
    }

    #[test]
    fn the_status_and_body_are_returned() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).unwrap();
            s.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nabcdef")
                .unwrap();
        });
        let reply = post(
            &url,
            "/rec/x",
            "application/jwk+json",
            b"{}",
            Duration::from_secs(5),
        )
        .unwrap();
        server.join().unwrap();
        assert_eq!(
            (reply.status, reply.status_line.as_str()),
            (404, "HTTP/1.1 404 Not Found")
        );
        assert_eq!(reply.body, b"abc");
    }

    #[test]
    fn a_closed_port_is_unreachable() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}");
        let e = post(
            &url,
            "/rec/x",
            "application/jwk+json",
            b"{}",
            Duration::from_secs(5),
        )
        .unwrap_err();
        assert!(e.is_unreachable(), "{e}");
    }
}
