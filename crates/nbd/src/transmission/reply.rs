//! Encoding replies: the reusable reply buffer, status-only replies (simple or structured
//! error), READ reply headers, BLOCK_STATUS replies, and the refusal of oversized WRITEs.

use super::{Session, MAX_STATUS_DESCRIPTORS};
use crate::metadata::{DirtyBitmaps, MetaContext};
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

/// Answers BLOCK_STATUS into `out`: one NBD_REPLY_TYPE_BLOCK_STATUS chunk per selected
/// context, in the order of their ids, the last one flagged DONE. A chunk covers the request
/// from its offset on, possibly less than all of it (a fragmented range stops at
/// `MAX_STATUS_DESCRIPTORS` extents); with REQ_ONE it has exactly one extent.
pub(super) fn block_status(
    session: &Session<'_>,
    request: &RequestHeader,
    out: &mut ReplyBuffer,
) -> Result<(), BlockError> {
    let end = request
        .offset
        .saturating_add(u64::from(request.length))
        .min(session.size);
    let one = request.flags & CMD_FLAG_REQ_ONE != 0;
    let mut chunks = Vec::with_capacity(session.contexts.len());
    for context in &session.contexts {
        let mut descriptors = match context {
            MetaContext::BaseAllocation => allocation(session, request.offset, end, one)?,
            MetaContext::DirtyBitmap(name) => {
                let bitmaps = session.export.dirty_bitmaps.as_deref().ok_or_else(|| {
                    BlockError::unsupported("the export has no dirty bitmaps any more")
                })?;
                dirtiness(bitmaps, name, request.offset, end)?
            }
        };
        if one {
            descriptors.truncate(1);
        }
        chunks.push(descriptors);
    }
    let total: usize = chunks
        .iter()
        .map(|d| STRUCTURED_REPLY_HEADER_LEN + 4 + 8 * d.len())
        .sum();
    let buffer = out.prepare(total);
    let mut at = 0;
    for (index, descriptors) in chunks.iter().enumerate() {
        let last = index + 1 == chunks.len();
        let payload_len = 4 + 8 * descriptors.len();
        buffer[at..at + STRUCTURED_REPLY_HEADER_LEN].copy_from_slice(
            &encode_structured_reply_header(
                if last { REPLY_FLAG_DONE } else { 0 },
                REPLY_TYPE_BLOCK_STATUS,
                request.cookie,
                payload_len as u32,
            ),
        );
        at += STRUCTURED_REPLY_HEADER_LEN;
        // Ids are the contexts' positions plus one, as the handshake announced them.
        buffer[at..at + 4].copy_from_slice(&(index as u32 + 1).to_be_bytes());
        at += 4;
        for (len, flags) in descriptors {
            buffer[at..at + 4].copy_from_slice(&len.to_be_bytes());
            buffer[at + 4..at + 8].copy_from_slice(&flags.to_be_bytes());
            at += 8;
        }
    }
    Ok(())
}

/// Appends an extent of `len` bytes with `flags`, merging it into the previous one when their
/// flags agree. Callers keep the sum of lengths within the request's u32 length.
fn push_extent(descriptors: &mut Vec<(u32, u32)>, len: u64, flags: u32) {
    match descriptors.last_mut() {
        Some(last) if last.1 == flags => last.0 += len as u32,
        _ => descriptors.push((len as u32, flags)),
    }
}

/// `base:allocation` extents of the device over `offset..end`.
fn allocation(
    session: &Session<'_>,
    offset: u64,
    end: u64,
    one: bool,
) -> Result<Vec<(u32, u32)>, BlockError> {
    let device = &*session.export.device;
    let mut descriptors = Vec::new();
    let mut at = offset;
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
        push_extent(&mut descriptors, len, flags);
        at += len;
        if one {
            break;
        }
    }
    Ok(descriptors)
}

/// `qemu:dirty-bitmap:NAME` extents over `offset..end`: clean (0) and dirty (STATE_DIRTY)
/// alternating, from the bitmap's changed runs. At least one extent when `offset < end`.
fn dirtiness(
    bitmaps: &dyn DirtyBitmaps,
    name: &str,
    offset: u64,
    end: u64,
) -> Result<Vec<(u32, u32)>, BlockError> {
    // Each run adds at most a clean and a dirty extent.
    let limit = MAX_STATUS_DESCRIPTORS / 2;
    let runs = bitmaps.dirty_runs(name, offset, limit)?;
    let mut descriptors = Vec::new();
    let mut at = offset;
    for &(start, len) in &runs {
        let run_end = start.saturating_add(len).min(end);
        // Sorted and disjoint by contract; anything else is skipped rather than trusted.
        if run_end <= at {
            continue;
        }
        if start >= end {
            break;
        }
        if start > at {
            push_extent(&mut descriptors, start - at, 0);
            at = start;
        }
        push_extent(&mut descriptors, run_end - at, STATE_DIRTY);
        at = run_end;
    }
    // Past the last run everything is clean, unless the provider stopped at the limit: then
    // the reply ends there and the client asks again from that point. (A provider breaking
    // its contract gets the safe answer, dirty, rather than an empty chunk.)
    if at < end && runs.len() < limit {
        push_extent(&mut descriptors, end - at, 0);
    } else if descriptors.is_empty() {
        push_extent(&mut descriptors, end - offset, STATE_DIRTY);
    }
    Ok(descriptors)
}
