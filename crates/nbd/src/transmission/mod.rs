//! The transmission phase: reading requests, running them against the device, replying.
//!
//! - `pipelined`: plain connections. One thread per connection runs an event loop over the
//!   non-blocking socket and an asynchronous I/O queue of the export's device (an io_uring
//!   ring on a raw file or a LUKS volume over one): it pushes every request its read buffer
//!   holds, sends each burst with one system call, collects finished requests from the
//!   queue's eventfd and writes their replies (several in one `writev`); no other thread takes
//!   part. NBD replies carry the request's cookie, so they may complete in any order: one
//!   connection keeps up to `ConnectionConfig::queue_depth` requests (fio's iodepth) in
//!   flight on the device. Payload bytes in flight are capped per connection.
//! - `sequential`: TLS connections, one request at a time on the connection thread: a rustls
//!   stream is one state machine that cannot be split into independent read and write halves
//!   without a lock around every record, and correctness comes first there.
//! - `reply`: reply encoding shared by both; `failure_log`: failed requests logged at most
//!   once a second per connection; this file: what a connection may do (`Session`), request
//!   checks, error mapping.

mod failure_log;
mod pipelined;
mod reply;
mod sequential;

use crate::capabilities::{block_size_limits, is_read_only, supports_trim};
use crate::export::Export;
use crate::handshake::Negotiated;
use crate::metadata::MetaContext;
use crate::protocol::*;
use crate::socket::Transport;
use crate::Error;
use cryptblk_block::{BlockError, BlockErrorKind, IoKind};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Tunables of the transmission phase.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnectionConfig {
    /// Requests one plain connection keeps under way on the device at most.
    pub queue_depth: usize,
    /// A client that stays silent this long in the middle of a request, or does not take
    /// replies for this long, is disconnected. Idle time between requests is unlimited.
    pub io_timeout: Duration,
    /// Payload bytes of the requests under way on one connection (read, not yet answered)
    /// before the reader waits.
    pub max_pending_bytes: u64,
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        ConnectionConfig {
            queue_depth: 128,
            io_timeout: Duration::from_secs(30),
            max_pending_bytes: 64 << 20,
        }
    }
}

/// Bounds each chunk of a BLOCK_STATUS reply (8 bytes per extent) for a badly fragmented
/// file or bitmap.
const MAX_STATUS_DESCRIPTORS: usize = 1024;

/// What one connection may do, fixed at the end of the handshake.
pub(crate) struct Session<'a> {
    pub export: &'a Export,
    pub size: u64,
    pub min_block: u32,
    pub read_only: bool,
    pub can_trim: bool,
    pub structured_replies: bool,
    /// The metadata contexts selected; BLOCK_STATUS answers a chunk for each.
    pub contexts: Vec<MetaContext>,
    /// Set once anything was written, so the device is flushed when the connection ends.
    pub wrote: AtomicBool,
    pub failures: failure_log::FailureLog,
}

impl<'a> Session<'a> {
    pub(crate) fn new(
        export: &'a Export,
        structured_replies: bool,
        contexts: Vec<MetaContext>,
    ) -> Self {
        Session {
            export,
            size: export.device.size(),
            min_block: block_size_limits(export).0,
            read_only: is_read_only(export),
            can_trim: supports_trim(export),
            structured_replies,
            contexts,
            wrote: AtomicBool::new(false),
            failures: failure_log::FailureLog::new(),
        }
    }

    /// Logs a failed request (rate-limited: see `failure_log`).
    pub(crate) fn request_failed(&self, error: &BlockError) {
        self.failures.report(&self.export.name, error);
    }
}

