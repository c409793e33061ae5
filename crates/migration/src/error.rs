//! The errors a migration can end with, typed so that the daemon can tell "the peer refused"
//! from "the stream broke" from "our own disk failed".

use crate::wire::WireError;
use crate::Phase;
use cryptblk_block::BlockError;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrationError {
    /// Reading or writing an image failed.
    #[error("{0}")]
    Block(#[from] BlockError),
    /// The stream failed or carried something that is not a valid frame.
    #[error("migration stream: {0}")]
    Wire(#[from] WireError),
    #[error(
        "protocol version mismatch: this side speaks version {ours}, the peer version {theirs}"
    )]
    VersionMismatch { ours: u32, theirs: u32 },
    #[error(
        "disk size mismatch: this side's image file is {ours} bytes, the peer's {theirs} bytes"
    )]
    SizeMismatch { ours: u64, theirs: u64 },
    /// The peer sent an `Error` frame: it refused or aborted the migration.
    #[error("the peer aborted the migration: {0}")]
    Refused(String),
    /// A well-formed frame that makes no sense at this point (or with these values).
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("chunk of {len} bytes at offset {offset} lies outside the {disk_size}-byte disk")]
    OutOfRange {
        offset: u64,
        len: u64,
        disk_size: u64,
    },
    /// Shared storage: the two sides do not reach the same image.
    #[error("not the same image: {0}")]
    DifferentImage(String),
    #[error("invalid migration options: {0}")]
    InvalidOptions(String),
    #[error("cannot connect to the migration destination {to}: {reason}")]
    Connect { to: String, reason: String },
    #[error("cannot {action}: the migration is in phase {phase}")]
    WrongPhase { phase: Phase, action: &'static str },
    #[error("migration listener: {0}")]
    Listen(std::io::Error),
    #[error("the destination image {path} already exists; a migration never overwrites an image")]
    DestinationExists { path: std::path::PathBuf },
}

/// Tracking that cannot be set up is an invalid option of the migration (its message kept).
impl From<cryptblk_volume::TrackingError> for MigrationError {
    fn from(e: cryptblk_volume::TrackingError) -> Self {
        MigrationError::InvalidOptions(e.0)
    }
}
