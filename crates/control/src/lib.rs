//! The cryptblk control socket: JSON-RPC 2.0 over a UNIX stream socket, one JSON value per
//! line in each direction.
//!
//! Orchestrators (libvirt hooks, scripts, `cryptblk ctl`) add and remove disks on a running
//! daemon without restarting it. JSON-RPC 2.0 because every language has a JSON library and
//! `socat - UNIX-CONNECT:PATH` drives it by hand; newline-delimited because compact JSON never
//! contains a raw newline, so a line is an unambiguous frame and no length prefix is needed.
//!
//! - [`ControlServer`] binds the socket (mode 0600, see [`ControlServer::bind`]), serves every
//!   client on its own thread and dispatches each request to a [`Handler`].
//! - [`call`] and [`Client`] are the client side.
//! - [`RpcError`] is a JSON-RPC error object; the `*_ERROR`/`INVALID_*` constants are the codes
//!   the specification reserves, and [`RpcError::application`] makes codes in
//!   `-32099..=-32000` for handler-specific failures.
//!
//! - [`api`] is the daemon's side of the contract: every method's params and answer as
//!   types, the method table `cryptblk ctl` is built from, and the error kinds with their
//!   codes.
//!
//! Protocol details beyond the specification: blank lines are ignored; a line longer than
//! [`MAX_LINE`] bytes gets an invalid-request error and the connection is closed (the server
//! cannot find the next frame boundary without reading an unbounded line); batches are
//! supported and answered as one line; requests received after the server was told to stop
//! get [`SERVER_SHUTTING_DOWN`]. A request may carry up to [`MAX_FDS_PER_REQUEST`] file
//! descriptors as SCM_RIGHTS ancillary data, which its params name by index ([`PassedFds`]);
//! one with more is refused and the descriptors closed.
#![forbid(unsafe_code)]
pub mod api;
mod client;
mod error;
mod fds;
mod protocol;
mod rpc_error;
mod server;
mod socket;

pub use client::{call, Client, ClientError};
pub use error::Error;
pub use fds::{PassedFds, MAX_FDS_PER_REQUEST};
pub use protocol::{Handler, MAX_LINE};
pub use rpc_error::{
    RpcError, APPLICATION_ERROR_MAX, APPLICATION_ERROR_MIN, INTERNAL_ERROR, INVALID_PARAMS,
    INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR, SERVER_SHUTTING_DOWN,
};
pub use server::{ControlServer, StopHandle};
