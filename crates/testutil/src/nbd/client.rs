//! A small, strict NBD client: fixed newstyle handshake over a UNIX socket, `NBD_OPT_GO`,
//! simple replies only (structured replies are never negotiated), and the commands READ,
//! WRITE (optionally with FUA), FLUSH and DISC.
//!
//! Requests can be pipelined: `send_*` queue a request under a caller-chosen handle and
//! [`NbdClient::recv_reply`] returns whichever reply comes next. The client remembers every
//! handle in flight (and, for reads, the length asked for) so it can frame read replies and
//! reject replies for handles it never issued. Everything the server sends is checked: magics,
//! handles, a structured reply that was never negotiated, option replies out of order.
//!
//! Socket reads and writes time out (30 s) so a stuck server fails a test instead of hanging it.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use cryptblk_nbd::protocol::*;

use super::error::protocol;
use super::{
    read_option_reply, read_u16, read_u32, read_u64, write_option, write_request, NbdError, Result,
};

/// The timeout on every socket read and write.
const TIMEOUT: Duration = Duration::from_secs(30);

/// What NBD_OPT_GO told about the export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    pub flags: u16,
    /// (minimum, preferred, maximum payload) when the server sent NBD_INFO_BLOCK_SIZE.
    pub block_size: Option<(u32, u32, u32)>,
    /// The server's handshake flags.
    pub handshake_flags: u16,
}

impl ExportInfo {
    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }

    /// The minimum block size (1 when the server did not send one).
    pub fn min_block(&self) -> u32 {
        self.block_size.map_or(1, |b| b.0)
    }

    /// The largest payload of one request (32 MiB when the server did not say, as the
    /// protocol recommends).
    pub fn max_payload(&self) -> u32 {
        self.block_size.map_or(32 << 20, |b| b.2)
    }
}

/// A request in flight.
#[derive(Debug, Clone, Copy)]
enum Pending {
    Read(u32),
    Write,
    Flush,
}

/// One NBD connection in the transmission phase.
#[derive(Debug)]
pub struct NbdClient {
    stream: UnixStream,
    pub export: ExportInfo,
    in_flight: HashMap<u64, Pending>,
    next_handle: u64,
}

