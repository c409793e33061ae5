//! Requests once the export is open, one at a time: READ and BLOCK_STATUS, and the checks of
//! their (structured) replies: the cookie, chunks inside the request and covering it, errors
//! named.

use super::{Client, Extent};
use crate::error::nbd_errno_name;
use crate::wire::*;
use crate::{Error, MAX_READ};
use std::io::{Read, Write};

impl<S: Read + Write> Client<S> {
    /// The extents of `context` from `offset` on, at most `length` bytes of them (the server
    /// may describe less: at least one extent). Replaces `out`'s contents.
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
            let Some(chunk) = self.chunk_header(cookie, "block status", offset, &mut failure)?
            else {
                return failure.map_or(Ok(()), Err);
            };
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
                _ => self.unexpected_chunk(&chunk)?,
            }
            if chunk.done {
                return failure.map_or(Ok(()), Err);
            }
        }
        Err(too_many_chunks())
    }

    /// Reads `buf.len()` bytes at `offset` (at most [`MAX_READ`]).
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
        if buf.len() > MAX_READ {
            return Err(Error::Request(format!(
                "a read of {} bytes (at most {MAX_READ})",
                buf.len()
            )));
        }
        self.check_range(offset, buf.len() as u64)?;
        let cookie = self.send_request(CMD_READ, offset, buf.len() as u32)?;
        let result = self.read_reply(cookie, offset, buf);
        self.mark_if_broken(&result);
        result
    }

    fn read_reply(&mut self, cookie: u64, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
        let mut failure = None;
        self.covered.clear();
        let length = buf.len() as u64;
        for _ in 0..MAX_CHUNKS_PER_REPLY {
            let Some(chunk) = self.chunk_header(cookie, "read", offset, &mut failure)? else {
                return failure.map_or_else(|| self.check_covered(length), Err);
            };
            match chunk.kind {
                REPLY_TYPE_OFFSET_DATA => {
                    if chunk.length <= 8 {
                        return Err(Error::protocol("a data chunk without data"));
                    }
                    let at = read_u64(&mut self.stream)?;
                    let len = u64::from(chunk.length - 8);
                    let start = chunk_start(at, len, offset, length)?;
                    self.stream
                        .read_exact(&mut buf[start as usize..(start + len) as usize])?;
                    self.cover(start, len)?;
                }
                REPLY_TYPE_OFFSET_HOLE => {
                    if chunk.length != 12 {
                        return Err(Error::protocol("a hole chunk that is not 12 bytes"));
                    }
                    let at = read_u64(&mut self.stream)?;
                    let len = u64::from(read_u32(&mut self.stream)?);
                    if len == 0 {
                        return Err(Error::protocol("a hole chunk of 0 bytes"));
                    }
                    let start = chunk_start(at, len, offset, length)?;
                    buf[start as usize..(start + len) as usize].fill(0);
                    self.cover(start, len)?;
                }
                _ => self.unexpected_chunk(&chunk)?,
            }
            if chunk.done {
                return failure.map_or_else(|| self.check_covered(length), Err);
            }
        }
        Err(too_many_chunks())
    }

    fn cover(&mut self, start: u64, len: u64) -> Result<(), Error> {
        if self.covered.len() >= MAX_CHUNKS_PER_REPLY {
            return Err(too_many_chunks());
        }
        self.covered.push((start, len));
        Ok(())
    }

    /// A successful READ reply covers every requested byte exactly once.
    fn check_covered(&mut self, length: u64) -> Result<(), Error> {
        self.covered.sort_unstable();
        let mut next = 0;
        for &(start, len) in &self.covered {
            if start != next {
                let what = if start < next {
                    "overlapping"
                } else {
                    "missing"
                };
                return Err(Error::protocol(format!(
                    "a read reply with {what} bytes at {next} of {length}"
                )));
            }
            next = start + len;
        }
        if next != length {
            return Err(Error::protocol(format!(
                "a read reply that covers {next} of {length} bytes"
            )));
        }
        Ok(())
    }

    /// The next chunk's header, or `None` when a simple reply ended the request (its error,
    /// if any, stored in `failure`). Error chunks are read whole and stored in `failure`.
    fn chunk_header(
        &mut self,
        cookie: u64,
        command: &'static str,
        offset: u64,
        failure: &mut Option<Error>,
    ) -> Result<Option<Chunk>, Error> {
        for _ in 0..MAX_CHUNKS_PER_REPLY {
            let r = &mut self.stream;
            let magic = read_u32(r)?;
            if magic == SIMPLE_REPLY_MAGIC {
                let errno = read_u32(r)?;
                check_cookie(read_u64(r)?, cookie)?;
                if errno == 0 {
                    return Err(Error::protocol(format!(
                        "a simple reply to {command} after structured replies were agreed"
                    )));
                }
                *failure = Some(Error::Command {
                    command,
                    offset,
                    reason: nbd_errno_name(errno),
                });
                return Ok(None);
            }
            if magic != STRUCTURED_REPLY_MAGIC {
                return Err(Error::protocol(format!("a reply with magic {magic:#x}")));
            }
            let flags = read_u16(r)?;
            let kind = read_u16(r)?;
            check_cookie(read_u64(r)?, cookie)?;
            let length = read_u32(r)?;
            let chunk = Chunk {
                done: flags & REPLY_FLAG_DONE != 0,
                kind,
                length,
            };
            if kind & REPLY_TYPE_ERROR_BIT == 0 {
                return Ok(Some(chunk));
            }
            let payload = read_bounded(r, length.into(), MAX_ERROR_MESSAGE + 14, "an error chunk")?;
            let mut f = Fields::new(&payload);
            let errno = f.u32("an error chunk")?;
            let msg_len = f.u16("an error chunk")?;
            let message = String::from_utf8_lossy(f.take(msg_len.into(), "an error message")?);
            let at = if kind == REPLY_TYPE_ERROR_OFFSET {
                f.u64("an error chunk's offset")?
            } else {
                offset
            };
            let mut reason = nbd_errno_name(errno);
            if !message.is_empty() {
                reason = format!("{reason}: {message}");
            }
            failure.get_or_insert(Error::Command {
                command,
                offset: at,
                reason,
            });
            if chunk.done {
                return Ok(None);
            }
        }
        Err(too_many_chunks())
    }

    fn unexpected_chunk(&mut self, chunk: &Chunk) -> Result<(), Error> {
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
}

struct Chunk {
    done: bool,
    kind: u16,
    length: u32,
}

fn check_cookie(got: u64, sent: u64) -> Result<(), Error> {
    if got != sent {
        return Err(Error::protocol(format!(
            "a reply for request {got} while {sent} was waiting"
        )));
    }
    Ok(())
}

/// Where a chunk of `len` bytes at export offset `at` starts in a request for `length`
/// bytes at `offset`, or an error if it is not inside it.
fn chunk_start(at: u64, len: u64, offset: u64, length: u64) -> Result<u64, Error> {
    match at.checked_sub(offset) {
        Some(start) if start <= length && len <= length - start => Ok(start),
        _ => Err(Error::protocol(format!(
            "a chunk of {len} bytes at {at} outside the request ({length} bytes at {offset})"
        ))),
    }
}

fn too_many_chunks() -> Error {
    Error::protocol(format!(
        "more than {MAX_CHUNKS_PER_REPLY} chunks in one reply"
    ))
}
