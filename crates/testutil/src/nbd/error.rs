//! How a test client's NBD operation failed.

use std::fmt;
use std::io;

use cryptblk_nbd::protocol::*;

/// Why an NBD operation failed.
#[derive(Debug)]
pub enum NbdError {
    /// The socket failed (including timeouts and the server closing the connection).
    Io(io::Error),
    /// The server answered an option with an error reply (`reply` has bit 31 set).
    OptionRejected {
        option: u32,
        reply: u32,
        message: String,
    },
    /// The server broke the protocol, or the caller asked for something the export forbids.
    Protocol(String),
}

impl NbdError {
    /// The name of an option error reply type, as the protocol document spells it.
    pub fn rep_err_name(reply: u32) -> &'static str {
        match reply {
            REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP",
            REP_ERR_POLICY => "NBD_REP_ERR_POLICY",
            REP_ERR_INVALID => "NBD_REP_ERR_INVALID",
            x if x == REP_ERR | 4 => "NBD_REP_ERR_PLATFORM",
            REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD",
            REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN",
            REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN",
            x if x == REP_ERR | 8 => "NBD_REP_ERR_BLOCK_SIZE_REQD",
            REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG",
            x if x == REP_ERR | 10 => "NBD_REP_ERR_EXT_HEADER_REQD",
            _ => "unknown NBD_REP_ERR",
        }
    }

    /// Whether this is the connection going away (EOF, reset, broken pipe): what a client sees
    /// when the server is killed.
    pub fn is_disconnect(&self) -> bool {
        match self {
            NbdError::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            ),
            _ => false,
        }
    }
}

impl fmt::Display for NbdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NbdError::Io(e) => write!(f, "NBD socket: {e}"),
            NbdError::OptionRejected {
                option,
                reply,
                message,
            } => write!(
                f,
                "NBD option {option} rejected with {} ({reply:#x}): {message:?}",
                Self::rep_err_name(*reply)
            ),
            NbdError::Protocol(m) => write!(f, "NBD protocol: {m}"),
        }
    }
}

impl std::error::Error for NbdError {}

impl From<io::Error> for NbdError {
    fn from(e: io::Error) -> Self {
        NbdError::Io(e)
    }
}

pub type Result<T> = std::result::Result<T, NbdError>;

pub(super) fn protocol<T>(msg: impl Into<String>) -> Result<T> {
    Err(NbdError::Protocol(msg.into()))
}
