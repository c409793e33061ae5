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
//! STRUCTURED_REPLY, LIST_META_CONTEXT, SET_META_CONTEXT} with `base:allocation` and, on an
//! export with [`DirtyBitmaps`], `qemu:dirty-bitmap:NAME` (QEMU's contexts: flag 1 = dirty),
//! and the commands READ, WRITE (FUA), FLUSH, TRIM, WRITE_ZEROES, BLOCK_STATUS and DISC.
//! BLOCK_STATUS answers one chunk per selected context, in the order the server listed them.
//!
//! Policy decisions:
//! - The empty export name selects the only export when exactly one exists (like qemu-nbd's
//!   default export); with several it matches nothing.
//! - With `TlsCreds`, TLS is mandatory: before STARTTLS only STARTTLS and ABORT are accepted
//!   (other options get NBD_REP_ERR_TLS_REQD; NBD_OPT_EXPORT_NAME closes the connection).
//!   Clients must present a certificate signed by the CA; with an allow-list (the server's,
//!   or an export's own) its subject CN or a DNS subjectAltName must be listed, or the client
//!   is refused right after the TLS handshake (no list admits it) or sees and opens only the
//!   exports whose list does (NBD_REP_ERR_POLICY).
//! - Plain TCP on a non-loopback address is refused unless asked for on purpose
//!   (`NbdServer::bind_plain_tcp`); connections beyond the server's limits (in all, per peer
//!   address) are closed at once and logged.
//! - Every export advertises CAN_MULTI_CONN, FLUSH and FUA; TRIM only when the device
//!   implements discard; WRITE_ZEROES always writes zeroes (never punches holes), which is
//!   what an encrypted volume needs.
//! - Clients must use fixed newstyle negotiation; READ/WRITE are limited to 32 MiB and must
//!   be aligned to the device's logical block size (advertised as the minimum block size).

mod capabilities;
mod error;
mod export;
mod handshake;
mod metadata;
pub mod protocol;
mod read_pacer;
mod server;
mod socket;
mod tls;
mod transmission;

/// Where the server listens: `unix:PATH` or `tcp:HOST:PORT`, the address type every cryptblk
/// socket uses.
pub use cryptblk_net::Address as NbdAddress;
pub use cryptblk_net::ConnectionLimits;
pub use cryptblk_tls::AllowList;
pub use error::Error;
pub use export::{Export, ExportRegistry};
pub use metadata::{DirtyBitmaps, MAX_META_CONTEXT_QUERIES, MAX_SELECTED_CONTEXTS};
pub use read_pacer::{ReadGate, ReadPacer, READ_RATE_BURST};
pub use server::{NbdServer, StopHandle, DEFAULT_CONNECTION_LIMITS};
pub use tls::TlsCreds;
