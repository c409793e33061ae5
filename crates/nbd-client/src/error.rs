use std::io;

/// What went wrong talking to an NBD server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The URI is not one this client can use.
    #[error("bad NBD URI {uri:?}: {reason}")]
    Uri { uri: String, reason: String },
    /// The server could not be reached.
    #[error("cannot connect to the NBD server at {address}: {source}")]
    Connect { address: String, source: io::Error },
    /// The connection failed or the server hung up.
    #[error("NBD connection: {0}")]
    Io(#[from] io::Error),
    /// The server sent bytes the protocol does not allow.
    #[error("the NBD server broke the protocol: {0}")]
    Protocol(String),
    /// The server answered an option with an error reply.
    #[error("the NBD server refused {option}: {reason}")]
    Refused {
        option: &'static str,
        reason: String,
    },
    /// A metadata context the caller needs is not offered on this export.
    #[error(
        "the NBD export does not offer the metadata context {0:?} (for a dirty bitmap: is the \
         name right, and was the export started with it?)"
    )]
    NoContext(String),
    /// A command failed on the server.
    #[error("the NBD server failed {command} at offset {offset}: {reason}")]
    Command {
        command: &'static str,
        offset: u64,
        reason: String,
    },
    /// The caller asked for something outside the export or the client's limits.
    #[error("{0}")]
    Request(String),
}

impl Error {
    pub(crate) fn protocol(what: impl Into<String>) -> Error {
        Error::Protocol(what.into())
    }
}

/// A readable name for an NBD error number (the protocol's numbers, not the host's errno).
pub(crate) fn nbd_errno_name(errno: u32) -> String {
    let name = match errno {
        1 => "EPERM (operation not permitted)",
        5 => "EIO (I/O error)",
        12 => "ENOMEM (out of memory)",
        22 => "EINVAL (invalid argument)",
        28 => "ENOSPC (no space left)",
        75 => "EOVERFLOW (value too large)",
        95 => "ENOTSUP (not supported)",
        108 => "ESHUTDOWN (server shutting down)",
        _ => return format!("error {errno}"),
    };
    name.to_string()
}
