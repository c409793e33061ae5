//! Key-less backup chains of encrypted images.
//!
//! A chain is a directory: `manifest.json` and, per entry, an extents file and a data file
//! (see `docs/backup.md` for the format). Entries are pulled over NBD from an export of the
//! image's own bytes (ciphertext and LUKS header), so neither this crate nor the directory
//! ever holds a key or plaintext; a restored image opens with the passphrase as the source
//! did.
//!
//! - [`pull`]: a full entry (allocated extents) or an incremental (the extents a dirty
//!   bitmap reports), written crash-safely (partial files made durable, renamed, the manifest
//!   replaced last) and resumable.
//! - [`restore`]: the image as of any checkpoint, sparse, into a new file that appears only
//!   once every entry matched its checksums.
//! - [`verify`]: every checksum and the chain's continuity.
//!
//! Checksums are SHA-256 per file (extents and data of each entry), in the manifest: verify
//! and restore read each file once from start to end anyway, so one sum per file catches
//! every damaged byte at the cost of one hash pass, keeps the manifest small whatever the
//! number of extents, and names the damaged entry and file, which is all a restore can act
//! on (an entry is replayed whole or not at all).

// The few system calls without a safe wrapper are allowed where they are made.
#![deny(unsafe_code)]

mod durable;
mod error;
pub mod extents;
pub mod manifest;
mod pull;
mod read_ahead;
mod release;
mod replay;
mod restore;
mod resume;
mod verify;

pub use error::{Error, ErrorKind};
pub use manifest::{Entry, EntryKind, Manifest};
pub use pull::{pull, Progress, PullOptions, PullReport};
pub use restore::{restore, RestoreReport};
pub use verify::{verify, EntryCheck};
