//! The reply stream: what the server sent next, as one part of the reply to one request.
//! Several requests may be in flight (reads), so a part names its request by cookie and
//! the caller finds the request it answers; nothing here assumes replies come in order.

use super::Client;
use crate::error::nbd_errno_name;
use crate::wire::*;
use crate::Error;
use std::io::{Read, Write};

/// One part of a reply, its payload (other than an error's) still on the stream.
pub(super) enum ReplyPart {
    /// A simple reply: it ends request `cookie`, which failed with `errno`, or succeeded
    /// (0: allowed only for a request without a reply payload, see [`no_payload`]).
    Simple { cookie: u64, errno: u32 },
    /// A structured chunk that is not an error; the caller reads its `length` bytes.
    Chunk { cookie: u64, chunk: Chunk },
    /// An error chunk, read whole: `offset` only for `NBD_REPLY_TYPE_ERROR_OFFSET`.
    Failed {
        cookie: u64,
        done: bool,
        reason: String,
        offset: Option<u64>,
    },
}

impl ReplyPart {
    /// The request this part answers.
    pub(super) fn cookie(&self) -> u64 {
        match *self {
            ReplyPart::Simple { cookie, .. }
            | ReplyPart::Chunk { cookie, .. }
            | ReplyPart::Failed { cookie, .. } => cookie,
        }
    }
}

pub(super) struct Chunk {
    pub(super) done: bool,
    pub(super) kind: u16,
    pub(super) length: u32,
}

impl<S: Read + Write> Client<S> {
    /// The next part of a reply, whichever request it answers.
    pub(super) fn next_reply_part(&mut self) -> Result<ReplyPart, Error> {
        let r = &mut self.stream;
        let magic = read_u32(r)?;
        if magic == SIMPLE_REPLY_MAGIC {
            let errno = read_u32(r)?;
            let cookie = read_u64(r)?;
            return Ok(ReplyPart::Simple { cookie, errno });
        }
        if magic != STRUCTURED_REPLY_MAGIC {
            return Err(Error::protocol(format!("a reply with magic {magic:#x}")));
        }
        let flags = read_u16(r)?;
        let kind = read_u16(r)?;
        let cookie = read_u64(r)?;
        let length = read_u32(r)?;
        let done = flags & REPLY_FLAG_DONE != 0;
        if kind & REPLY_TYPE_ERROR_BIT == 0 {
            return Ok(ReplyPart::Chunk {
                cookie,
                chunk: Chunk { done, kind, length },
            });
        }
        let payload = read_bounded(r, length.into(), MAX_ERROR_MESSAGE + 14, "an error chunk")?;
        let mut f = Fields::new(&payload);
        let errno = f.u32("an error chunk")?;
        let msg_len = f.u16("an error chunk")?;
        let message = String::from_utf8_lossy(f.take(msg_len.into(), "an error message")?);
        let offset = if kind == REPLY_TYPE_ERROR_OFFSET {
            Some(f.u64("an error chunk's offset")?)
        } else {
            None
        };
        let mut reason = nbd_errno_name(errno);
        if !message.is_empty() {
            reason = format!("{reason}: {message}");
        }
        Ok(ReplyPart::Failed {
            cookie,
            done,
            reason,
            offset,
        })
    }
}

/// A chunk of a kind the request does not expect: only an empty, final NONE chunk is
/// allowed.
pub(super) fn unexpected_chunk(chunk: &Chunk) -> Result<(), Error> {
    if chunk.kind == REPLY_TYPE_NONE {
        if chunk.length != 0 || !chunk.done {
            return Err(Error::protocol("a NONE chunk with a payload or not final"));
        }
        return Ok(());
    }
    Err(Error::protocol(format!(
        "a reply chunk of type {} here",
        chunk.kind
    )))
}

/// A simple success answering a request whose reply carries a payload (READ, BLOCK_STATUS):
/// once structured replies are agreed, those come only as structured chunks.
pub(super) fn no_payload() -> Error {
    Error::protocol("a simple reply without an error after structured replies were agreed")
}

pub(super) fn unknown_cookie(got: u64) -> Error {
    Error::protocol(format!("a reply for request {got}, which is not waiting"))
}

pub(super) fn too_many_chunks() -> Error {
    Error::protocol(format!(
        "more than {MAX_CHUNKS_PER_REPLY} chunks in one reply"
    ))
}
