//! READ, one at a time ([`Client::read`]) or several in flight on one connection
//! ([`Client::send_read`] then [`Client::receive_read`], answered in the order sent), so a
//! server's device has requests queued. Replies may come in any order, their chunks
//! interleaved: each part goes to the read its cookie names, and every read must be covered
//! exactly once.

use super::reply::{no_payload, too_many_chunks, unexpected_chunk, unknown_cookie, ReplyPart};
use super::Client;
use crate::error::nbd_errno_name;
use crate::wire::*;
use crate::{Error, MAX_READ};
use std::io::{BufReader, Read, Write};

/// How many reads may wait for their replies at once.
pub const MAX_READS_IN_FLIGHT: usize = 16;

/// A READ answered in full: `len` bytes at `offset`, at the start of `buf`.
#[derive(Debug)]
pub struct CompletedRead {
    pub offset: u64,
    pub buf: Vec<u8>,
    pub len: usize,
}

/// A READ sent and not yet answered in full.
pub(super) struct PendingRead {
    cookie: u64,
    offset: u64,
    buf: Vec<u8>,
    len: usize,
    state: ReplyState,
    done: bool,
}

/// What the parts of one READ reply said so far.
#[derive(Default)]
pub(super) struct ReplyState {
    /// Ranges (relative to the request) the data and hole chunks covered.
    covered: Vec<(u64, u64)>,
    chunks: usize,
    failure: Option<Error>,
}

impl<S: Read + Write> Client<S> {
    /// Reads `buf.len()` bytes at `offset` (at most [`MAX_READ`]). Refused while reads sent
    /// with [`send_read`](Client::send_read) wait for their replies.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
        self.check_read(offset, buf.len())?;
        if !self.reads.is_empty() {
            return Err(Error::Request(format!(
                "a read while {} others wait for their replies",
                self.reads.len()
            )));
        }
        let cookie = self.send_request(CMD_READ, offset, buf.len() as u32)?;
        let mut state = self.new_reply_state();
        let result = self.read_reply(cookie, offset, buf, &mut state);
        self.mark_if_broken(&result);
        let result = result.and_then(|()| state.finish(buf.len()));
        self.spare_covered.push(state.covered);
        result
    }

    fn read_reply(
        &mut self,
        cookie: u64,
        offset: u64,
        buf: &mut [u8],
        state: &mut ReplyState,
    ) -> Result<(), Error> {
        loop {
            let part = self.next_reply_part()?;
            if part.cookie() != cookie {
                return Err(unknown_cookie(part.cookie()));
            }
            if apply(&mut self.stream, part, offset, buf, state)? {
                return Ok(());
            }
        }
    }

    /// Sends a READ of `len` bytes at `offset` (at most [`MAX_READ`]) into `buf` (at least
    /// `len` long) without waiting for the reply; at most [`MAX_READS_IN_FLIGHT`] at once.
    pub fn send_read(&mut self, offset: u64, buf: Vec<u8>, len: usize) -> Result<(), Error> {
        self.check_read(offset, len)?;
        if buf.len() < len {
            return Err(Error::Request(format!(
                "a read of {len} bytes into a buffer of {}",
                buf.len()
            )));
        }
        if self.reads.len() >= MAX_READS_IN_FLIGHT {
            return Err(Error::Request(format!(
                "more than {MAX_READS_IN_FLIGHT} reads in flight"
            )));
        }
        let sent = self.send_request(CMD_READ, offset, len as u32);
        self.mark_if_broken(&sent);
        let state = self.new_reply_state();
        self.reads.push_back(PendingRead {
            cookie: sent?,
            offset,
            buf,
            len,
            state,
            done: false,
        });
        Ok(())
    }

    /// How many reads sent with [`send_read`](Client::send_read) wait for their replies.
    pub fn reads_in_flight(&self) -> usize {
        self.reads.len()
    }

    /// The oldest read sent with [`send_read`](Client::send_read), once answered in full
    /// (receiving the replies of the others as they come); `None` when none is in flight.
    /// A read the server failed is an error (its buffer is dropped); the others stay in
    /// flight.
    pub fn receive_read(&mut self) -> Result<Option<CompletedRead>, Error> {
        if self.reads.is_empty() {
            return Ok(None);
        }
        self.check_usable()?;
        let received = self.receive_until_oldest_done();
        self.mark_if_broken(&received);
        received?;
        let Some(read) = self.reads.pop_front() else {
            return Ok(None);
        };
        let PendingRead {
            offset,
            buf,
            len,
            mut state,
            ..
        } = read;
        let result = state.finish(len);
        self.spare_covered.push(state.covered);
        result.map(|()| Some(CompletedRead { offset, buf, len }))
    }

    fn receive_until_oldest_done(&mut self) -> Result<(), Error> {
        while self.reads.front().is_some_and(|r| !r.done) {
            let part = self.next_reply_part()?;
            let cookie = part.cookie();
            let Some(read) = self
                .reads
                .iter_mut()
                .find(|r| r.cookie == cookie && !r.done)
            else {
                return Err(unknown_cookie(cookie));
            };
            let buf = &mut read.buf[..read.len];
            read.done = apply(&mut self.stream, part, read.offset, buf, &mut read.state)?;
        }
        Ok(())
    }

    fn check_read(&self, offset: u64, len: usize) -> Result<(), Error> {
        if len > MAX_READ {
            return Err(Error::Request(format!(
                "a read of {len} bytes (at most {MAX_READ})"
            )));
        }
        self.check_range(offset, len as u64)
    }

    fn new_reply_state(&mut self) -> ReplyState {
        let mut covered = self.spare_covered.pop().unwrap_or_default();
        covered.clear();
        ReplyState {
            covered,
            chunks: 0,
            failure: None,
        }
    }
}

