//! Encoding replies: the reusable reply buffer, status-only replies (simple or structured
//! error), READ reply headers, BLOCK_STATUS replies, and the refusal of oversized WRITEs.

use super::{Session, MAX_STATUS_DESCRIPTORS};
use crate::protocol::*;
use crate::Error;
use cryptblk_block::{BlockError, ExtentKind};

/// A reusable buffer whose valid prefix is `len` bytes; the allocation behind it only grows,
/// so reuse never pays for zero-filling again.
#[derive(Default)]
pub(crate) struct ReplyBuffer {
    pub(super) data: Vec<u8>,
    len: usize,
}

impl ReplyBuffer {
    pub(crate) fn prepare(&mut self, len: usize) -> &mut [u8] {
        if self.data.len() < len {
            self.data.resize(len, 0);
        }
        self.len = len;
        &mut self.data[..len]
    }

    pub(crate) fn set(&mut self, parts: &[&[u8]]) {
        let total = parts.iter().map(|p| p.len()).sum();
        let out = self.prepare(total);
        let mut at = 0;
        for part in parts {
            out[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.data[..self.len]
    }

    /// Lets go of the allocation when it is larger than `max` bytes (after a large reply).
    pub(crate) fn shrink_to(&mut self, max: usize) {
        if self.data.capacity() > max {
            self.data = Vec::new();
            self.len = 0;
        }
    }
}

/// Writes a reply that carries no data.
pub(super) fn reply_status(
    session: &Session<'_>,
    request: &RequestHeader,
    result: Result<(), NbdErrno>,
    out: &mut ReplyBuffer,
) {
    let error = result.err();
    let structured_error = matches!(request.command, CMD_READ | CMD_BLOCK_STATUS);
    match error {
        Some(errno) if session.structured_replies && structured_error => {
            out.set(&[&encode_structured_error(request.cookie, errno)]);
        }
        _ => {
            let code = error.map_or(0, |errno| errno as u32);
            out.set(&[&encode_simple_reply(code, request.cookie)]);
        }
    }
}

/// The header of a successful READ reply carrying `length` bytes of data at `offset`: a
/// simple reply, or a structured OFFSET_DATA chunk that is the last one. Returns its length.
pub(super) fn read_reply_header(
    session: &Session<'_>,
    request: &RequestHeader,
    out: &mut [u8; READ_REPLY_HEADER_MAX],
) -> usize {
    if session.structured_replies {
        out[..STRUCTURED_REPLY_HEADER_LEN].copy_from_slice(&encode_structured_reply_header(
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_DATA,
            request.cookie,
            8 + request.length,
        ));
        out[STRUCTURED_REPLY_HEADER_LEN..STRUCTURED_REPLY_HEADER_LEN + 8]
            .copy_from_slice(&request.offset.to_be_bytes());
        STRUCTURED_REPLY_HEADER_LEN + 8
    } else {
        out[..SIMPLE_REPLY_HEADER_LEN].copy_from_slice(&encode_simple_reply(0, request.cookie));
        SIMPLE_REPLY_HEADER_LEN
    }
}

/// Room for the longest READ reply header (structured: chunk header + offset).
pub(super) const READ_REPLY_HEADER_MAX: usize = STRUCTURED_REPLY_HEADER_LEN + 8;

/// A WRITE longer than the protocol maximum is refused and the connection closed: reading a
/// payload just to discard it would let a client make the server swallow 4 GiB. Leaves the
/// error reply in `out` and returns the error that ends the connection.
pub(super) fn refuse_oversized_write(
    session: &Session<'_>,
    request: &RequestHeader,
    out: &mut ReplyBuffer,
) -> Error {
    reply_status(session, request, Err(NbdErrno::Inval), out);
    Error::Protocol(format!(
        "WRITE of {} bytes exceeds the maximum; closing",
        request.length
    ))
}

/// Answers BLOCK_STATUS into `out` (allocation extents of the export's device).
pub(super) fn block_status(
    session: &Session<'_>,
    request: &RequestHeader,
    out: &mut ReplyBuffer,
) -> Result<(), BlockError> {
    let device = &*session.export.device;
    let end = request
        .offset
        .saturating_add(u64::from(request.length))
        .min(session.size);
    let mut descriptors: Vec<(u32, u32)> = Vec::new();
    let mut at = request.offset;
    while at < end && descriptors.len() < MAX_STATUS_DESCRIPTORS {
        let extent = device.block_status(at, end - at)?;
        let len = extent.len.min(end - at);
        if len == 0 {
            break;
        }
        let flags = match extent.kind {
            ExtentKind::Unallocated => STATE_HOLE | STATE_ZERO,
            ExtentKind::Zero => STATE_ZERO,
            ExtentKind::Data => 0,
        };
        // `len` is at most the request's u32 length, so the sums below fit.
        match descriptors.last_mut() {
            Some(last) if last.1 == flags => last.0 += len as u32,
            _ => descriptors.push((len as u32, flags)),
        }
        at += len;
        if request.flags & CMD_FLAG_REQ_ONE != 0 {
            break;
        }
    }
    let payload_len = 4 + 8 * descriptors.len();
    let buffer = out.prepare(STRUCTURED_REPLY_HEADER_LEN + payload_len);
    buffer[..STRUCTURED_REPLY_HEADER_LEN].copy_from_slice(&encode_structured_reply_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_BLOCK_STATUS,
        request.cookie,
        payload_len as u32,
    ));
    let body = &mut buffer[STRUCTURED_REPLY_HEADER_LEN..];
    body[..4].copy_from_slice(&BASE_ALLOCATION_ID.to_be_bytes());
    for (i, (len, flags)) in descriptors.iter().enumerate() {
        let at = 4 + 8 * i;
        body[at..at + 4].copy_from_slice(&len.to_be_bytes());
        body[at + 4..at + 8].copy_from_slice(&flags.to_be_bytes());
    }
    Ok(())
}
