//! Why a sending loop stops on its channels: they broke (a reason to report and recover
//! from), or the migration was cancelled. The sender and the urgent-request answerer share it.
use crate::wire::WireError;
use crate::MigrationError;

/// Why the sender stopped sending on the current channels.
pub(super) enum Stop {
    Broken(String),
    Cancelled,
}

impl From<MigrationError> for Stop {
    fn from(e: MigrationError) -> Self {
        Stop::Broken(e.to_string())
    }
}

impl From<WireError> for Stop {
    fn from(e: WireError) -> Self {
        Stop::Broken(e.to_string())
    }
}

impl From<std::io::Error> for Stop {
    fn from(e: std::io::Error) -> Self {
        Stop::Broken(e.to_string())
    }
}
