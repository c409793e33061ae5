//! The little HTTP/1.1 the metrics endpoint speaks: a request head is parsed (strictly, and
//! without ever panicking on what a client sends) into the answer it gets. Only `GET` and
//! `HEAD` of `/metrics` succeed; every response closes the connection, so request bodies and
//! pipelining never need handling.

/// Largest request head (request line and headers) accepted.
pub const MAX_HEAD: usize = 8192;

/// What a request head asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `GET /metrics` (`head_only` for `HEAD`).
    Metrics {
        head_only: bool,
    },
    NotFound,
    MethodNotAllowed,
    BadRequest,
    VersionNotSupported,
}

/// Where the head ends (the index just past its blank line), if it is complete.
pub fn head_end(buf: &[u8]) -> Option<usize> {
    let mut line_start = 0;
    for (i, &b) in buf.iter().enumerate() {
        if b == b'\n' {
            let line = &buf[line_start..i];
            if line.is_empty() || line == b"\r" {
                // A blank line before any request line is tolerated (RFC 9112 2.2) only when
                // something follows; at the very start it is just an empty line.
                if line_start > 0 {
                    return Some(i + 1);
                }
            }
            line_start = i + 1;
        }
    }
    None
}

/// Parses a complete request head (as found by [`head_end`]).
pub fn route(head: &[u8]) -> Route {
    let Ok(text) = std::str::from_utf8(head) else {
        return Route::BadRequest;
    };
    let mut lines = text
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .skip_while(|l| l.is_empty());
    let Some(request_line) = lines.next() else {
        return Route::BadRequest;
    };
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Route::BadRequest;
    };
    if method.is_empty() || !method.bytes().all(is_token_byte) || target.is_empty() {
        return Route::BadRequest;
    }
    let Some(minor) = version.strip_prefix("HTTP/1.") else {
        return match version.strip_prefix("HTTP/") {
            Some(v) if is_version_number(v) => Route::VersionNotSupported,
            _ => Route::BadRequest,
        };
    };
    if minor.len() != 1 || !minor.bytes().all(|b| b.is_ascii_digit()) {
        return Route::BadRequest;
    }
    let mut host = false;
    for line in lines {
        if line.is_empty() {
            break;
        }
        let Some((name, _value)) = line.split_once(':') else {
            return Route::BadRequest;
        };
        if name.is_empty() || !name.bytes().all(is_token_byte) {
            return Route::BadRequest;
        }
        if name.eq_ignore_ascii_case("host") {
            if host {
                return Route::BadRequest;
            }
            host = true;
        }
    }
    // HTTP/1.1 requires exactly one Host header (RFC 9112 3.2).
    if minor != "0" && !host {
        return Route::BadRequest;
    }
    let Some(path) = request_path(target) else {
        return Route::BadRequest;
    };
    if path != "/metrics" {
        return Route::NotFound;
    }
    match method {
        "GET" => Route::Metrics { head_only: false },
        "HEAD" => Route::Metrics { head_only: true },
        _ => Route::MethodNotAllowed,
    }
}

/// The path of an origin-form (`/metrics?x`) or absolute-form (`http://h:p/metrics`) target.
fn request_path(target: &str) -> Option<&str> {
    let path = if target.starts_with('/') {
        target
    } else {
        let rest = target
            .strip_prefix("http://")
            .or_else(|| target.strip_prefix("https://"))?;
        rest.find('/').map_or("/", |i| &rest[i..])
    };
    Some(path.split(['?', '#']).next().unwrap_or(path))
}

fn is_version_number(v: &str) -> bool {
    let (major, minor) = v.split_once('.').unwrap_or((v, "0"));
    !major.is_empty()
        && major.bytes().all(|b| b.is_ascii_digit())
        && minor.bytes().all(|b| b.is_ascii_digit())
}

/// RFC 9110 `tchar`.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A complete response that closes the connection.
pub fn response(
    status: &str,
    extra_headers: &str,
    content_type: &str,
    body: &[u8],
    head_only: bool,
) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{extra_headers}Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}

/// A plain-text error response.
pub fn error_response(status: &str, extra_headers: &str) -> Vec<u8> {
    response(
        status,
        extra_headers,
        "text/plain; charset=utf-8",
        format!("{status}\n").as_bytes(),
        false,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(text: &str) -> Route {
        let end = head_end(text.as_bytes()).expect("complete head");
        route(&text.as_bytes()[..end])
    }

    #[test]
    fn good_requests() {
        let get = Route::Metrics { head_only: false };
        assert_eq!(routed("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), get);
        assert_eq!(
            routed("GET /metrics?name[]=a HTTP/1.1\r\nhost: x\r\nAccept: */*\r\n\r\n"),
            get
        );
        assert_eq!(routed("GET /metrics HTTP/1.0\n\n"), get);
        assert_eq!(
            routed("\r\nGET http://h:9/metrics HTTP/1.1\r\nHost: h\r\n\r\n"),
            get
        );
        assert_eq!(
            routed("HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Route::Metrics { head_only: true }
        );
        assert_eq!(routed("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), Route::NotFound);
        assert_eq!(
            routed("GET /metricsx HTTP/1.1\r\nHost: x\r\n\r\n"),
            Route::NotFound
        );
        assert_eq!(
            routed("POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Route::MethodNotAllowed
        );
        assert_eq!(
            routed("GET /metrics HTTP/2.0\r\nHost: x\r\n\r\n"),
            Route::VersionNotSupported
        );
    }

    #[test]
    fn bad_requests() {
        for bad in [
            "GET /metrics\r\n\r\n",
            "GET  /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
            "GET /metrics HTTP/1.1 extra\r\nHost: x\r\n\r\n",
            "GET /metrics HTTP/1.1\r\n\r\n",
            "GET /metrics HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            "GET /metrics HTTP/1.1\r\nHost x\r\n\r\n",
            "GET /metrics HTTP/1.1\r\nBad Name: v\r\nHost: x\r\n\r\n",
            "GET /metrics HTTP/1.x\r\nHost: x\r\n\r\n",
            "GET /metrics HTTP/1.10\r\nHost: x\r\n\r\n",
            "GET /metrics FTP/1.1\r\nHost: x\r\n\r\n",
            "G(T /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
            "GET metrics HTTP/1.1\r\nHost: x\r\n\r\n",
            "GET ftp://h/metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        ] {
            assert_eq!(routed(bad), Route::BadRequest, "{bad:?}");
        }
        assert_eq!(
            route(b"GET /metrics HTTP/1.1\r\nHost: \xff\r\n\r\n"),
            Route::BadRequest
        );
        assert_eq!(route(b""), Route::BadRequest);
        assert_eq!(head_end(b"GET /metrics HTTP/1.1\r\nHost: x\r\n"), None);
        assert_eq!(head_end(b"\r\n"), None);
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A deterministic stream of mutations of a good request.
        let good = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let mut input = good.clone();
            for _ in 0..(next() % 6) {
                let pos = (next() as usize) % (input.len() + 1);
                match next() % 3 {
                    0 if pos < input.len() => input[pos] = next() as u8,
                    1 => input.insert(pos, next() as u8),
                    _ if pos < input.len() => {
                        input.remove(pos);
                    }
                    _ => {}
                }
            }
            if let Some(end) = head_end(&input) {
                let _ = route(&input[..end]);
            }
            let _ = route(&input);
        }
    }
}
