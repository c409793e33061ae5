//! An NBD (Network Block Device) server exporting cryptblk `BlockDevice`s to QEMU, qemu-img,
//! nbdkit/libnbd clients (nbdcopy, nbdinfo, fio) and the kernel's nbd-client.
//!
//! - `ExportRegistry` holds the named exports; it can change while the server runs, and
//!   removing an export drains and closes the connections using it.
//! - `NbdServer` listens on a Unix or TCP socket (`NbdAddress`), optionally requiring TLS
//!   (`TlsCreds`, QEMU's x509 directory layout), and serves each client on its own thread.
//! - `protocol` has the wire format with pure parsers over byte slices.
//!
//! Supported: fixed newstyle handshake, NBD_OPT_{EXPORT_NAME, ABORT, LIST, STARTTLS, INFO, GO,
//! STRUCTURED_REPLY, LIST_META_CONTEXT, SET_META_CONTEXT} with `base:allocation`, and the
//! commands READ, WRITE (FUA), FLUSH, TRIM, WRITE_ZEROES, BLOCK_STATUS and DISC.

mod address;
mod error;
mod export;
mod handshake;
pub mod protocol;
mod server;
mod socket;
mod tls;
mod transmission;

pub use address::NbdAddress;
pub use error::Error;
pub use export::{Export, ExportRegistry};
pub use server::{NbdServer, StopHandle};
pub use tls::TlsCreds;
