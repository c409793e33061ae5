//! One connection to one export: the handshake, then READ and BLOCK_STATUS one at a time.
use crate::error::nbd_errno_name;
use crate::uri::{NbdUri, Transport};
use crate::wire::*;
use crate::{Error, MAX_READ};
use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// How long one read or write on the socket may block before the pull fails.
const IO_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest export name this client sends.
const MAX_EXPORT_NAME: usize = 4096;

/// What the server said about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags (`NBD_FLAG_*`).
    pub flags: u16,
}

/// One extent of a block-status reply: `length` bytes with the context's `flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    pub flags: u32,
}

/// A byte stream to a server.
pub trait Connection: Read + Write + Send {}
impl<T: Read + Write + Send> Connection for T {}

/// A negotiated connection to one export.
pub struct Client<S: Read + Write = Box<dyn Connection>> {
    stream: BufReader<S>,
    info: ExportInfo,
    contexts: Vec<(String, u32)>,
    next_cookie: u64,
    /// Ranges (relative to the request) the chunks of the current READ reply covered.
    covered: Vec<(u64, u64)>,
    /// Set once the byte stream lost its framing: later calls fail at once.
    broken: bool,
}

impl Client {
    /// Connects to `uri` and negotiates its export with the metadata `contexts` selected
    /// (each must be offered, or [`Error::NoContext`]).
    pub fn connect(uri: &NbdUri, contexts: &[&str]) -> Result<Client, Error> {
        let stream: Box<dyn Connection> = match &uri.transport {
            Transport::Unix(path) => {
                let s = UnixStream::connect(path).map_err(|source| Error::Connect {
                    address: path.display().to_string(),
                    source,
                })?;
                s.set_read_timeout(Some(IO_TIMEOUT))?;
                s.set_write_timeout(Some(IO_TIMEOUT))?;
                Box::new(s)
            }
            Transport::Tcp(host, port) => {
                let s = TcpStream::connect((host.as_str(), *port)).map_err(|source| {
                    Error::Connect {
                        address: format!("{host}:{port}"),
                        source,
                    }
                })?;
                s.set_read_timeout(Some(IO_TIMEOUT))?;
                s.set_write_timeout(Some(IO_TIMEOUT))?;
                s.set_nodelay(true)?;
                Box::new(s)
            }
        };
        Client::handshake(stream, &uri.export, contexts)
    }
}

impl<S: Read + Write> Client<S> {
    /// Runs the fixed newstyle handshake over `stream`: structured replies, the metadata
    /// `contexts`, then GO on `export`.
    pub fn handshake(stream: S, export: &str, contexts: &[&str]) -> Result<Client<S>, Error> {
        if export.len() > MAX_EXPORT_NAME {
            return Err(Error::Request(format!(
                "the export name is {} bytes long (at most {MAX_EXPORT_NAME})",
                export.len()
            )));
        }
        let mut client = Client {
            stream: BufReader::new(stream),
            info: ExportInfo { size: 0, flags: 0 },
            contexts: Vec::new(),
            next_cookie: 1,
            covered: Vec::new(),
            broken: false,
        };
        client.greeting()?;
        client.structured_replies()?;
        if !contexts.is_empty() {
            client.set_meta_contexts(export, contexts)?;
        }
        client.go(export)?;
        Ok(client)
    }

    /// The export's size and flags.
    pub fn info(&self) -> ExportInfo {
        self.info
    }

