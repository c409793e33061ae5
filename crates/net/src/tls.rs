//! TLS for both protocols: credentials in QEMU's `tls-creds-x509` layout (from
//! `cryptblk-tls`), the server name a client verifies, and the handshake.
use crate::Address;
use std::io::{self, Read, Write};

pub use cryptblk_tls::{
    certificate_names, client_config, read_certificates, rustls, server_config, AllowList,
    AllowListError, CertificateNames, CredentialsError,
};

/// The name a TLS client expects in the server's certificate for `address`: the host (an IP
/// address or a DNS name), or `localhost` for a Unix socket.
pub fn server_name(address: &Address) -> io::Result<rustls::pki_types::ServerName<'static>> {
    let host = address.tls_host();
    rustls::pki_types::ServerName::try_from(host.clone()).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("'{host}' cannot be checked against a certificate: {e}"),
        )
    })
}

/// A rustls connection in its handshake.
pub trait Handshake {
    fn is_handshaking(&self) -> bool;
    fn complete_io<T: Read + Write>(&mut self, io: &mut T) -> io::Result<(usize, usize)>;
}

impl Handshake for rustls::ServerConnection {
    fn is_handshaking(&self) -> bool {
        std::ops::Deref::deref(self).is_handshaking()
    }
    fn complete_io<T: Read + Write>(&mut self, io: &mut T) -> io::Result<(usize, usize)> {
        std::ops::DerefMut::deref_mut(self).complete_io(io)
    }
}

impl Handshake for rustls::ClientConnection {
    fn is_handshaking(&self) -> bool {
        std::ops::Deref::deref(self).is_handshaking()
    }
    fn complete_io<T: Read + Write>(&mut self, io: &mut T) -> io::Result<(usize, usize)> {
        std::ops::DerefMut::deref_mut(self).complete_io(io)
    }
}

/// Runs the handshake of `conn` over `io` to the end. Bounded by `io`'s timeouts (set them
/// first); an error names `peer` and says whether it timed out or hung up.
pub fn complete_handshake(
    conn: &mut impl Handshake,
    io: &mut (impl Read + Write),
    peer: &str,
) -> io::Result<()> {
    while conn.is_handshaking() {
        match conn.complete_io(io) {
            Ok((0, 0)) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("TLS handshake with {peer}: the peer closed the connection"),
                ))
            }
            Ok(_) => {}
            Err(e) => {
                let what = if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) {
                    "timed out".to_string()
                } else {
                    e.to_string()
                };
                return Err(io::Error::new(
                    e.kind(),
                    format!("TLS handshake with {peer} failed: {what}"),
                ));
            }
        }
    }
    Ok(())
}
