//! The control socket is created with mode 0600 and no moment where it is more open, by the
//! private-directory-then-rename helper every listener of the daemon shares
//! (`cryptblk_net::unix_socket`, whose module comment says why).
use crate::error::Error;
pub(crate) use cryptblk_net::unix_socket::FileId;
use cryptblk_net::unix_socket::{self, SocketFile, SocketFileError};
use std::os::unix::net::UnixListener;
use std::path::Path;

/// Binds and listens on `path` (absolute) with mode 0600.
pub(crate) fn bind_private(path: &Path) -> Result<(UnixListener, FileId), Error> {
    unix_socket::bind_private(path, &SocketFile::default()).map_err(|e| match e {
        SocketFileError::InUse { path } => Error::InUse { path },
        SocketFileError::NotASocket { path } => Error::NotASocket { path },
        SocketFileError::PathTooLong { path, max } => Error::PathTooLong { path, max },
        SocketFileError::Io { what, path, source } => Error::Io { what, path, source },
    })
}