    /// The id the server gave a selected metadata context.
    pub fn context_id(&self, name: &str) -> Option<u32> {
        self.contexts
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, id)| id)
    }

    fn greeting(&mut self) -> Result<(), Error> {
        let r = &mut self.stream;
        if read_u64(r)? != NBD_MAGIC {
            return Err(Error::protocol(
                "this is not an NBD server (no NBDMAGIC greeting)",
            ));
        }
        if read_u64(r)? != IHAVEOPT {
            return Err(Error::protocol(
                "the server speaks only oldstyle negotiation, which this client does not",
            ));
        }
        let flags = read_u16(r)?;
        if flags & FLAG_FIXED_NEWSTYLE == 0 {
            return Err(Error::protocol(
                "the server does not offer fixed newstyle negotiation",
            ));
        }
        let client_flags = u32::from(flags & (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
        self.stream
            .get_mut()
            .write_all(&client_flags.to_be_bytes())?;
        Ok(())
    }

    fn send_option(&mut self, option: u32, payload: &[u8]) -> Result<(), Error> {
        let mut msg = Vec::with_capacity(16 + payload.len());
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&option.to_be_bytes());
        msg.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        msg.extend_from_slice(payload);
        self.stream.get_mut().write_all(&msg)?;
        Ok(())
    }

    /// One option reply: its type and payload; an error reply becomes [`Error::Refused`].
    fn option_reply(&mut self, option: u32, name: &'static str) -> Result<(u32, Vec<u8>), Error> {
        let r = &mut self.stream;
        if read_u64(r)? != OPTION_REPLY_MAGIC {
            return Err(Error::protocol("an option reply has a bad magic number"));
        }
        let answered = read_u32(r)?;
        let kind = read_u32(r)?;
        let len = read_u32(r)?;
        let payload = read_bounded(r, len.into(), MAX_OPTION_REPLY, "an option reply")?;
        if answered != option {
            return Err(Error::protocol(format!(
                "a reply to option {answered} came while {name} was asked"
            )));
        }
        if kind & REP_ERR != 0 {
            let message = String::from_utf8_lossy(&payload).into_owned();
            let reason = match (kind & !REP_ERR, message.is_empty()) {
                (1, true) => "not supported".to_string(),
                (2, true) => "forbidden by the server's policy".to_string(),
                (6, true) => "no such export".to_string(),
                (5, _) => {
                    format!("TLS is required, which this client does not speak yet {message}")
                }
                (_, true) => format!("error {}", kind & !REP_ERR),
                (_, false) => message,
            };
            return Err(Error::Refused {
                option: name,
                reason,
            });
        }
        Ok((kind, payload))
    }

    fn structured_replies(&mut self) -> Result<(), Error> {
        self.send_option(OPT_STRUCTURED_REPLY, &[])?;
        let name = "structured replies (needed for block status)";
        match self.option_reply(OPT_STRUCTURED_REPLY, name)? {
            (REP_ACK, _) => Ok(()),
            (kind, _) => Err(Error::protocol(format!(
                "reply type {kind} to the structured-reply option"
            ))),
        }
    }

    fn set_meta_contexts(&mut self, export: &str, contexts: &[&str]) -> Result<(), Error> {
        let mut payload = Vec::new();
        put_string(&mut payload, export);
        payload.extend_from_slice(&(contexts.len() as u32).to_be_bytes());
        for c in contexts {
            put_string(&mut payload, c);
        }
        self.send_option(OPT_SET_META_CONTEXT, &payload)?;
        loop {
            let (kind, reply) = self.option_reply(OPT_SET_META_CONTEXT, "the metadata contexts")?;
            match kind {
                REP_ACK => break,
                REP_META_CONTEXT => {
                    let mut f = Fields::new(&reply);
                    let id = f.u32("a metadata context reply")?;
                    let name = String::from_utf8_lossy(f.rest()).into_owned();
                    if self.contexts.len() >= contexts.len() {
                        return Err(Error::protocol(
                            "more metadata contexts than were asked for",
                        ));
                    }
                    self.contexts.push((name, id));
                }
                other => {
                    return Err(Error::protocol(format!(
                        "reply type {other} to the metadata-context option"
                    )))
                }
            }
        }
        for wanted in contexts {
            if self.context_id(wanted).is_none() {
                return Err(Error::NoContext(wanted.to_string()));
            }
        }
        Ok(())
    }

    fn go(&mut self, export: &str) -> Result<(), Error> {
        let mut payload = Vec::new();
        put_string(&mut payload, export);
        payload.extend_from_slice(&0u16.to_be_bytes());
        self.send_option(OPT_GO, &payload)?;
        let mut info = None;
        loop {
            let (kind, reply) = self.option_reply(OPT_GO, "the export")?;
            match kind {
                REP_ACK => break,
                REP_INFO => {
                    let mut f = Fields::new(&reply);
                    if f.u16("an info reply")? == INFO_EXPORT {
                        let size = f.u64("the export info")?;
                        let flags = f.u16("the export info")?;
                        info = Some(ExportInfo { size, flags });
                    }
                }
                other => {
                    return Err(Error::protocol(format!("reply type {other} to GO")));
                }
            }
        }
        self.info =
            info.ok_or_else(|| Error::protocol("GO succeeded without the export's size"))?;
        if self.info.size > i64::MAX as u64 {
            return Err(Error::protocol(format!(
                "an export size of {} bytes",
                self.info.size
            )));
        }
        Ok(())
    }

    fn send_request(&mut self, command: u16, offset: u64, length: u32) -> Result<u64, Error> {
        if self.broken {
            return Err(Error::protocol(
                "the connection is unusable after an earlier protocol error",
            ));
        }
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let mut msg = [0u8; 28];
        msg[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg[6..8].copy_from_slice(&command.to_be_bytes());
        msg[8..16].copy_from_slice(&cookie.to_be_bytes());
        msg[16..24].copy_from_slice(&offset.to_be_bytes());
        msg[24..28].copy_from_slice(&length.to_be_bytes());
        self.stream.get_mut().write_all(&msg)?;
        Ok(cookie)
    }

    fn check_range(&self, offset: u64, length: u64) -> Result<(), Error> {
        if length == 0
            || offset
                .checked_add(length)
                .is_none_or(|end| end > self.info.size)
        {
            return Err(Error::Request(format!(
                "{length} bytes at offset {offset} are not inside the export ({} bytes)",
                self.info.size
            )));
        }
        Ok(())
    }

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

    fn mark_if_broken<T>(&mut self, result: &Result<T, Error>) {
        if matches!(result, Err(Error::Protocol(_) | Error::Io(_))) {
            self.broken = true;
        }
    }

    /// Says goodbye (NBD_CMD_DISC) so the server logs a clean end.
    pub fn disconnect(mut self) {
        let _ = self.send_request(CMD_DISC, 0, 0);
        let _ = self.stream.get_mut().flush();
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

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}
