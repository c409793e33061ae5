//! Where cryptblk listens and connects, written once for the NBD server and live migration:
//!
//! - [`Address`]: `unix:PATH` or `tcp:HOST:PORT`, as users write it (one parser).
//! - [`Listener`]: binds an address (replacing only a stale Unix socket, never another file),
//!   accepts [`Stream`]s, can be woken from another thread, removes its socket file when
//!   dropped.
//! - [`connect`]: a [`Stream`] to an address within a timeout.
//! - [`ConnectionGate`]: caps a listener's open connections, in all and per peer address.
//! - [`Address::is_loopback`]: whether a listening address only takes connections from this
//!   machine (plain TCP elsewhere needs the operator's explicit consent).
//! - [`unix_socket`]: UNIX sockets created with their final owner and mode (private directory,
//!   then rename) and the peer's credentials; every listener of the daemon uses it.
//! - [`tls`]: x509 credentials in QEMU's layout (re-exported from `cryptblk-tls`), the name a
//!   client checks the server's certificate against, and a handshake bounded by the stream's
//!   timeouts.

// System calls go through rustix and nix.
#![forbid(unsafe_code)]
mod address;
mod limits;
mod listener;
mod stream;
pub mod tls;
pub mod unix_socket;

pub use address::{Address, AddressError};
pub use limits::{ConnectionGate, ConnectionLimits, ConnectionPermit, LimitExceeded};
pub use listener::{BindError, Listener, ListenerWaker, ListeningSocket};
pub use stream::{connect, Stream};
