//! A small, strict NBD client for the tests: fixed newstyle handshake over a UNIX socket,
//! `NBD_OPT_GO`, simple replies only (structured replies are never negotiated), and the
//! commands READ, WRITE (optionally with FUA), FLUSH and DISC.
//!
//! Requests can be pipelined: `send_*` queue a request under a caller-chosen handle and
//! [`NbdClient::recv_reply`] returns whichever reply comes next. The client remembers every
//! handle in flight (and, for reads, the length asked for) so it can frame read replies and
//! reject replies for handles it never issued. Everything the server sends is checked: magics,
//! handles, a structured reply that was never negotiated, option replies out of order.
//!
//! Socket reads and writes time out (30 s by default) so a stuck server fails a test instead
//! of hanging it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;

/// Options.
pub const OPT_ABORT: u32 = 2;
pub const OPT_GO: u32 = 7;

/// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_INFO: u32 = 3;
pub const REP_FLAG_ERROR: u32 = 1 << 31;

/// Information types (NBD_REP_INFO / NBD_OPT_GO requests).
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Commands and command flags.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_FLAG_FUA: u16 = 1 << 0;

/// NBD error values in replies (errno values as the protocol fixes them).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// The default timeout on every socket read and write.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Why an NBD operation failed.
#[derive(Debug)]
pub enum NbdError {
    /// The socket failed (including timeouts and the server closing the connection).
    Io(io::Error),
    /// The server answered an option with an error reply (`reply` has bit 31 set).
    OptionRejected {
        option: u32,
        reply: u32,
        message: String,
    },
    /// The server broke the protocol, or the caller asked for something the export forbids.
    Protocol(String),
}

impl NbdError {
    /// The name of an option error reply type, as the protocol document spells it.
    pub fn rep_err_name(reply: u32) -> &'static str {
        match reply {
            x if x == REP_FLAG_ERROR | 1 => "NBD_REP_ERR_UNSUP",
            x if x == REP_FLAG_ERROR | 2 => "NBD_REP_ERR_POLICY",
            x if x == REP_FLAG_ERROR | 3 => "NBD_REP_ERR_INVALID",
            x if x == REP_FLAG_ERROR | 4 => "NBD_REP_ERR_PLATFORM",
            x if x == REP_FLAG_ERROR | 5 => "NBD_REP_ERR_TLS_REQD",
            x if x == REP_FLAG_ERROR | 6 => "NBD_REP_ERR_UNKNOWN",
            x if x == REP_FLAG_ERROR | 7 => "NBD_REP_ERR_SHUTDOWN",
            x if x == REP_FLAG_ERROR | 8 => "NBD_REP_ERR_BLOCK_SIZE_REQD",
            x if x == REP_FLAG_ERROR | 9 => "NBD_REP_ERR_TOO_BIG",
            x if x == REP_FLAG_ERROR | 10 => "NBD_REP_ERR_EXT_HEADER_REQD",
            _ => "unknown NBD_REP_ERR",
        }
    }

    /// Whether this is the connection going away (EOF, reset, broken pipe): what a client sees
    /// when the server is killed.
    pub fn is_disconnect(&self) -> bool {
        match self {
            NbdError::Io(e) => matches!(
                e.kind(),
                io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            ),
            _ => false,
        }
    }
}

impl fmt::Display for NbdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NbdError::Io(e) => write!(f, "NBD socket: {e}"),
            NbdError::OptionRejected {
                option,
                reply,
                message,
            } => write!(
                f,
                "NBD option {option} rejected with {} ({reply:#x}): {message:?}",
                Self::rep_err_name(*reply)
            ),
            NbdError::Protocol(m) => write!(f, "NBD protocol: {m}"),
        }
    }
}

impl std::error::Error for NbdError {}

impl From<io::Error> for NbdError {
    fn from(e: io::Error) -> Self {
        NbdError::Io(e)
    }
}

pub type Result<T> = std::result::Result<T, NbdError>;

