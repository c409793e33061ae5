//! Where a server listens, as users write it on a command line.

use crate::Error;
use std::path::PathBuf;
use std::str::FromStr;

/// A listening address: `unix:/path/to/socket` or `tcp:HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdAddress {
    Unix(PathBuf),
    /// `host:port` as accepted by `TcpListener::bind` (`[::1]:10809` for IPv6).
    Tcp(String),
}

impl FromStr for NbdAddress {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        let invalid = |reason: &str| Error::InvalidAddress {
            address: text.to_owned(),
            reason: reason.to_owned(),
        };
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(invalid("the socket path after 'unix:' is empty"));
            }
            return Ok(NbdAddress::Unix(PathBuf::from(path)));
        }
        if let Some(host_port) = text.strip_prefix("tcp:") {
            let Some((host, port)) = host_port.rsplit_once(':') else {
                return Err(invalid("expected tcp:HOST:PORT, e.g. tcp:127.0.0.1:10809"));
            };
            if host.is_empty() {
                return Err(invalid("the host in tcp:HOST:PORT is empty"));
            }
            if port.parse::<u16>().is_err() {
                return Err(invalid(&format!(
                    "port '{port}' is not a number from 0 to 65535"
                )));
            }
            return Ok(NbdAddress::Tcp(host_port.to_owned()));
        }
        Err(invalid(
            "expected unix:/path/to/socket or tcp:HOST:PORT (e.g. tcp:127.0.0.1:10809)",
        ))
    }
}

impl std::fmt::Display for NbdAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NbdAddress::Unix(path) => write!(f, "unix:{}", path.display()),
            NbdAddress::Tcp(host_port) => write!(f, "tcp:{host_port}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_forms_and_explains_mistakes() {
        assert_eq!(
            "unix:/run/a.sock".parse::<NbdAddress>().unwrap(),
            NbdAddress::Unix("/run/a.sock".into())
        );
        assert_eq!(
            "tcp:127.0.0.1:10809".parse::<NbdAddress>().unwrap(),
            NbdAddress::Tcp("127.0.0.1:10809".into())
        );
        assert_eq!(
            "tcp:[::1]:0".parse::<NbdAddress>().unwrap(),
            NbdAddress::Tcp("[::1]:0".into())
        );
        for bad in [
            "",
            "unix:",
            "tcp:1.2.3.4",
            "tcp::80",
            "tcp:h:99999",
            "/tmp/x",
        ] {
            let err = bad.parse::<NbdAddress>().unwrap_err().to_string();
            assert!(err.contains("invalid NBD address"), "{bad}: {err}");
        }
    }
}
