//! BLOCK_STATUS: the extents of one metadata context, asked for while no read is in flight,
//! and the checks of its reply (one chunk for the context, extents never past the request).

use super::reply::{no_payload, too_many_chunks, unexpected_chunk, unknown_cookie, ReplyPart};
use super::{Client, Extent};
use crate::error::nbd_errno_name;
use crate::wire::*;
use crate::Error;
use std::io::{Read, Write};

impl<S: Read + Write> Client<S> {
    /// The extents of `context` from `offset` on, at most `length` bytes of them (the server
    /// may describe less: at least one extent). Replaces `out`'s contents. Refused while
    /// reads sent with [`send_read`](Client::send_read) are waiting for their replies.
    pub fn block_status(
        &mut self,
        context: &str,
        offset: u64,
        length: u32,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        let id = self
            .context_id(context)
            .ok_or_else(|| Error::NoContext(context.to_string()))?;
        self.check_range(offset, length.into())?;
        if !self.reads.is_empty() {
            return Err(Error::Request(format!(
                "block status while {} reads wait for their replies",
                self.reads.len()
            )));
        }
        out.clear();
        let cookie = self.send_request(CMD_BLOCK_STATUS, offset, length)?;
        let result = self.block_status_reply(cookie, id, length.into(), offset, out);
        self.mark_if_broken(&result);
        result?;
        if out.is_empty() {
            self.broken = true;
            return Err(Error::protocol(format!(
                "block status at offset {offset} without an extent of {context}"
            )));
        }
        Ok(())
    }

    fn block_status_reply(
        &mut self,
        cookie: u64,
        id: u32,
        length: u64,
        offset: u64,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        let mut failure = None;
        let mut seen = false;
        for _ in 0..MAX_CHUNKS_PER_REPLY {
            let part = self.next_reply_part()?;
            let (got, chunk) = match part {
                ReplyPart::Simple { cookie: got, errno } => {
                    if got != cookie {
                        return Err(unknown_cookie(got));
                    }
                    if errno == 0 {
                        return Err(no_payload());
                    }
                    return Err(Error::Command {
                        command: "block status",
                        offset,
                        reason: nbd_errno_name(errno),
                    });
                }
                ReplyPart::Failed {
                    cookie: got,
                    done,
                    reason,
                    offset: at,
                } => {
                    if got != cookie {
                        return Err(unknown_cookie(got));
                    }
                    failure.get_or_insert(Error::Command {
                        command: "block status",
                        offset: at.unwrap_or(offset),
                        reason,
                    });
                    if done {
                        return Err(failure.expect("set above"));
                    }
                    continue;
                }
                ReplyPart::Chunk { cookie: got, chunk } => (got, chunk),
            };
            if got != cookie {
                return Err(unknown_cookie(got));
            }
            match chunk.kind {
                REPLY_TYPE_BLOCK_STATUS => {
                    let payload = read_bounded(
                        &mut self.stream,
                        chunk.length.into(),
                        MAX_BLOCK_STATUS_CHUNK,
                        "a block-status chunk",
                    )?;
                    let mut f = Fields::new(&payload);
                    let chunk_id = f.u32("a block-status chunk")?;
                    if f.rest().is_empty() || !f.rest().len().is_multiple_of(8) {
                        return Err(Error::protocol(format!(
                            "a block-status chunk of {} bytes (4 + 8 per extent)",
                            chunk.length
                        )));
                    }
                    if chunk_id == id {
                        if seen {
                            return Err(Error::protocol("two block-status chunks for one context"));
                        }
                        seen = true;
                        let mut total = 0u64;
                        while !f.rest().is_empty() && total < length {
                            let len = u64::from(f.u32("an extent")?);
                            let flags = f.u32("an extent")?;
                            if len == 0 {
                                return Err(Error::protocol("a block-status extent of 0 bytes"));
                            }
                            // The last extent may run past the request; keep what was asked.
                            let len = len.min(length - total);
                            total += len;
                            out.push(Extent { length: len, flags });
                        }
                    }
                }
                _ => unexpected_chunk(&chunk)?,
            }
            if chunk.done {
                return failure.map_or(Ok(()), Err);
            }
        }
        Err(too_many_chunks())
    }
}
