//! A small NBD client for pulling bytes and their block status from an NBD server (QEMU's
//! `qemu-nbd` and `qemu-storage-daemon`, nbdkit, cryptblk's own export).
//!
//! What it speaks: the fixed newstyle handshake, `NBD_OPT_STRUCTURED_REPLY`,
//! `NBD_OPT_SET_META_CONTEXT` (`base:allocation`, `qemu:dirty-bitmap:NAME`), `NBD_OPT_GO`,
//! then `NBD_CMD_BLOCK_STATUS` and `NBD_CMD_READ` (up to [`MAX_READS_IN_FLIGHT`] reads in
//! flight, replies taken in any order). It never writes to the export; it sends
//! `NBD_CMD_TRIM` only to release what it stored on an export that is read-only and offers
//! TRIM all the same (cryptblk's backup export), never to any other. TLS is not spoken
//! yet (an `nbds://` URI is refused with that reason).
//!
//! Everything the server sends is untrusted input: every length is checked against a fixed
//! bound before anything is allocated (option replies 64 KiB, block-status chunks 4 MiB,
//! error messages 4 KiB, at most 65,536 chunks per reply), every chunk must lie inside the
//! request it answers, and a violation is a [`Error::Protocol`], never a panic. The fuzz target
//! `nbd_client` (fuzz/) feeds arbitrary server bytes through the whole session.

#![forbid(unsafe_code)]

mod client;
mod error;
mod uri;
mod wire;

pub use client::{Client, CompletedRead, ExportInfo, Extent, MAX_READS_IN_FLIGHT};
pub use error::Error;
pub use uri::{NbdUri, Transport};
pub use wire::{BASE_ALLOCATION, DIRTY_BITMAP_PREFIX, STATE_DIRTY, STATE_HOLE, STATE_ZERO};

/// The longest READ this client sends (QEMU's server accepts up to 32 MiB).
pub const MAX_READ: usize = 32 << 20;
