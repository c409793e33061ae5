//! The error type of the library: what a caller embedding the server can match on.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("an export named '{0}' already exists")]
    ExportExists(String),
    #[error("no export named '{0}'")]
    NoSuchExport(String),
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    /// Plain NBD on an address other machines can reach, without the operator's consent.
    #[error(
        "refusing to serve NBD without TLS on {address}, which other machines can reach: \
             give TLS credentials, listen on a loopback address or a unix: socket, or allow \
             plain TCP on purpose (cryptblk serve --nbd-insecure)"
    )]
    PlainTcp { address: String },
    #[error("{}: {reason}", path.display())]
    TlsCredentials { path: PathBuf, reason: String },
    #[error("TLS setup failed: {0}")]
    Tls(#[from] rustls::Error),
    /// The peer broke the protocol; the connection is closed.
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}
