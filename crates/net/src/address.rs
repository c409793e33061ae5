//! The address syntax users write on command lines and in requests.
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// A listening or connecting address: `unix:/path/to/socket` or `tcp:HOST:PORT` (a bare
/// `HOST:PORT` is TCP too). IPv6 hosts are bracketed: `tcp:[::1]:10809`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Address {
    Unix(PathBuf),
    /// `host:port` as `TcpListener::bind` and `ToSocketAddrs` take it.
    Tcp(String),
}

/// Text that is not an address; the message says what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid address '{address}': {reason}")]
pub struct AddressError {
    pub address: String,
    pub reason: String,
}

impl FromStr for Address {
    type Err = AddressError;

    fn from_str(text: &str) -> Result<Self, AddressError> {
        let invalid = |reason: &str| AddressError {
            address: text.to_owned(),
            reason: reason.to_owned(),
        };
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(invalid("the socket path after 'unix:' is empty"));
            }
            return Ok(Address::Unix(PathBuf::from(path)));
        }
        let host_port = text.strip_prefix("tcp:").unwrap_or(text);
        let Some((host, port)) = host_port.rsplit_once(':') else {
            return Err(invalid(
                "expected unix:/path/to/socket or tcp:HOST:PORT (e.g. tcp:127.0.0.1:10809)",
            ));
        };
        if host.is_empty() {
            return Err(invalid("the host in tcp:HOST:PORT is empty"));
        }
        // A colon in the host is an IPv6 address, which must be bracketed; anything else
        // (`udp:1.2.3.4:5`) is a scheme we do not have.
        if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
            return Err(invalid(
                "expected unix:/path/to/socket or tcp:HOST:PORT (an IPv6 host in brackets)",
            ));
        }
        if port.parse::<u16>().is_err() {
            return Err(invalid(&format!(
                "port '{port}' is not a number from 0 to 65535"
            )));
        }
        Ok(Address::Tcp(host_port.to_owned()))
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Unix(path) => write!(f, "unix:{}", path.display()),
            Address::Tcp(host_port) => write!(f, "tcp:{host_port}"),
        }
    }
}

impl Address {
    /// The host a TLS client checks the server's certificate against: the TCP host without
    /// brackets, or `localhost` for a Unix socket.
    pub fn tls_host(&self) -> String {
        match self {
            Address::Tcp(hp) => {
                let host = hp.rsplit_once(':').map_or(hp.as_str(), |(h, _)| h);
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string()
            }
            Address::Unix(_) => "localhost".to_string(),
        }
    }
}

impl Address {
    /// Whether only this machine can reach the address: a Unix socket, or a TCP host that
    /// resolves to loopback addresses only (`127.0.0.0/8`, `::1`, `localhost`). A wildcard
    /// (`0.0.0.0`, `[::]`) or any other address is reachable from the network.
    pub fn is_loopback(&self) -> std::io::Result<bool> {
        match self {
            Address::Unix(_) => Ok(true),
            Address::Tcp(hp) => {
                let resolved: Vec<_> =
                    std::net::ToSocketAddrs::to_socket_addrs(hp.as_str())?.collect();
                Ok(!resolved.is_empty() && resolved.iter().all(|a| a.ip().is_loopback()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_forms_and_explains_mistakes() {
        assert_eq!(
            "unix:/run/a.sock".parse::<Address>().unwrap(),
            Address::Unix("/run/a.sock".into())
        );
        assert_eq!(
            "tcp:127.0.0.1:10809".parse::<Address>().unwrap(),
            Address::Tcp("127.0.0.1:10809".into())
        );
        assert_eq!(
            "tcp:[::1]:0".parse::<Address>().unwrap(),
            Address::Tcp("[::1]:0".into())
        );
        assert_eq!(
            "example.org:4444".parse::<Address>().unwrap(),
            Address::Tcp("example.org:4444".into())
        );
        for bad in [
            "",
            "unix:",
            "tcp:1.2.3.4",
            "tcp::80",
            "tcp:h:99999",
            "/tmp/x",
            "udp:1.2.3.4:5",
            "tcp:::1:5",
        ] {
            let err = bad.parse::<Address>().unwrap_err().to_string();
            assert!(err.contains("invalid address"), "{bad}: {err}");
        }
        for text in ["unix:/run/a.sock", "tcp:[::1]:0", "tcp:h:1"] {
            assert_eq!(text.parse::<Address>().unwrap().to_string(), text);
        }
        assert_eq!("tcp:[::1]:5".parse::<Address>().unwrap().tls_host(), "::1");
        assert_eq!(
            "unix:/x".parse::<Address>().unwrap().tls_host(),
            "localhost"
        );
    }

    #[test]
    fn only_loopback_and_unix_addresses_are_local() {
        for local in [
            "unix:/run/x",
            "tcp:127.0.0.1:0",
            "tcp:127.0.0.2:1",
            "tcp:[::1]:5",
            "tcp:localhost:1",
        ] {
            assert!(
                local.parse::<Address>().unwrap().is_loopback().unwrap(),
                "{local}"
            );
        }
        for remote in [
            "tcp:0.0.0.0:0",
            "tcp:[::]:0",
            "tcp:192.0.2.1:1",
            "tcp:10.1.2.3:5",
        ] {
            assert!(
                !remote.parse::<Address>().unwrap().is_loopback().unwrap(),
                "{remote}"
            );
        }
    }
}