fn protocol<T>(msg: impl Into<String>) -> Result<T> {
    Err(NbdError::Protocol(msg.into()))
}

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
    /// Connects to `socket` and negotiates export `name` with the default timeout.
    pub fn connect(socket: &Path, name: &str) -> Result<NbdClient> {
        Self::connect_with_timeout(socket, name, DEFAULT_TIMEOUT)
    }

    pub fn connect_with_timeout(socket: &Path, name: &str, timeout: Duration) -> Result<NbdClient> {
        let stream = UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Self::handshake(stream, name)
    }

    /// Fixed newstyle handshake, then NBD_OPT_GO for `name`.
    pub fn handshake(mut stream: UnixStream, name: &str) -> Result<NbdClient> {
        let magic = read_u64(&mut stream)?;
        if magic != NBDMAGIC {
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
        let client_flags = u32::from(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        stream.write_all(&client_flags.to_be_bytes())?;

        // NBD_OPT_GO: name, and a request for NBD_INFO_BLOCK_SIZE.
        let name_len = u32::try_from(name.len()).expect("export name length");
        let mut data = Vec::with_capacity(8 + name.len());
        data.extend_from_slice(&name_len.to_be_bytes());
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&1u16.to_be_bytes());
        data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        send_option(&mut stream, OPT_GO, &data)?;

        let mut size_flags: Option<(u64, u16)> = None;
        let mut block_size = None;
        loop {
            let (reply, payload) = recv_option_reply(&mut stream, OPT_GO)?;
            if reply & REP_FLAG_ERROR != 0 {
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
        kind: u16,
        handle: u64,
        offset: u64,
        len: u32,
        data: &[u8],
    ) -> Result<()> {
        let mut buf = Vec::with_capacity(28 + data.len());
        buf.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        buf.extend_from_slice(&flags.to_be_bytes());
        buf.extend_from_slice(&kind.to_be_bytes());
        buf.extend_from_slice(&handle.to_be_bytes());
        buf.extend_from_slice(&offset.to_be_bytes());
        buf.extend_from_slice(&len.to_be_bytes());
        buf.extend_from_slice(data);
        self.stream.write_all(&buf)?;
        Ok(())
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

/// Sends NBD_OPT_ABORT on a fresh connection after the handshake flags (used to check that a
/// server is up without attaching an export).
pub fn probe(socket: &Path) -> Result<u16> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(DEFAULT_TIMEOUT))?;
    stream.set_write_timeout(Some(DEFAULT_TIMEOUT))?;
    if read_u64(&mut stream)? != NBDMAGIC || read_u64(&mut stream)? != IHAVEOPT {
        return protocol("not a newstyle NBD server");
    }
    let flags = read_u16(&mut stream)?;
    stream.write_all(&u32::from(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes())?;
    send_option(&mut stream, OPT_ABORT, &[])?;
    // The server may acknowledge the abort or just close; either is fine.
    let _ = recv_option_reply(&mut stream, OPT_ABORT);
    Ok(flags)
}

fn send_option(stream: &mut UnixStream, option: u32, data: &[u8]) -> Result<()> {
    let mut buf = Vec::with_capacity(16 + data.len());
    buf.extend_from_slice(&IHAVEOPT.to_be_bytes());
    buf.extend_from_slice(&option.to_be_bytes());
    buf.extend_from_slice(&(data.len() as u32).to_be_bytes());
    buf.extend_from_slice(data);
    stream.write_all(&buf)?;
    Ok(())
}

/// One option reply: (reply type, payload).
fn recv_option_reply(stream: &mut UnixStream, option: u32) -> Result<(u32, Vec<u8>)> {
    let magic = read_u64(stream)?;
    if magic != OPT_REPLY_MAGIC {
        return protocol(format!("bad option reply magic {magic:#x}"));
    }
    let opt = read_u32(stream)?;
    if opt != option {
        return protocol(format!(
            "reply for option {opt} while waiting for option {option}"
        ));
    }
    let reply = read_u32(stream)?;
    let len = read_u32(stream)?;
    if len > 64 * 1024 {
        return protocol(format!("option reply of {len} bytes"));
    }
    let mut payload = vec![0u8; len as usize];
    stream.read_exact(&mut payload)?;
    Ok((reply, payload))
}

fn read_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}