/// Applies one part of the reply to the READ of `buf.len()` bytes at `offset` it answers,
/// reading its payload from `stream`; true once that reply ended.
fn apply<S: Read>(
    stream: &mut BufReader<S>,
    part: ReplyPart,
    offset: u64,
    buf: &mut [u8],
    state: &mut ReplyState,
) -> Result<bool, Error> {
    state.chunks += 1;
    if state.chunks > MAX_CHUNKS_PER_REPLY {
        return Err(too_many_chunks());
    }
    let chunk = match part {
        ReplyPart::Simple { errno: 0, .. } => return Err(no_payload()),
        ReplyPart::Simple { errno, .. } => {
            state.failure.get_or_insert(Error::Command {
                command: "read",
                offset,
                reason: nbd_errno_name(errno),
            });
            return Ok(true);
        }
        ReplyPart::Failed {
            done,
            reason,
            offset: at,
            ..
        } => {
            state.failure.get_or_insert(Error::Command {
                command: "read",
                offset: at.unwrap_or(offset),
                reason,
            });
            return Ok(done);
        }
        ReplyPart::Chunk { chunk, .. } => chunk,
    };
    let length = buf.len() as u64;
    match chunk.kind {
        REPLY_TYPE_OFFSET_DATA => {
            if chunk.length <= 8 {
                return Err(Error::protocol("a data chunk without data"));
            }
            let at = read_u64(stream)?;
            let len = u64::from(chunk.length - 8);
            let start = chunk_start(at, len, offset, length)?;
            stream.read_exact(&mut buf[start as usize..(start + len) as usize])?;
            state.covered.push((start, len));
        }
        REPLY_TYPE_OFFSET_HOLE => {
            if chunk.length != 12 {
                return Err(Error::protocol("a hole chunk that is not 12 bytes"));
            }
            let at = read_u64(stream)?;
            let len = u64::from(read_u32(stream)?);
            if len == 0 {
                return Err(Error::protocol("a hole chunk of 0 bytes"));
            }
            let start = chunk_start(at, len, offset, length)?;
            buf[start as usize..(start + len) as usize].fill(0);
            state.covered.push((start, len));
        }
        _ => unexpected_chunk(&chunk)?,
    }
    Ok(chunk.done)
}

impl ReplyState {
    /// The reply's verdict once it ended: the server's error, or every requested byte
    /// covered exactly once.
    fn finish(&mut self, length: usize) -> Result<(), Error> {
        if let Some(failure) = self.failure.take() {
            return Err(failure);
        }
        let length = length as u64;
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
