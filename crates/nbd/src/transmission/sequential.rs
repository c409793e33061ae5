//! TLS connections: one request at a time on the connection thread, through the device's
//! synchronous interface (see the module above for why).
//!
//! Memory: before a READ or a WRITE's payload is read, the connection reserves what the
//! request may make the daemon hold (the payload or the reply's data, and for a WRITE its
//! encrypted copy) from the daemon's memory budget, waiting for a grant when it has no room,
//! and gives it back once the reply is sent. Buffers beyond `KEEP_BUFFER` are let go after the
//! request, so an idle connection holds little.

use super::reply::{
    block_status, read_reply_header, refuse_oversized_write, reply_status, ReplyBuffer,
    READ_REPLY_HEADER_MAX,
};
use super::{check_request, errno_of, io_kind, read_request_header, Session};
use crate::protocol::*;
use crate::socket::Socket;
use crate::Error;
use cryptblk_block::aio::Notifier;
use cryptblk_block::{buffers, BlockError, IoKind, MemoryBudget};
use std::io::{Read, Write};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Buffers up to this size stay with the connection for its next request.
const KEEP_BUFFER: usize = 1 << 20;

/// Checks and runs a request, leaving its complete reply in `out`. Returns
/// whether it succeeded (for the statistics).
fn execute(
    session: &Session<'_>,
    request: &RequestHeader,
    payload: Option<&[u8]>,
    out: &mut ReplyBuffer,
) -> bool {
    let result = check_request(session, request).and_then(|()| run(session, request, payload, out));
    match result {
        Ok(Replied::Done) => true,
        Ok(Replied::Status) => {
            reply_status(session, request, Ok(()), out);
            true
        }
        Err(errno) => {
            reply_status(session, request, Err(errno), out);
            false
        }
    }
}

enum Replied {
    /// `out` already holds the reply.
    Done,
    /// Success without data: the caller writes the reply.
    Status,
}

fn run(
    session: &Session<'_>,
    request: &RequestHeader,
    payload: Option<&[u8]>,
    out: &mut ReplyBuffer,
) -> Result<Replied, NbdErrno> {
    let device = &*session.export.device;
    let offset = request.offset;
    let length = request.length as usize;
    let modifies = matches!(request.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    let fail = |error: BlockError| {
        session.request_failed(&error);
        errno_of(&error, modifies)
    };
    if modifies {
        session.wrote.store(true, Ordering::Relaxed);
    }
    match request.command {
        CMD_READ => {
            if let Some(pacer) = &session.export.read_rate {
                pacer.wait_for_turn(length as u64);
            }
            let mut header = [0u8; READ_REPLY_HEADER_MAX];
            let header_len = read_reply_header(session, request, &mut header);
            let buffer = out.prepare(header_len + length);
            device
                .read_at(&mut buffer[header_len..], offset)
                .map_err(fail)?;
            buffer[..header_len].copy_from_slice(&header[..header_len]);
            return Ok(Replied::Done);
        }
        CMD_WRITE => {
            let data = payload.ok_or(NbdErrno::Inval)?;
            device.write_at(data, offset).map_err(fail)?;
        }
        CMD_FLUSH => device.flush().map_err(fail)?,
        CMD_TRIM => device.discard(offset, length as u64).map_err(fail)?,
        // Always written, never punched: on an encrypted volume a hole does not read back
        // as zeros, and NO_HOLE is then honoured for free.
        CMD_WRITE_ZEROES => device.write_zeroes(offset, length as u64).map_err(fail)?,
        CMD_BLOCK_STATUS => {
            block_status(session, request, out).map_err(fail)?;
            return Ok(Replied::Done);
        }
        _ => return Err(NbdErrno::Inval),
    }
    if request.flags & CMD_FLAG_FUA != 0 {
        device.flush().map_err(fail)?;
    }
    Ok(Replied::Status)
}

/// Serves a TLS connection until the client disconnects or the connection fails.
pub(super) fn serve(
    stream: &mut rustls::StreamOwned<rustls::ServerConnection, Socket>,
    session: &Session<'_>,
) -> Result<(), Error> {
    let stats = &session.export.stats;
    let mut payload = Vec::new();
    let mut reply = ReplyBuffer::default();
    let mut budget = MemoryBudget::process().share(Arc::new(Notifier::new()?));
    loop {
        let Some(request) = read_request_header(stream)? else {
            return Ok(());
        };
        if request.command == CMD_DISC {
            return Ok(());
        }
        let started = stats.begin();
        let copies = match request.command {
            CMD_WRITE if request.length <= MAX_PAYLOAD => 2,
            CMD_READ if request.length <= MAX_PAYLOAD => 1,
            _ => 0,
        };
        let charge =
            budget.charge_for(copies * buffers::class_size(request.length as usize) as u64);
        // Nothing else to do meanwhile: one request at a time.
        let reserved = budget.reserve_blocking(charge, || false).unwrap_or(0);
        let data = if request.command == CMD_WRITE {
            if request.length > MAX_PAYLOAD {
                let error = refuse_oversized_write(session, &request, &mut reply);
                stats.complete(IoKind::Write, 0, started, false);
                stream.write_all(reply.bytes())?;
                stream.flush()?;
                return Err(error);
            }
            payload.resize(request.length as usize, 0);
            if let Err(e) = stream.read_exact(&mut payload) {
                stats.complete(IoKind::Write, 0, started, false);
                return Err(e.into());
            }
            Some(payload.as_slice())
        } else {
            None
        };
        let ok = execute(session, &request, data, &mut reply);
        stream.write_all(reply.bytes())?;
        stream.flush()?;
        stats.complete(
            io_kind(request.command),
            u64::from(request.length),
            started,
            ok,
        );
        if payload.capacity() > KEEP_BUFFER {
            payload = Vec::new();
        }
        reply.shrink_to(KEEP_BUFFER);
        budget.release(reserved);
        // Between requests the connection holds nothing of the budget.
        budget.return_credit();
    }
}
