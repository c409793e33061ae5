//! The transmission phase: reading requests, running them against the device, replying.
//!
//! Plain connections are served by a reader thread (the connection thread) plus a small set
//! of worker threads. The reader parses requests and reads WRITE payloads into pooled
//! buffers. While the device is fast (page cache, tmpfs: almost every request done in well
//! under 100 µs) and no worker is busy, the reader runs each request itself and sends the
//! replies of a burst of pipelined requests in one `write`: handing a 2 µs request to another
//! thread would cost more than the request. Such a write whose payload already sits whole in
//! the reader's buffer runs from there, without copying it into a payload buffer. Once the
//! device is mostly slow, and always for FLUSH and FUA writes, requests go to the workers,
//! which do the synchronous device I/O in parallel and write each reply with a single `write`
//! under the writer lock. NBD replies carry the request's cookie, so they may complete in any
//! order, which lets one connection keep many requests (fio's iodepth) in flight on the
//! device. Payload bytes in flight are capped per connection by blocking the reader.
//!
//! TLS connections are served sequentially on the connection thread: a rustls stream is one
//! state machine that cannot be split into independent read and write halves without a lock
//! around every record, and correctness comes first there.

use crate::export::Export;
use crate::handshake::Negotiated;
use crate::protocol::*;
use crate::socket::{Socket, Transport};
use crate::Error;
use crossbeam_channel::{Receiver, Sender};
use cryptblk_block::{BlockError, BlockErrorKind, ExtentKind, IoKind};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Tunables of the transmission phase.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnectionConfig {
    /// Worker threads per (plain) connection; 0 runs every request on the reader.
    pub workers: usize,
    /// A client that stays silent this long in the middle of a request, or does not take
    /// replies for this long, is disconnected. Idle time between requests is unlimited.
    pub io_timeout: Duration,
    /// Payload bytes of requests in flight on one connection before the reader waits.
    pub max_in_flight_bytes: u64,
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        ConnectionConfig {
            workers: (2 * cores).clamp(4, 16),
            io_timeout: Duration::from_secs(30),
            max_in_flight_bytes: 64 << 20,
        }
    }
}

/// The largest chunk WRITE_ZEROES writes at once; static so zeroing never allocates.
const ZERO_CHUNK_LEN: usize = 1 << 20;
static ZERO_CHUNK: [u8; ZERO_CHUNK_LEN] = [0; ZERO_CHUNK_LEN];
/// Bounds the BLOCK_STATUS reply (8 bytes per extent) for a badly fragmented file.
const MAX_STATUS_DESCRIPTORS: usize = 1024;
/// Reader buffer: large enough to take a burst of queued 4 KiB writes in one `read`.
const READ_BUFFER_LEN: usize = 256 << 10;
/// Pooled buffers above this size are freed instead of kept, so one 32 MiB request does not
/// pin 32 MiB per pooled buffer for the rest of the connection.
const MAX_POOLED_BUFFER: usize = 1 << 20;
/// What an idle connection keeps in pooled payload buffers at most.
const MAX_POOLED_BYTES: usize = 8 << 20;
/// The reader runs requests itself while no worker is busy and at most `MAX_SLOW_FOR_INLINE`
/// of the last 32 requests took longer than `SLOW_REQUEST`: for page-cached or tmpfs-backed
/// images, handing a request to another thread costs more than the I/O itself. Devices that
/// are mostly slow (cache misses on a real disk) get the workers' parallelism. Counting slow
/// requests rather than averaging their times keeps an occasional preemption of the reader
/// on a busy machine from flipping the mode.
const SLOW_REQUEST: Duration = Duration::from_micros(100);
const MAX_SLOW_FOR_INLINE: u32 = 8;
/// Inline replies larger than this are written directly instead of being copied into the
/// batch.
const INLINE_BATCH_LIMIT: usize = 16 << 10;
/// Batched inline replies are sent once they reach this size, so a client pipelining
/// thousands of small reads cannot make the batch grow without bound.
const INLINE_BATCH_MAX: usize = 256 << 10;
/// Requests queued for workers beyond those being worked on.
const JOB_QUEUE_LEN: usize = 256;

