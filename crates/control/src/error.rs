//! Why a control server could not be set up or could not keep accepting. Its own module
//! because both the server and the socket binding (`socket.rs`) produce it.
use std::io;
use std::path::PathBuf;

/// Why the server could not be set up or could not keep accepting.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "another server is already listening on {}; stop it or choose another control socket path",
        path.display()
    )]
    InUse { path: PathBuf },
    #[error("refusing to replace {}: it exists and is not a socket", path.display())]
    NotASocket { path: PathBuf },
    #[error(
        "control socket path {} is too long: UNIX socket paths here are limited to {max} bytes",
        path.display()
    )]
    PathTooLong { path: PathBuf, max: usize },
    #[error("{what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}