impl NbdClient {
    /// Connects to `socket` and negotiates export `name`; socket reads and writes time out
    /// after 30 s, so a stuck server fails the test instead of hanging it.
    pub fn connect(socket: &Path, name: &str) -> Result<NbdClient> {
        let stream = UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(TIMEOUT))?;
        stream.set_write_timeout(Some(TIMEOUT))?;
        Self::handshake(stream, name)
    }

    /// Fixed newstyle handshake, then NBD_OPT_GO for `name`.
    fn handshake(mut stream: UnixStream, name: &str) -> Result<NbdClient> {
        let magic = read_u64(&mut stream)?;
        if magic != NBD_MAGIC {
            return protocol(format!("bad server magic {magic:#x}"));
        }
        let opt = read_u64(&mut stream)?;
        if opt != IHAVEOPT {
            return protocol(format!(
                "server is not newstyle (magic {opt:#x} instead of IHAVEOPT)"
            ));
        }
        let handshake_flags = read_u16(&mut stream)?;
        if handshake_flags & FLAG_FIXED_NEWSTYLE == 0 {
            return protocol(format!(
                "server does not offer FIXED_NEWSTYLE (handshake flags {handshake_flags:#x})"
            ));
        }
        if handshake_flags & FLAG_NO_ZEROES == 0 {
            return protocol(format!(
                "server does not offer NO_ZEROES (handshake flags {handshake_flags:#x})"
            ));
        }
        let client_flags = CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES;
        stream.write_all(&client_flags.to_be_bytes())?;

        // NBD_OPT_GO: name, and a request for NBD_INFO_BLOCK_SIZE.
        let name_len = u32::try_from(name.len()).expect("export name length");
        let mut data = Vec::with_capacity(8 + name.len());
        data.extend_from_slice(&name_len.to_be_bytes());
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&1u16.to_be_bytes());
        data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        write_option(&mut stream, OPT_GO, &data)?;

        let mut size_flags: Option<(u64, u16)> = None;
        let mut block_size = None;
        loop {
            let (option, reply, payload) = read_option_reply(&mut stream)?;
            if option != OPT_GO {
                return protocol(format!(
                    "reply for option {option} while waiting for option {OPT_GO}"
                ));
            }
            if reply & REP_ERR != 0 {
                return Err(NbdError::OptionRejected {
                    option: OPT_GO,
                    reply,
                    message: String::from_utf8_lossy(&payload).into_owned(),
                });
            }
            match reply {
                REP_INFO => {
                    if payload.len() < 2 {
                        return protocol("NBD_REP_INFO shorter than its type");
                    }
                    let info = u16::from_be_bytes([payload[0], payload[1]]);
                    let body = &payload[2..];
                    match info {
                        INFO_EXPORT => {
                            if body.len() != 10 {
                                return protocol(format!(
                                    "NBD_INFO_EXPORT of {} bytes (expected 12)",
                                    payload.len()
                                ));
                            }
                            let size = u64::from_be_bytes(body[..8].try_into().unwrap());
                            let flags = u16::from_be_bytes([body[8], body[9]]);
                            if flags & TFLAG_HAS_FLAGS == 0 {
                                return protocol(format!(
                                    "transmission flags {flags:#x} lack NBD_FLAG_HAS_FLAGS"
                                ));
                            }
                            size_flags = Some((size, flags));
                        }
                        INFO_BLOCK_SIZE => {
                            if body.len() != 12 {
                                return protocol(format!(
                                    "NBD_INFO_BLOCK_SIZE of {} bytes (expected 14)",
                                    payload.len()
                                ));
                            }
                            let min = u32::from_be_bytes(body[0..4].try_into().unwrap());
                            let pref = u32::from_be_bytes(body[4..8].try_into().unwrap());
                            let max = u32::from_be_bytes(body[8..12].try_into().unwrap());
                            if !min.is_power_of_two()
                                || min > 64 * 1024
                                || !pref.is_power_of_two()
                                || pref < min
                                || (!max.is_multiple_of(min) && max != u32::MAX)
                            {
                                return protocol(format!(
                                    "NBD_INFO_BLOCK_SIZE min {min} preferred {pref} max {max} \
                                     breaks the protocol's constraints"
                                ));
                            }
                            block_size = Some((min, pref, max));
                        }
                        // Name and description are informational; unknown types are ignored
                        // as the protocol requires.
                        _ => {}
                    }
                }
                REP_ACK => {
                    if !payload.is_empty() {
                        return protocol("NBD_REP_ACK with a payload");
                    }
                    let Some((size, flags)) = size_flags else {
                        return protocol("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT");
                    };
                    return Ok(NbdClient {
                        stream,
                        export: ExportInfo {
                            size,
                            flags,
                            block_size,
                            handshake_flags,
                        },
                        in_flight: HashMap::new(),
                        next_handle: 1 << 48,
                    });
                }
                other => return protocol(format!("unexpected reply type {other} to NBD_OPT_GO")),
            }
        }
    }

    /// Handles of the requests still waiting for a reply.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    fn check_range(&self, what: &str, offset: u64, len: u64) -> Result<()> {
        let min = u64::from(self.export.min_block());
        if len == 0 {
            return protocol(format!("{what} of length 0"));
        }
        if !offset.is_multiple_of(min) || !len.is_multiple_of(min) {
            return protocol(format!(
                "{what} at {offset}+{len} is not aligned to the minimum block size {min}"
            ));
        }
        if len > u64::from(self.export.max_payload()) {
            return protocol(format!(
                "{what} of {len} bytes is above the maximum payload {}",
                self.export.max_payload()
            ));
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.export.size)
        {
            return protocol(format!(
                "{what} at {offset}+{len} beyond the export size {}",
                self.export.size
            ));
        }
        Ok(())
    }

    fn register(&mut self, handle: u64, pending: Pending) -> Result<()> {
        if self.in_flight.contains_key(&handle) {
            return protocol(format!("handle {handle:#x} is already in flight"));
        }
        self.in_flight.insert(handle, pending);
        Ok(())
    }

    fn send_request(
        &mut self,
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        length: u32,
        data: &[u8],
    ) -> Result<()> {
        let header = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        Ok(write_request(&mut self.stream, &header, data)?)
    }

    /// Sends NBD_CMD_WRITE of `data` at `offset` (with NBD_CMD_FLAG_FUA when `fua`).
    pub fn send_write(&mut self, handle: u64, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        if self.export.has(TFLAG_READ_ONLY) {
            return protocol("write to a read-only export");
        }
        if fua && !self.export.has(TFLAG_SEND_FUA) {
            return protocol("FUA requested but the export does not offer NBD_FLAG_SEND_FUA");
        }
        self.check_range("write", offset, data.len() as u64)?;
        self.register(handle, Pending::Write)?;
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        self.send_request(flags, CMD_WRITE, handle, offset, data.len() as u32, data)
    }

    /// Sends NBD_CMD_READ of `len` bytes at `offset`.
    pub fn send_read(&mut self, handle: u64, offset: u64, len: u32) -> Result<()> {
        self.check_range("read", offset, u64::from(len))?;
        self.register(handle, Pending::Read(len))?;
        self.send_request(0, CMD_READ, handle, offset, len, &[])
    }

    /// Sends NBD_CMD_FLUSH.
    pub fn send_flush(&mut self, handle: u64) -> Result<()> {
        if !self.export.has(TFLAG_SEND_FLUSH) {
            return protocol("flush, but the export does not offer NBD_FLAG_SEND_FLUSH");
        }
        self.register(handle, Pending::Flush)?;
        self.send_request(0, CMD_FLUSH, handle, 0, 0, &[])
    }

    /// The next reply: (handle, error, data). `data` is `Some` exactly for a successful read.
    pub fn recv_reply(&mut self) -> Result<(u64, u32, Option<Vec<u8>>)> {
        let magic = read_u32(&mut self.stream)?;
        if magic == STRUCTURED_REPLY_MAGIC {
            return protocol("structured reply, but structured replies were never negotiated");
        }
        if magic != SIMPLE_REPLY_MAGIC {
            return protocol(format!("bad reply magic {magic:#x}"));
        }
        let error = read_u32(&mut self.stream)?;
        let handle = read_u64(&mut self.stream)?;
        let Some(pending) = self.in_flight.remove(&handle) else {
            return protocol(format!(
                "reply (error {error}) for handle {handle:#x}, which is not in flight"
            ));
        };
        match pending {
            Pending::Read(len) if error == 0 => {
                let mut data = vec![0u8; len as usize];
                self.stream.read_exact(&mut data)?;
                Ok((handle, error, Some(data)))
            }
            _ => Ok((handle, error, None)),
        }
    }

    fn fresh_handle(&mut self) -> u64 {
        loop {
            self.next_handle = self.next_handle.wrapping_add(1);
            if !self.in_flight.contains_key(&self.next_handle) {
                return self.next_handle;
            }
        }
    }

    /// Waits for the reply to `handle`; fails on any other reply first.
    fn wait_for(&mut self, handle: u64, what: &str) -> Result<Option<Vec<u8>>> {
        let (h, error, data) = self.recv_reply()?;
        if h != handle {
            return protocol(format!(
                "{what}: expected the reply to handle {handle:#x}, got {h:#x}"
            ));
        }
        if error != 0 {
            return protocol(format!("{what} failed with NBD error {error}"));
        }
        Ok(data)
    }

    /// A synchronous read (no other request may be in flight).
    pub fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>> {
        let h = self.fresh_handle();
        self.send_read(h, offset, len)?;
        let data = self.wait_for(h, &format!("read at {offset}+{len}"))?;
        Ok(data.expect("a successful read carries data"))
    }

    /// Reads `len` bytes at `offset` in requests of at most `chunk` bytes, `depth` of them in
    /// flight at a time.
    pub fn read_range(
        &mut self,
        offset: u64,
        len: u64,
        chunk: u32,
        depth: usize,
    ) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len as usize];
        let mut offsets: HashMap<u64, u64> = HashMap::new();
        let mut next = 0u64;
        while next < len || !offsets.is_empty() {
            while next < len && offsets.len() < depth {
                let n = u64::from(chunk).min(len - next);
                let h = self.fresh_handle();
                self.send_read(h, offset + next, n as u32)?;
                offsets.insert(h, next);
                next += n;
            }
            let (h, error, data) = self.recv_reply()?;
            let Some(at) = offsets.remove(&h) else {
                return protocol(format!("reply to unexpected handle {h:#x}"));
            };
            if error != 0 {
                return protocol(format!(
                    "read at {} failed with NBD error {error}",
                    offset + at
                ));
            }
            let data = data.expect("a successful read carries data");
            out[at as usize..at as usize + data.len()].copy_from_slice(&data);
        }
        Ok(out)
    }

    /// A synchronous write (no other request may be in flight).
    pub fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let h = self.fresh_handle();
        self.send_write(h, offset, data, fua)?;
        self.wait_for(h, &format!("write at {offset}+{}", data.len()))?;
        Ok(())
    }

    /// A synchronous flush (no other request may be in flight).
    pub fn flush(&mut self) -> Result<()> {
        let h = self.fresh_handle();
        self.send_flush(h)?;
        self.wait_for(h, "flush")?;
        Ok(())
    }

    /// Sends NBD_CMD_DISC (no reply) and waits for the server to close the connection.
    pub fn disconnect(mut self) -> Result<()> {
        if !self.in_flight.is_empty() {
            return protocol(format!(
                "disconnect with {} requests still in flight",
                self.in_flight.len()
            ));
        }
        let h = self.fresh_handle();
        self.send_request(0, CMD_DISC, h, 0, 0, &[])?;
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        let mut rest = Vec::new();
        match self.stream.read_to_end(&mut rest) {
            Ok(_) if rest.is_empty() => Ok(()),
            Ok(_) => protocol(format!(
                "{} bytes from the server after NBD_CMD_DISC",
                rest.len()
            )),
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}
