//! systemd's service notification protocol (sd_notify(3)), for `Type=notify` units: one
//! datagram of `KEY=VALUE` lines to the socket named by `$NOTIFY_SOCKET` (a path, or an
//! abstract socket when it starts with `@`). The protocol is a few lines of socket code, so it
//! is ours rather than a dependency. Without `$NOTIFY_SOCKET` (not under systemd) nothing is
//! sent; a failed send is logged and never stops the daemon.
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Where systemd listens for this service's state changes.
pub struct ServiceManager {
    socket: UnixDatagram,
    address: SocketAddr,
    /// `$NOTIFY_SOCKET` as given, for messages.
    name: String,
}

impl ServiceManager {
    /// The service manager named by `$NOTIFY_SOCKET`, if any.
    pub fn from_env() -> Option<ServiceManager> {
        let name = std::env::var("NOTIFY_SOCKET").ok()?;
        let address = match name.strip_prefix('@') {
            Some(abstract_name) => SocketAddr::from_abstract_name(abstract_name.as_bytes()),
            None => SocketAddr::from_pathname(&name),
        };
        let opened = address.and_then(|address| Ok((UnixDatagram::unbound()?, address)));
        match opened {
            Ok((socket, address)) => Some(ServiceManager {
                socket,
                address,
                name,
            }),
            Err(e) => {
                tracing::warn!("NOTIFY_SOCKET={name}: cannot notify systemd: {e}");
                None
            }
        }
    }

    /// Sends one message (`KEY=VALUE` lines).
    pub fn send(&self, message: &str) {
        if let Err(e) = self.socket.send_to_addr(message.as_bytes(), &self.address) {
            tracing::warn!(
                "NOTIFY_SOCKET={}: cannot notify systemd ({}): {e}",
                self.name,
                message.lines().next().unwrap_or_default()
            );
        }
    }

    pub fn status(&self, status: &str) {
        // A STATUS= value is one line.
        self.send(&format!("STATUS={}", status.replace('\n', " ")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_a_path_and_to_an_abstract_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        let abstract_name = format!("cryptblk-notify-test-{}", std::process::id());
        let abstract_listener = UnixDatagram::bind_addr(
            &SocketAddr::from_abstract_name(abstract_name.as_bytes()).unwrap(),
        )
        .unwrap();
        let mut buf = [0u8; 64];
        for (name, listener) in [
            (path.to_str().unwrap().to_owned(), &listener),
            (format!("@{abstract_name}"), &abstract_listener),
        ] {
            // No other test of this crate reads NOTIFY_SOCKET.
            std::env::set_var("NOTIFY_SOCKET", &name);
            let manager = ServiceManager::from_env().unwrap();
            manager.status("a\nb");
            let n = listener.recv(&mut buf).unwrap();
            assert_eq!(&buf[..n], b"STATUS=a b");
        }
        std::env::remove_var("NOTIFY_SOCKET");
        assert!(ServiceManager::from_env().is_none());
    }
}
