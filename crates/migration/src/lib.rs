//! Live migration of cryptblk disks: the building blocks a daemon strings together.
//!
//! Migration moves **ciphertext only**. The source reads the image file *below* the encryption
//! layer (for LUKS: the header and the encrypted payload, byte for byte) and the destination
//! writes the same bytes into its own image file, so no key ever crosses the wire and the
//! destination needs the passphrase only when it later opens the volume.
//!
//! - [`dirty`]: a lock-free dirty bitmap and [`DirtyTracker`], a `BlockDevice` wrapper that
//!   records every guest write or discard while a migration runs.
//! - [`wire`]: the versioned, framed, checksummed protocol, with pure parsers for untrusted
//!   input.
//! - [`precopy`]: the sender (a full pass, then passes over the dirty set until it converges,
//!   then a final pass at switchover) and the receiver.

pub mod dirty;
mod error;
pub mod precopy;
pub mod wire;

pub use dirty::{DirtyBitmap, DirtyTracker};
pub use error::MigrationError;
pub use precopy::{final_pass, receive, send_precopy, PrecopyOptions, ReceiveStats, SendStats};
pub use wire::{Frame, WireError, PROTOCOL_VERSION};