/// (minimum, preferred, maximum) for NBD_INFO_BLOCK_SIZE.
pub(crate) fn block_size_limits(export: &Export) -> (u32, u32, u32) {
    let minimum = export.device.logical_block_size().max(1);
    (minimum, minimum.max(4096), MAX_PAYLOAD)
}

fn is_read_only(export: &Export) -> bool {
    export.read_only || export.device.read_only()
}

/// Whether the device implements discard: a zero-length discard succeeds exactly on devices
/// that do (the trait's default refuses every discard as unsupported).
fn supports_trim(export: &Export) -> bool {
    !is_read_only(export) && export.device.discard(0, 0).is_ok()
}

pub(crate) fn transmission_flags(export: &Export, structured_replies: bool) -> u16 {
    // CAN_MULTI_CONN is safe: every connection to an export shares one device, and FLUSH is
    // fdatasync of the shared file, so a flush on any connection covers writes completed on
    // all of them.
    let mut flags = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_SEND_WRITE_ZEROES
        | TFLAG_CAN_MULTI_CONN;
    if is_read_only(export) {
        flags |= TFLAG_READ_ONLY;
    }
    if supports_trim(export) {
        flags |= TFLAG_SEND_TRIM;
    }
    // Reads are always answered in one chunk, so "don't fragment" costs nothing.
    if structured_replies {
        flags |= TFLAG_SEND_DF;
    }
    flags
}

/// What one connection may do, fixed at the end of the handshake.
pub(crate) struct Session<'a> {
    pub export: &'a Export,
    pub size: u64,
    pub min_block: u32,
    pub read_only: bool,
    pub can_trim: bool,
    pub structured_replies: bool,
    pub base_allocation: bool,
    /// Set once anything was written, so the device is flushed when the connection ends.
    pub wrote: AtomicBool,
}

impl<'a> Session<'a> {
    pub(crate) fn new(export: &'a Export, structured_replies: bool, base_allocation: bool) -> Self {
        Session {
            export,
            size: export.device.size(),
            min_block: block_size_limits(export).0,
            read_only: is_read_only(export),
            can_trim: supports_trim(export),
            structured_replies,
            base_allocation,
            wrote: AtomicBool::new(false),
        }
    }
}