/// Checks a request against the export and what was negotiated, before any I/O.
pub(crate) fn check_request(
    session: &Session<'_>,
    request: &RequestHeader,
) -> Result<(), NbdErrno> {
    let allowed_flags = match request.command {
        CMD_READ => CMD_FLAG_FUA | CMD_FLAG_DF,
        CMD_WRITE | CMD_TRIM => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        CMD_FLUSH => CMD_FLAG_FUA,
        CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
        // CACHE and anything unknown were never advertised.
        _ => return Err(NbdErrno::Inval),
    };
    if request.flags & !allowed_flags != 0 {
        return Err(NbdErrno::Inval);
    }
    let modifies = matches!(request.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    // A TRIM that releases (`Export::trim_releases`) changes nothing a read returns.
    let releases = request.command == CMD_TRIM && session.read_only && session.can_trim;
    if modifies && session.read_only && !releases {
        return Err(NbdErrno::Perm);
    }
    match request.command {
        CMD_FLUSH => return Ok(()),
        CMD_TRIM if !session.can_trim => return Err(NbdErrno::Inval),
        CMD_BLOCK_STATUS => {
            if session.contexts.is_empty() || request.length == 0 || request.offset >= session.size
            {
                return Err(NbdErrno::Inval);
            }
            return Ok(());
        }
        CMD_READ | CMD_WRITE if request.length > MAX_PAYLOAD => return Err(NbdErrno::Inval),
        _ => {}
    }
    let in_range = request
        .offset
        .checked_add(u64::from(request.length))
        .is_some_and(|end| end <= session.size);
    if !in_range {
        // The spec asks for ENOSPC on writes past the end, EINVAL otherwise.
        return Err(if modifies {
            NbdErrno::NoSpc
        } else {
            NbdErrno::Inval
        });
    }
    let block = u64::from(session.min_block);
    if !request.offset.is_multiple_of(block) || !u64::from(request.length).is_multiple_of(block) {
        return Err(NbdErrno::Inval);
    }
    Ok(())
}

fn errno_of(error: &BlockError, modifies: bool) -> NbdErrno {
    match error.kind() {
        BlockErrorKind::OutOfRange if modifies => NbdErrno::NoSpc,
        BlockErrorKind::OutOfRange | BlockErrorKind::Unaligned => NbdErrno::Inval,
        BlockErrorKind::ReadOnly => NbdErrno::Perm,
        BlockErrorKind::Unsupported => NbdErrno::NotSup,
        _ => {
            let os_error = std::error::Error::source(error)
                .and_then(|source| source.downcast_ref::<io::Error>())
                .and_then(io::Error::raw_os_error);
            match os_error {
                Some(code) if code == 28 /* ENOSPC */ || code == 122 /* EDQUOT */ => {
                    NbdErrno::NoSpc
                }
                Some(12 /* ENOMEM */) => NbdErrno::NoMem,
                Some(95 /* EOPNOTSUPP */) => NbdErrno::NotSup,
                _ => NbdErrno::Io,
            }
        }
    }
}

fn io_kind(command: u16) -> IoKind {
    match command {
        CMD_READ => IoKind::Read,
        CMD_WRITE | CMD_WRITE_ZEROES => IoKind::Write,
        CMD_FLUSH => IoKind::Flush,
        CMD_TRIM => IoKind::Discard,
        _ => IoKind::Other,
    }
}

fn is_timeout(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Reads the next request header. `Ok(None)` on a clean end of stream between requests.
/// A read timeout before the first byte is idleness and is waited out; after it, the client
/// is stalling mid-request and the error ends the connection.
fn read_request_header(reader: &mut impl Read) -> Result<Option<RequestHeader>, Error> {
    let mut bytes = [0u8; REQUEST_HEADER_LEN];
    let mut filled = 0;
    while filled < REQUEST_HEADER_LEN {
        match reader.read(&mut bytes[filled..]) {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => {
                return Err(Error::Protocol(
                    "client closed the connection inside a request header".into(),
                ))
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if filled == 0 && is_timeout(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    parse_request_header(&bytes)
        .map(Some)
        .map_err(|e| Error::Protocol(e.to_string()))
}

/// Serves a negotiated connection until the client disconnects, the connection fails, or it is
/// shut down from outside (read side closed); then flushes what it wrote and closes.
pub(crate) fn serve(negotiated: Negotiated, config: &ConnectionConfig) -> Result<(), Error> {
    let Negotiated {
        transport,
        attachment,
        structured_replies,
        contexts,
    } = negotiated;
    let export = std::sync::Arc::clone(attachment.export());
    let session = Session::new(&export, structured_replies, contexts);
    let result = match transport {
        Transport::Plain(socket) => {
            let result = pipelined::serve(&socket, &session, config);
            flush_if_written(&session);
            socket.shutdown(Shutdown::Both);
            result
        }
        Transport::Tls(mut stream) => {
            let result = sequential::serve(&mut stream, &session);
            flush_if_written(&session);
            stream.conn.send_close_notify();
            let _ = stream.flush();
            stream.sock.shutdown(Shutdown::Both);
            result
        }
    };
    // Unregistering last lets a waiting `remove` return only once the data is durable.
    drop(attachment);
    result
}

/// Makes this connection's writes durable before it reports itself finished.
fn flush_if_written(session: &Session<'_>) {
    if session.wrote.load(Ordering::Relaxed) {
        if let Err(e) = session.export.device.flush() {
            tracing::warn!(export = %session.export.name, "flush at disconnect failed: {e}");
        }
    }
}
