//! NBD URIs as QEMU and libnbd write them (the NBD project's doc/uri.md):
//! `nbd+unix:///EXPORT?socket=PATH` and `nbd://HOST[:PORT]/EXPORT`.
use crate::Error;
use std::fmt;
use std::path::PathBuf;

/// The default NBD TCP port.
pub const DEFAULT_PORT: u16 = 10809;

/// Where the server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    Unix(PathBuf),
    /// Host (without IPv6 brackets) and port.
    Tcp(String, u16),
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub transport: Transport,
    /// The export name (percent-decoded; may be empty: the server's default export).
    pub export: String,
}

impl NbdUri {
    pub fn parse(uri: &str) -> Result<NbdUri, Error> {
        let bad = |reason: &str| Error::Uri {
            uri: uri.to_string(),
            reason: reason.to_string(),
        };
        let (scheme, rest) = uri.split_once("://").ok_or_else(|| {
            bad("expected nbd+unix:///EXPORT?socket=PATH or nbd://HOST[:PORT]/EXPORT")
        })?;
        if scheme.starts_with("nbds") {
            return Err(bad(
                "TLS (nbds) is not supported by this client yet: use a UNIX socket or a trusted network",
            ));
        }
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let export = percent_decode(path).ok_or_else(|| bad("bad %-escape in the export name"))?;
        match scheme {
            "nbd+unix" => {
                if !authority.is_empty() {
                    return Err(bad(
                        "nbd+unix takes no host: nbd+unix:///EXPORT?socket=PATH",
                    ));
                }
                let socket = query
                    .into_iter()
                    .flat_map(|q| q.split('&'))
                    .find_map(|kv| kv.strip_prefix("socket="))
                    .ok_or_else(|| bad("nbd+unix needs ?socket=PATH"))?;
                let socket =
                    percent_decode(socket).ok_or_else(|| bad("bad %-escape in the socket path"))?;
                if socket.is_empty() {
                    return Err(bad("the socket path is empty"));
                }
                Ok(NbdUri {
                    transport: Transport::Unix(PathBuf::from(socket)),
                    export,
                })
            }
            "nbd" | "nbd+tcp" => {
                let (host, port) = split_host_port(authority)
                    .ok_or_else(|| bad("expected HOST, HOST:PORT or [IPV6]:PORT after nbd://"))?;
                Ok(NbdUri {
                    transport: Transport::Tcp(host, port),
                    export,
                })
            }
            _ => Err(bad("unknown scheme: use nbd:// or nbd+unix://")),
        }
    }
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.transport {
            Transport::Unix(p) => write!(f, "nbd+unix:///{}?socket={}", self.export, p.display()),
            Transport::Tcp(h, port) if h.contains(':') => {
                write!(f, "nbd://[{h}]:{port}/{}", self.export)
            }
            Transport::Tcp(h, port) => write!(f, "nbd://{h}:{port}/{}", self.export),
        }
    }
}

fn split_host_port(authority: &str) -> Option<(String, u16)> {
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return None;
    }
    let port = match port {
        Some(p) => p.parse().ok().filter(|&p| p != 0)?,
        None => DEFAULT_PORT,
    };
    Some((host.to_string(), port))
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_and_tcp_uris_parse_as_qemu_writes_them() {
        let u = NbdUri::parse("nbd+unix:///backup-1?socket=/run/x%20y.sock").unwrap();
        assert_eq!(u.transport, Transport::Unix("/run/x y.sock".into()));
        assert_eq!(u.export, "backup-1");
        let u = NbdUri::parse("nbd://example.org/disk%2F0").unwrap();
        assert_eq!(
            u.transport,
            Transport::Tcp("example.org".into(), DEFAULT_PORT)
        );
        assert_eq!(u.export, "disk/0");
        let u = NbdUri::parse("nbd://[::1]:10810/").unwrap();
        assert_eq!(u.transport, Transport::Tcp("::1".into(), 10810));
        assert_eq!(u.export, "");
        assert_eq!(u.to_string(), "nbd://[::1]:10810/");
    }

    #[test]
    fn unusable_uris_say_why() {
        for (uri, why) in [
            ("nbds://h/e", "TLS"),
            ("nbd+unix:///e", "socket="),
            ("nbd://h:0/e", "HOST"),
            ("nbd://:10809/e", "HOST"),
            ("/tmp/x", "expected"),
            ("http://h/e", "scheme"),
            ("nbd://h/%zz", "escape"),
        ] {
            let err = NbdUri::parse(uri).unwrap_err().to_string();
            assert!(err.contains(why), "{uri}: {err}");
        }
    }
}