/// Checks a request against the export and what was negotiated, before any I/O.
pub(crate) fn check_request(
    session: &Session<'_>,
    request: &RequestHeader,
) -> Result<(), NbdErrno> {
    let allowed_flags = match request.command {
        CMD_READ => CMD_FLAG_FUA | CMD_FLAG_DF,
        CMD_WRITE | CMD_TRIM => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        CMD_FLUSH => CMD_FLAG_FUA,
        CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
        // CACHE and anything unknown were never advertised.
        _ => return Err(NbdErrno::Inval),
    };
    if request.flags & !allowed_flags != 0 {
        return Err(NbdErrno::Inval);
    }
    let modifies = matches!(request.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if modifies && session.read_only {
        return Err(NbdErrno::Perm);
    }
    match request.command {
        CMD_FLUSH => return Ok(()),
        CMD_TRIM if !session.can_trim => return Err(NbdErrno::Inval),
        CMD_BLOCK_STATUS => {
            if !session.base_allocation || request.length == 0 || request.offset >= session.size {
                return Err(NbdErrno::Inval);
            }
            return Ok(());
        }
        CMD_READ | CMD_WRITE if request.length > MAX_PAYLOAD => return Err(NbdErrno::Inval),
        _ => {}
    }
    let in_range = request
        .offset
        .checked_add(u64::from(request.length))
        .is_some_and(|end| end <= session.size);
    if !in_range {
        // The spec asks for ENOSPC on writes past the end, EINVAL otherwise.
        return Err(if modifies {
            NbdErrno::NoSpc
        } else {
            NbdErrno::Inval
        });
    }
    let block = u64::from(session.min_block);
    if !request.offset.is_multiple_of(block) || !u64::from(request.length).is_multiple_of(block) {
        return Err(NbdErrno::Inval);
    }
    Ok(())
}

fn errno_of(error: &BlockError, modifies: bool) -> NbdErrno {
    match error.kind() {
        BlockErrorKind::OutOfRange if modifies => NbdErrno::NoSpc,
        BlockErrorKind::OutOfRange | BlockErrorKind::Unaligned => NbdErrno::Inval,
        BlockErrorKind::ReadOnly => NbdErrno::Perm,
        BlockErrorKind::Unsupported => NbdErrno::NotSup,
        _ => {
            let os_error = std::error::Error::source(error)
                .and_then(|source| source.downcast_ref::<io::Error>())
                .and_then(io::Error::raw_os_error);
            match os_error {
                Some(code) if code == 28 /* ENOSPC */ || code == 122 /* EDQUOT */ => {
                    NbdErrno::NoSpc
                }
                Some(12 /* ENOMEM */) => NbdErrno::NoMem,
                Some(95 /* EOPNOTSUPP */) => NbdErrno::NotSup,
                _ => NbdErrno::Io,
            }
        }
    }
}

fn io_kind(command: u16) -> IoKind {
    match command {
        CMD_READ => IoKind::Read,
        CMD_WRITE | CMD_WRITE_ZEROES => IoKind::Write,
        CMD_FLUSH => IoKind::Flush,
        CMD_TRIM => IoKind::Discard,
        _ => IoKind::Other,
    }
}

/// A reusable buffer whose valid prefix is `len` bytes; the allocation behind it only grows,
/// so reuse never pays for zero-filling again.
#[derive(Default)]
pub(crate) struct ReplyBuffer {
    data: Vec<u8>,
    len: usize,
}

impl ReplyBuffer {
    fn prepare(&mut self, len: usize) -> &mut [u8] {
        if self.data.len() < len {
            self.data.resize(len, 0);
        }
        self.len = len;
        &mut self.data[..len]
    }

    fn set(&mut self, parts: &[&[u8]]) {
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
}

/// Writes a reply that carries no data.
fn reply_status(
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

/// Checks and runs a request, leaving its complete reply in `out`. Returns
/// whether it succeeded (for the statistics).
pub(crate) fn execute(
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
        tracing::warn!(export = %session.export.name, "request failed: {error}");
        errno_of(&error, modifies)
    };
    if modifies {
        session.wrote.store(true, Ordering::Relaxed);
    }
    match request.command {
        CMD_READ => {
            let header_len = if session.structured_replies {
                STRUCTURED_REPLY_HEADER_LEN + 8
            } else {
                SIMPLE_REPLY_HEADER_LEN
            };
            let buffer = out.prepare(header_len + length);
            device
                .read_at(&mut buffer[header_len..], offset)
                .map_err(fail)?;
            if session.structured_replies {
                buffer[..STRUCTURED_REPLY_HEADER_LEN].copy_from_slice(
                    &encode_structured_reply_header(
                        REPLY_FLAG_DONE,
                        REPLY_TYPE_OFFSET_DATA,
                        request.cookie,
                        8 + request.length,
                    ),
                );
                buffer[STRUCTURED_REPLY_HEADER_LEN..header_len]
                    .copy_from_slice(&offset.to_be_bytes());
            } else {
                buffer[..header_len].copy_from_slice(&encode_simple_reply(0, request.cookie));
            }
            return Ok(Replied::Done);
        }
        CMD_WRITE => {
            let data = payload.ok_or(NbdErrno::Inval)?;
            device.write_at(data, offset).map_err(fail)?;
        }
        CMD_FLUSH => device.flush().map_err(fail)?,
        CMD_TRIM => device.discard(offset, length as u64).map_err(fail)?,
        CMD_WRITE_ZEROES => {
            // Always written, never punched: on an encrypted volume a hole does not read
            // back as zeros, and NO_HOLE is then honoured for free.
            let mut done = 0usize;
            while done < length {
                let chunk = (length - done).min(ZERO_CHUNK_LEN);
                device
                    .write_at(&ZERO_CHUNK[..chunk], offset + done as u64)
                    .map_err(fail)?;
                done += chunk;
            }
        }
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

fn block_status(
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

fn is_timeout(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Reads the next request header. `Ok(None)` on a clean end of stream between requests.
/// A read timeout before the first byte is idleness and is waited out; after it, the client
/// is stalling mid-request and the error ends the connection.
fn read_request_header(reader: &mut impl Read) -> Result<Option<RequestHeader>, Error> {
    let mut bytes = [0u8; REQUEST_HEADER_LEN];
    let mut filled = 0;
    while filled < REQUEST_HEADER_LEN {
        match reader.read(&mut bytes[filled..]) {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => {
                return Err(Error::Protocol(
                    "client closed the connection inside a request header".into(),
                ))
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if filled == 0 && is_timeout(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    parse_request_header(&bytes)
        .map(Some)
        .map_err(|e| Error::Protocol(e.to_string()))
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Serves a negotiated connection until the client disconnects, the connection fails, or it is
/// shut down from outside (read side closed); then flushes what it wrote and closes.
pub(crate) fn serve(negotiated: Negotiated, config: &ConnectionConfig) -> Result<(), Error> {
    let Negotiated {
        transport,
        attachment,
        structured_replies,
        base_allocation,
    } = negotiated;
    let export = std::sync::Arc::clone(attachment.export());
    let session = Session::new(&export, structured_replies, base_allocation);
    let result = match transport {
        Transport::Plain(socket) => {
            let result = serve_pipelined(&socket, &session, config);
            flush_if_written(&session);
            socket.shutdown(Shutdown::Both);
            result
        }
        Transport::Tls(mut stream) => {
            let result = serve_sequential(&mut stream, &session);
            flush_if_written(&session);
            stream.conn.send_close_notify();
            let _ = stream.flush();
            stream.sock.shutdown(Shutdown::Both);
            result
        }
    };
    // Unregistering last lets a waiting `remove` return only once the data is durable.
    drop(attachment);
    result
}

/// Makes this connection's writes durable before it reports itself finished.
fn flush_if_written(session: &Session<'_>) {
    if session.wrote.load(Ordering::Relaxed) {
        if let Err(e) = session.export.device.flush() {
            tracing::warn!(export = %session.export.name, "flush at disconnect failed: {e}");
        }
    }
}

fn serve_sequential(
    stream: &mut rustls::StreamOwned<rustls::ServerConnection, Socket>,
    session: &Session<'_>,
) -> Result<(), Error> {
    let stats = &session.export.stats;
    let mut payload = Vec::new();
    let mut reply = ReplyBuffer::default();
    loop {
        let Some(request) = read_request_header(stream)? else {
            return Ok(());
        };
        if request.command == CMD_DISC {
            return Ok(());
        }
        let started = stats.begin();
        let data = if request.command == CMD_WRITE {
            if request.length > MAX_PAYLOAD {
                reply_status(session, &request, Err(NbdErrno::Inval), &mut reply);
                stats.complete(IoKind::Write, 0, started, false);
                stream.write_all(reply.bytes())?;
                stream.flush()?;
                return Err(Error::Protocol(format!(
                    "WRITE of {} bytes exceeds the maximum; closing",
                    request.length
                )));
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
    }
}

/// Bounds the payload bytes a connection holds in flight.
struct InFlightBudget {
    limit: u64,
    state: Mutex<BudgetState>,
    freed: Condvar,
}

#[derive(Default)]
struct BudgetState {
    used: u64,
    reader_waiting: bool,
}

impl InFlightBudget {
    fn acquire(&self, bytes: u64) {
        let mut state = lock(&self.state);
        // A single request larger than the limit still runs, alone.
        while state.used > 0 && state.used + bytes > self.limit {
            state.reader_waiting = true;
            state = self
                .freed
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        state.reader_waiting = false;
        state.used += bytes;
    }

    fn release(&self, bytes: u64) {
        let mut state = lock(&self.state);
        state.used -= bytes;
        // Waking is a syscall; only pay for it when the reader is actually blocked.
        if state.reader_waiting {
            self.freed.notify_one();
        }
    }
}

/// WRITE payload buffers, reused across requests.
#[derive(Default)]
struct BufferPool {
    /// The buffers and their total size.
    idle: Mutex<(Vec<Vec<u8>>, usize)>,
}

impl BufferPool {
    fn take_payload(&self, len: usize) -> Vec<u8> {
        let mut buffer = {
            let mut idle = lock(&self.idle);
            match idle.0.pop() {
                Some(buffer) => {
                    idle.1 -= buffer.len();
                    buffer
                }
                None => Vec::new(),
            }
        };
        if buffer.len() < len {
            buffer.resize(len, 0);
        }
        buffer
    }

    fn put_payload(&self, buffer: Vec<u8>) {
        let mut idle = lock(&self.idle);
        if buffer.len() <= MAX_POOLED_BUFFER && idle.1 + buffer.len() <= MAX_POOLED_BYTES {
            idle.1 += buffer.len();
            idle.0.push(buffer);
        }
    }
}

struct Job {
    request: RequestHeader,
    /// WRITE payload; valid prefix is `request.length` bytes.
    payload: Option<Vec<u8>>,
    started: Instant,
    budget_bytes: u64,
}

/// State shared by a connection's reader and workers.
struct Pipeline<'s, 'e> {
    session: &'s Session<'e>,
    writer: Mutex<&'s Socket>,
    socket: &'s Socket,
    /// Replies can no longer be delivered; the reader stops.
    broken: AtomicBool,
    budget: InFlightBudget,
    buffers: BufferPool,
    /// Requests handed to workers and not yet answered.
    outstanding: AtomicUsize,
    /// One bit per recent request (FLUSH and FUA excluded), newest lowest: set when the
    /// device took longer than `SLOW_REQUEST`. Racing updates only lose a sample.
    slow_history: AtomicU32,
    /// No workers: everything runs on the reader.
    inline_only: bool,
}

impl Pipeline<'_, '_> {
    /// Runs a request and folds its duration into the service-time average.
    fn execute_timed(
        &self,
        request: &RequestHeader,
        payload: Option<&[u8]>,
        out: &mut ReplyBuffer,
    ) -> bool {
        let started = Instant::now();
        let ok = execute(self.session, request, payload, out);
        if !is_known_slow(request) {
            let slow = u32::from(started.elapsed() > SLOW_REQUEST);
            let history = self.slow_history.load(Ordering::Relaxed);
            self.slow_history
                .store((history << 1) | slow, Ordering::Relaxed);
        }
        ok
    }

    /// Whether the reader should run this request itself instead of handing it to a worker.
    fn run_inline(&self, request: &RequestHeader) -> bool {
        self.inline_only
            || (!is_known_slow(request)
                && self.outstanding.load(Ordering::Acquire) == 0
                && self.slow_history.load(Ordering::Relaxed).count_ones() <= MAX_SLOW_FOR_INLINE)
    }

    fn send(&self, reply: &[u8]) {
        if self.broken.load(Ordering::Relaxed) {
            return;
        }
        let result = lock(&self.writer).write_all(reply);
        if let Err(e) = result {
            tracing::debug!(export = %self.session.export.name, "cannot send reply: {e}");
            self.broken.store(true, Ordering::Relaxed);
            // Wake the reader so the connection winds down.
            self.socket.shutdown(Shutdown::Read);
        }
    }
}

fn serve_pipelined(
    socket: &Socket,
    session: &Session<'_>,
    config: &ConnectionConfig,
) -> Result<(), Error> {
    let pipeline = Pipeline {
        session,
        writer: Mutex::new(socket),
        socket,
        broken: AtomicBool::new(false),
        budget: InFlightBudget {
            limit: config.max_in_flight_bytes,
            state: Mutex::new(BudgetState::default()),
            freed: Condvar::new(),
        },
        buffers: BufferPool::default(),
        outstanding: AtomicUsize::new(0),
        slow_history: AtomicU32::new(0),
        inline_only: config.workers == 0,
    };
    let (jobs, queue) = crossbeam_channel::bounded::<Job>(JOB_QUEUE_LEN);
    std::thread::scope(|scope| {
        for _ in 0..config.workers {
            let queue = queue.clone();
            let pipeline = &pipeline;
            scope.spawn(move || work(pipeline, queue));
        }
        drop(queue);
        // Dropping `jobs` at the end of read_requests lets the workers drain and exit; the
        // scope then waits for them, so every accepted request is answered before returning.
        read_requests(&pipeline, socket, jobs)
    })
}

fn read_requests(
    pipeline: &Pipeline<'_, '_>,
    socket: &Socket,
    jobs: Sender<Job>,
) -> Result<(), Error> {
    let session = pipeline.session;
    let stats = &session.export.stats;
    let mut reader = BufReader::with_capacity(READ_BUFFER_LEN, socket);
    let mut reply = ReplyBuffer::default();
    // Replies of requests run inline, sent together once no further request is buffered:
    // one `write` for a whole burst of queued requests.
    let mut batch: Vec<u8> = Vec::new();
    let result = loop {
        if pipeline.broken.load(Ordering::Relaxed) {
            break Ok(());
        }
        if !batch.is_empty() && reader.buffer().is_empty() {
            pipeline.send(&batch);
            batch.clear();
        }
        let request = match read_request_header(&mut reader) {
            Ok(Some(request)) if request.command != CMD_DISC => request,
            Ok(_) => break Ok(()),
            Err(e) => break Err(e),
        };
        let started = stats.begin();
        let mut payload = None;
        let mut budget_bytes = 0;
        match request.command {
            CMD_WRITE if request.length > MAX_PAYLOAD => {
                // Reading the payload just to discard it would let a client make the server
                // swallow 4 GiB; refuse and hang up instead.
                reply_status(session, &request, Err(NbdErrno::Inval), &mut reply);
                batch.extend_from_slice(reply.bytes());
                stats.complete(IoKind::Write, 0, started, false);
                break Err(Error::Protocol(format!(
                    "WRITE of {} bytes exceeds the maximum; closing",
                    request.length
                )));
            }
            CMD_WRITE => {
                let len = request.length as usize;
                if reader.buffer().len() >= len && pipeline.run_inline(&request) {
                    // The whole payload already sits in the read buffer: run the write from
                    // there instead of copying it into a payload buffer first. It holds no
                    // memory of its own, so it takes nothing from the in-flight budget.
                    let payload = &reader.buffer()[..len];
                    run_request(
                        pipeline,
                        &request,
                        Some(payload),
                        started,
                        &mut reply,
                        |bytes| queue_inline_reply(pipeline, &mut batch, bytes),
                    );
                    reader.consume(len);
                    continue;
                }
                budget_bytes = u64::from(request.length);
                pipeline.budget.acquire(budget_bytes);
                let mut buffer = pipeline.buffers.take_payload(len);
                if let Err(e) = read_payload(&mut reader, &mut buffer[..len]) {
                    // A partial payload is never written.
                    pipeline.budget.release(budget_bytes);
                    stats.complete(IoKind::Write, 0, started, false);
                    break Err(e.into());
                }
                payload = Some(buffer);
            }
            CMD_READ if request.length <= MAX_PAYLOAD => {
                budget_bytes = u64::from(request.length);
                pipeline.budget.acquire(budget_bytes);
            }
            _ => {}
        }
        let job = Job {
            request,
            payload,
            started,
            budget_bytes,
        };
        if pipeline.run_inline(&request) {
            run_job(pipeline, job, &mut reply, |bytes| {
                queue_inline_reply(pipeline, &mut batch, bytes)
            });
            continue;
        }
        pipeline.outstanding.fetch_add(1, Ordering::AcqRel);
        if let Err(unsent) = jobs.send(job) {
            // Only possible when every worker is gone (a worker panicked).
            pipeline.outstanding.fetch_sub(1, Ordering::AcqRel);
            pipeline.budget.release(unsent.0.budget_bytes);
            stats.complete(io_kind(request.command), 0, started, false);
            break Err(Error::Protocol("connection workers exited".into()));
        }
    };
    pipeline.send(&batch);
    result
}

/// Requests whose cost says nothing about the device's speed for ordinary I/O (a FLUSH is
/// an fdatasync; zeroing or trimming gigabytes takes long on any device); they always go to
/// a worker so the reader keeps reading.
fn is_known_slow(request: &RequestHeader) -> bool {
    let large_without_payload = matches!(request.command, CMD_WRITE_ZEROES | CMD_TRIM)
        && request.length as usize > ZERO_CHUNK_LEN;
    request.command == CMD_FLUSH || request.flags & CMD_FLAG_FUA != 0 || large_without_payload
}

/// Fills `payload` with what the read buffer holds and the rest straight from the socket:
/// refilling the buffer would copy the rest twice.
fn read_payload(reader: &mut BufReader<&Socket>, payload: &mut [u8]) -> io::Result<()> {
    let buffered = reader.buffer().len().min(payload.len());
    payload[..buffered].copy_from_slice(&reader.buffer()[..buffered]);
    reader.consume(buffered);
    reader.get_mut().read_exact(&mut payload[buffered..])
}

/// Adds the reply of a request the reader ran to the batch sent once the reader runs out of
/// buffered requests; large replies go out at once rather than being copied.
fn queue_inline_reply(pipeline: &Pipeline<'_, '_>, batch: &mut Vec<u8>, reply: &[u8]) {
    if reply.len() > INLINE_BATCH_LIMIT {
        pipeline.send(batch);
        batch.clear();
        pipeline.send(reply);
    } else {
        batch.extend_from_slice(reply);
        if batch.len() >= INLINE_BATCH_MAX {
            pipeline.send(batch);
            batch.clear();
        }
    }
}

/// Executes a job, hands the reply to `deliver`, records it and recycles its buffers.
fn run_job(
    pipeline: &Pipeline<'_, '_>,
    job: Job,
    reply: &mut ReplyBuffer,
    deliver: impl FnOnce(&[u8]),
) {
    let request = job.request;
    let payload = job
        .payload
        .as_deref()
        .map(|buffer| &buffer[..request.length as usize]);
    run_request(pipeline, &request, payload, job.started, reply, deliver);
    if let Some(buffer) = job.payload {
        pipeline.buffers.put_payload(buffer);
    }
    pipeline.budget.release(job.budget_bytes);
}

/// Executes a request, hands the reply to `deliver` and records it.
fn run_request(
    pipeline: &Pipeline<'_, '_>,
    request: &RequestHeader,
    payload: Option<&[u8]>,
    started: Instant,
    reply: &mut ReplyBuffer,
    deliver: impl FnOnce(&[u8]),
) {
    let ok = pipeline.execute_timed(request, payload, reply);
    deliver(reply.bytes());
    pipeline.session.export.stats.complete(
        io_kind(request.command),
        u64::from(request.length),
        started,
        ok,
    );
    if reply.data.len() > MAX_POOLED_BUFFER {
        *reply = ReplyBuffer::default();
    }
}

fn work(pipeline: &Pipeline<'_, '_>, queue: Receiver<Job>) {
    let mut reply = ReplyBuffer::default();
    for job in queue {
        run_job(pipeline, job, &mut reply, |bytes| pipeline.send(bytes));
        pipeline.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}
