//! Plain connections: one thread per connection running an event loop over a non-blocking
//! socket and an asynchronous I/O queue of the export's device.
//!
//! The loop parses every complete request its read buffer holds and pushes it into the queue
//! (READ into a pooled aligned buffer that becomes the reply's data, WRITE from a pooled
//! buffer the payload was copied or read into), submits the burst with one system call,
//! collects what completed, and writes the queued replies with `writev` as far as the socket
//! takes them; then it sleeps in `poll` on the socket and the queue's eventfd. Nothing is
//! shared between threads, so nothing is locked, and no request costs a thread wake-up. A
//! client that does not read its replies cannot block the loop: unsent replies wait in a
//! queue and the loop stops reading new requests while the queue or the pending-bytes budget is
//! full. NBD replies carry the request's cookie, so they may go out in any order.
//!
//! Back-pressure: at most `queue_depth` requests and `max_pending_bytes` payload bytes are
//! under way (from parsing to the end of their reply). A client silent in the middle of a
//! request, or not taking replies, for `io_timeout` is disconnected.
//!
//! Memory: before a READ or WRITE is taken from the read buffer, the connection reserves what
//! it may make the daemon hold until its reply is sent (the payload buffer, and for a WRITE a
//! second buffer of its size for the ciphertext or a bounce the queue may make) from the
//! daemon's memory budget (`MemoryBudget`); its queue then reserves nothing itself. Where the
//! budget has no room the connection stops taking requests until the budget grants them,
//! which wakes it through an eventfd of its own; meanwhile the client is not timed out.
//! Payload buffers come from the daemon's buffer cache and go back to it with the reply.

use super::reply::{
    block_status, read_reply_header, refuse_oversized_write, reply_status, ReplyBuffer,
    READ_REPLY_HEADER_MAX,
};
use super::{check_request, errno_of, io_kind, ConnectionConfig, Session};
use crate::protocol::*;
use crate::socket::Socket;
use crate::Error;
use cryptblk_block::aio::{
    Completion, IoBuffers, IoOp, IoQueue, IoRequest, Notifier, QueueOptions,
};
use cryptblk_block::buffers::{self, PooledBuf};
use cryptblk_block::open_pipeline;
use cryptblk_block::{BlockError, BudgetShare, MemoryBudget};
use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Read buffer: large enough to take a burst of queued 4 KiB writes in one `read`.
const READ_BUFFER_LEN: usize = 256 << 10;
/// Replies written per `writev` at most (two iovecs each; IOV_MAX is 1024).
const REPLIES_PER_WRITE: usize = 256;

/// A request between parsing and the end of its reply.
struct Job {
    request: RequestHeader,
    started: Instant,
    /// READ: the data read; WRITE: the payload.
    buf: Option<PooledBuf>,
    /// Bytes reserved from the memory budget until the reply is sent.
    reserved: u64,
    /// TRIM / WRITE_ZEROES with FUA: a flush follows before the reply.
    flush_after: bool,
}

/// A reply waiting for the socket.
struct Reply {
    /// The whole reply when short (a status, a READ's header), else the start of it.
    header: [u8; READ_REPLY_HEADER_MAX],
    header_len: usize,
    /// A long reply's bytes (BLOCK_STATUS), sent instead of `header`.
    long: Vec<u8>,
    /// READ data sent after the header (the job's buffer).
    job: Job,
    with_data: bool,
    /// Bytes already written.
    sent: usize,
    ok: bool,
}

impl Reply {
    fn head(&self) -> &[u8] {
        if self.long.is_empty() {
            &self.header[..self.header_len]
        } else {
            &self.long
        }
    }

    fn data(&self) -> &[u8] {
        match (&self.job.buf, self.with_data) {
            (Some(buf), true) => &buf[..self.job.request.length as usize],
            _ => &[],
        }
    }

    fn len(&self) -> usize {
        self.head().len() + self.data().len()
    }
}

/// A WRITE whose payload is still arriving.
struct PartialWrite {
    job: Job,
    filled: usize,
}

struct Connection<'s, 'e> {
    session: &'s Session<'e>,
    socket: &'s Socket,
    config: &'s ConnectionConfig,
    queue: Box<dyn IoQueue>,
    /// Jobs in the queue, by tag.
    jobs: Vec<Option<Job>>,
    free: Vec<u32>,
    /// Pushed and not yet submitted.
    unsubmitted: bool,
    rbuf: Box<[u8]>,
    /// Unparsed bytes are `rbuf[start..end]`.
    start: usize,
    end: usize,
    partial: Option<PartialWrite>,
    replies: VecDeque<Reply>,
    /// Requests and payload bytes from parsing to the end of their reply.
    requests: usize,
    bytes: u64,
    max_requests: usize,
    /// The connection's share of the daemon's memory budget.
    budget: BudgetShare,
    /// Set when the budget grants what the connection waited for.
    budget_wake: Arc<Notifier>,
    completions: Vec<Completion>,
    /// The buffers of the request being pushed (reused; the queue keeps its own copy).
    buffers: IoBuffers,
    /// The client sent DISC: no more requests.
    eof: bool,
    /// The client closed its side: the requests already read are still served.
    peer_closed: bool,
    /// A protocol error ends the connection once what was accepted is answered.
    error: Option<Error>,
    /// When the connection last moved (bytes in or out); a client stuck mid-request or not
    /// taking replies for `io_timeout` is cut off.
    last_progress: Instant,
}

/// Serves a plain connection until the client disconnects, the connection fails, or it is
/// shut down from outside (read side closed).
pub(super) fn serve(
    socket: &Socket,
    session: &Session<'_>,
    config: &ConnectionConfig,
) -> Result<(), Error> {
    let depth = config.queue_depth.max(1);
    let mut pipeline = open_pipeline(&session.export.device, &QueueOptions { depth })
        .map_err(|e| Error::Protocol(format!("opening the export's I/O queue: {e}")))?;
    // The connection reserves for its requests, for as long as it holds them.
    pipeline.set_budget(None);
    let queue: Box<dyn IoQueue> = Box::new(pipeline);
    let capacity = queue.capacity();
    let budget_wake = Arc::new(Notifier::new()?);
    socket.set_nonblocking(true)?;
    let mut conn = Connection {
        session,
        socket,
        config,
        queue,
        jobs: (0..capacity).map(|_| None).collect(),
        free: (0..capacity as u32).rev().collect(),
        unsubmitted: false,
        rbuf: vec![0u8; READ_BUFFER_LEN].into_boxed_slice(),
        start: 0,
        end: 0,
        partial: None,
        replies: VecDeque::new(),
        requests: 0,
        bytes: 0,
        max_requests: capacity,
        budget: MemoryBudget::process().share(budget_wake.clone()),
        budget_wake,
        completions: Vec::new(),
        buffers: IoBuffers::with_capacity(1),
        eof: false,
        peer_closed: false,
        error: None,
        last_progress: Instant::now(),
    };
    let result = conn.run();
    // Whatever happened, nothing the kernel still holds may outlive its buffers: dropping the
    // queue waits for it; the jobs (and their buffers) go after, each counted as a request
    // that failed (its client got no reply).
    let Connection {
        queue,
        jobs,
        partial,
        replies,
        ..
    } = conn;
    drop(queue);
    let unanswered = jobs
        .into_iter()
        .flatten()
        .chain(partial.map(|p| p.job))
        .chain(replies.into_iter().map(|r| r.job));
    for job in unanswered {
        let request = job.request;
        let stats = &session.export.stats;
        stats.complete(
            io_kind(request.command),
            u64::from(request.length),
            job.started,
            false,
        );
    }
    let _ = socket.set_nonblocking(false);
    result
}

impl Connection<'_, '_> {
    fn run(&mut self) -> Result<(), Error> {
        loop {
            self.parse_requests();
            if self.peer_closed && !self.eof && self.error.is_none() {
                self.end_of_requests();
            }
            self.submit();
            self.collect();
            self.submit();
            self.send()?;
            if let Some(e) = self.error.take() {
                if self.queue.in_flight() == 0 {
                    let _ = self.send();
                    return Err(e);
                }
                self.error = Some(e);
            }
            let quiet = self.queue.in_flight() == 0 && self.replies.is_empty();
            if (self.eof || self.error.is_some()) && quiet && self.partial.is_none() {
                return Ok(());
            }
            // Replies sent may have made room for requests already in the read buffer.
            if !self.next_request_fits() {
                self.wait()?;
            }
        }
    }

    /// After the client closed its side: once the read buffer holds no complete request,
    /// there are no more; bytes of an incomplete one are an error.
    fn end_of_requests(&mut self) {
        let unparsed = self.end - self.start;
        if self.partial.is_some() || (unparsed > 0 && unparsed < REQUEST_HEADER_LEN) {
            self.error = Some(Error::Protocol(
                "client closed the connection inside a request".into(),
            ));
        } else if unparsed == 0 {
            self.eof = true;
        }
    }

    /// Whether a complete request header waits in the read buffer and the budget takes it.
    fn next_request_fits(&self) -> bool {
        if self.eof || self.error.is_some() || self.partial.is_some() || self.budget.is_waiting() {
            return false;
        }
        let Some(header) = self.rbuf.get(self.start..self.start + REQUEST_HEADER_LEN) else {
            return false;
        };
        if self.start + REQUEST_HEADER_LEN > self.end {
            return false;
        }
        match parse_request_header(header) {
            Ok(r) if matches!(r.command, CMD_READ | CMD_WRITE) => {
                !self.budget_full(u64::from(r.length))
            }
            // Anything else (a malformed header included) is handled by parsing.
            _ => !self.budget_full(0),
        }
    }

    /// Reserves what `request` may make the daemon hold until its reply is sent (its payload
    /// buffer; for a WRITE also the queue's copy of it), now or with the grant the connection
    /// waited for; `None` when it must wait.
    fn reserve(&mut self, request: &RequestHeader) -> Option<u64> {
        let copies = match request.command {
            // Oversized writes are refused without reading their payload.
            CMD_WRITE if request.length <= MAX_PAYLOAD => 2,
            CMD_READ if request.length <= MAX_PAYLOAD => 1,
            _ => return Some(0),
        };
        let buffer = buffers::class_size(request.length as usize) as u64;
        let charge = self.budget.charge_for(copies * buffer);
        // A grant the connection waited for is this request's: the one at the head of the
        // read buffer.
        self.budget.try_reserve(charge)
    }

    fn budget_full(&self, bytes: u64) -> bool {
        self.requests >= self.max_requests
            || (self.bytes > 0 && self.bytes + bytes > self.config.max_pending_bytes)
    }

    /// Turns every complete request of the read buffer into queue I/O (or a reply), as far
    /// as the budget allows.
    fn parse_requests(&mut self) {
        if self.error.is_some() {
            return;
        }
        loop {
            if let Some(partial) = &mut self.partial {
                // Payload bytes already read go into the payload buffer.
                let want = partial.job.request.length as usize - partial.filled;
                let n = want.min(self.end - self.start);
                if let Some(buf) = partial.job.buf.as_mut() {
                    buf[partial.filled..partial.filled + n]
                        .copy_from_slice(&self.rbuf[self.start..self.start + n]);
                }
                partial.filled += n;
                self.start += n;
                if partial.filled < partial.job.request.length as usize {
                    return;
                }
                if let Some(partial) = self.partial.take() {
                    self.dispatch(partial.job);
                }
                continue;
            }
            if self.eof || self.end - self.start < REQUEST_HEADER_LEN {
                return;
            }
            let header = &self.rbuf[self.start..self.start + REQUEST_HEADER_LEN];
            let request = match parse_request_header(header) {
                Ok(request) => request,
                Err(e) => {
                    self.error = Some(Error::Protocol(e.to_string()));
                    return;
                }
            };
            if request.command == CMD_DISC {
                self.start += REQUEST_HEADER_LEN;
                self.eof = true;
                return;
            }
            let payload = match request.command {
                CMD_READ | CMD_WRITE => u64::from(request.length),
                _ => 0,
            };
            if self.budget_full(payload) {
                return;
            }
            let Some(reserved) = self.reserve(&request) else {
                // Taken once the budget grants it (the wake-up comes through `budget_wake`).
                return;
            };
            self.start += REQUEST_HEADER_LEN;
            let stats = &self.session.export.stats;
            let started = stats.begin();
            self.requests += 1;
            self.bytes += payload;
            let mut job = Job {
                request,
                started,
                buf: None,
                reserved,
                flush_after: matches!(request.command, CMD_TRIM | CMD_WRITE_ZEROES)
                    && request.flags & CMD_FLAG_FUA != 0,
            };
            if request.command == CMD_WRITE && request.length > MAX_PAYLOAD {
                // The payload is not read (that would let a client make the server swallow
                // 4 GiB): the refusal is answered and the connection closed. Its budget is
                // given back with the reply, like every other request's.
                let mut reply = ReplyBuffer::default();
                self.error = Some(refuse_oversized_write(self.session, &request, &mut reply));
                self.queue_reply(job, reply.bytes().to_vec(), false);
                return;
            }
            if request.command == CMD_WRITE {
                job.buf = Some(buffers::take(request.length as usize));
                self.partial = Some(PartialWrite { job, filled: 0 });
                continue;
            }
            self.dispatch(job);
        }
    }

    /// Checks a complete request and pushes its I/O (or answers it).
    fn dispatch(&mut self, mut job: Job) {
        let session = self.session;
        let request = job.request;
        if let Err(errno) = check_request(session, &request) {
            self.reply_error(job, errno);
            return;
        }
        if matches!(request.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES) {
            session.wrote.store(true, Ordering::Relaxed);
        }
        let op = match request.command {
            CMD_READ => IoOp::Read,
            CMD_WRITE => IoOp::Write,
            CMD_FLUSH => IoOp::Flush,
            CMD_TRIM => IoOp::Discard,
            CMD_WRITE_ZEROES => IoOp::WriteZeroes,
            CMD_BLOCK_STATUS => {
                let mut reply = ReplyBuffer::default();
                let ok = match block_status(session, &request, &mut reply) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(export = %session.export.name, "block status failed: {e}");
                        reply_status(session, &request, Err(errno_of(&e, false)), &mut reply);
                        false
                    }
                };
                self.queue_reply(job, reply.bytes().to_vec(), ok);
                return;
            }
            _ => {
                self.reply_error(job, NbdErrno::Inval);
                return;
            }
        };
        if op == IoOp::Read {
            job.buf = Some(buffers::take(request.length as usize));
        }
        self.push(job, op);
    }

    /// Pushes a job's I/O; a refusal by the queue (never expected: the budget keeps it below
    /// capacity) is answered with EIO.
    fn push(&mut self, mut job: Job, op: IoOp) {
        let Some(tag) = self.free.pop() else {
            self.reply_error(job, NbdErrno::Io);
            return;
        };
        let request = job.request;
        self.buffers.clear();
        if let Some(buf) = job.buf.as_mut() {
            let len = (request.length as usize).min(buf.len());
            // SAFETY: the buffer belongs to the job, which is parked in `jobs` (and not
            // touched) until its completion has been collected; its bytes are a heap
            // allocation that does not move with the job.
            unsafe { self.buffers.add_raw(buf.as_mut_ptr(), len) };
        }
        let fua = request.flags & CMD_FLAG_FUA != 0;
        let req = match op {
            IoOp::Read => IoRequest::read(request.offset, &self.buffers, u64::from(tag)),
            IoOp::Write => IoRequest::write(request.offset, &self.buffers, fua, u64::from(tag)),
            IoOp::Flush => IoRequest::flush(u64::from(tag)),
            IoOp::Discard | IoOp::WriteZeroes => IoRequest::range(
                op,
                request.offset,
                u64::from(request.length),
                u64::from(tag),
            ),
        };
        let pushed = self.queue.push(&req);
        self.buffers.clear();
        if pushed.is_err() {
            self.free.push(tag);
            self.reply_error(job, NbdErrno::Io);
            return;
        }
        self.jobs[tag as usize] = Some(job);
        self.unsubmitted = true;
    }

    fn submit(&mut self) {
        if std::mem::take(&mut self.unsubmitted) {
            if let Err(e) = self.queue.submit() {
                tracing::error!(export = %self.session.export.name, "submitting I/O: {e}");
            }
        }
    }

    /// Collects finished requests and queues their replies.
    fn collect(&mut self) {
        let mut completions = std::mem::take(&mut self.completions);
        self.queue.drain(&mut |c| completions.push(c));
        for c in completions.drain(..) {
            let Some(mut job) = self.jobs.get_mut(c.tag as usize).and_then(Option::take) else {
                continue;
            };
            if c.result.is_ok() && job.flush_after {
                // TRIM / WRITE_ZEROES with FUA: durable before the reply.
                job.flush_after = false;
                if self.queue.push(&IoRequest::flush(c.tag)).is_ok() {
                    self.jobs[c.tag as usize] = Some(job);
                    self.unsubmitted = true;
                    continue;
                }
            }
            self.free.push(c.tag as u32);
            self.reply(job, c.result);
        }
        self.completions = completions;
    }

    /// Queues the reply of a finished job.
    fn reply(&mut self, job: Job, result: Result<(), BlockError>) {
        let session = self.session;
        let request = job.request;
        let mut header = [0u8; READ_REPLY_HEADER_MAX];
        let (header_len, with_data, ok) = match result {
            Ok(()) if request.command == CMD_READ => (
                read_reply_header(session, &request, &mut header),
                true,
                true,
            ),
            Ok(()) => {
                header[..SIMPLE_REPLY_HEADER_LEN]
                    .copy_from_slice(&encode_simple_reply(0, request.cookie));
                (SIMPLE_REPLY_HEADER_LEN, false, true)
            }
            Err(e) => {
                session.request_failed(&e);
                let modifies = matches!(request.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
                let mut reply = ReplyBuffer::default();
                reply_status(session, &request, Err(errno_of(&e, modifies)), &mut reply);
                let bytes = reply.bytes();
                let n = bytes.len().min(READ_REPLY_HEADER_MAX);
                header[..n].copy_from_slice(&bytes[..n]);
                (n, false, false)
            }
        };
        self.replies.push_back(Reply {
            header,
            header_len,
            long: Vec::new(),
            job,
            with_data,
            sent: 0,
            ok,
        });
    }

    /// Queues a reply built elsewhere (rare: refusals, BLOCK_STATUS).
    fn queue_reply(&mut self, job: Job, bytes: Vec<u8>, ok: bool) {
        self.replies.push_back(Reply {
            header: [0; READ_REPLY_HEADER_MAX],
            header_len: 0,
            long: bytes,
            job,
            with_data: false,
            sent: 0,
            ok,
        });
    }

    /// Answers a request that never reached the device.
    fn reply_error(&mut self, job: Job, errno: NbdErrno) {
        let mut reply = ReplyBuffer::default();
        reply_status(self.session, &job.request, Err(errno), &mut reply);
        self.queue_reply(job, reply.bytes().to_vec(), false);
    }

    /// Records a job whose reply is gone and gives back its buffer and budget.
    fn finish(&mut self, job: Job, ok: bool) {
        let request = job.request;
        self.session.export.stats.complete(
            io_kind(request.command),
            u64::from(request.length),
            job.started,
            ok,
        );
        self.requests -= 1;
        if matches!(request.command, CMD_READ | CMD_WRITE) {
            self.bytes -= u64::from(request.length);
        }
        // The buffer goes back to the cache before its bytes go back to the budget.
        drop(job.buf);
        self.budget.release(job.reserved);
        if self.requests == 0 {
            self.budget.return_credit();
        }
    }

    /// Writes queued replies as far as the socket takes them, several per `writev`.
    fn send(&mut self) -> Result<(), Error> {
        while !self.replies.is_empty() {
            let mut slices = [IoSlice::new(&[]); 2 * REPLIES_PER_WRITE];
            let mut n = 0;
            for r in self.replies.iter().take(REPLIES_PER_WRITE) {
                let (head, data) = (r.head(), r.data());
                if r.sent < head.len() {
                    slices[n] = IoSlice::new(&head[r.sent..]);
                    n += 1;
                    if !data.is_empty() {
                        slices[n] = IoSlice::new(data);
                        n += 1;
                    }
                } else {
                    slices[n] = IoSlice::new(&data[r.sent - head.len()..]);
                    n += 1;
                }
            }
            let written = match (&*self.socket).write_vectored(&slices[..n]) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
                Ok(w) => w,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::debug!(export = %self.session.export.name, "cannot send reply: {e}");
                    return Err(e.into());
                }
            };
            self.last_progress = Instant::now();
            let mut left = written;
            while left > 0 {
                let Some(front) = self.replies.front_mut() else {
                    break;
                };
                let rest = front.len() - front.sent;
                if left < rest {
                    front.sent += left;
                    break;
                }
                left -= rest;
                if let Some(done) = self.replies.pop_front() {
                    self.finish(done.job, done.ok);
                }
            }
        }
        Ok(())
    }

    /// Sleeps until the socket or the queue has something for the loop, then reads what the
    /// socket has.
    fn wait(&mut self) -> Result<(), Error> {
        let want_read = !self.eof
            && !self.peer_closed
            && self.error.is_none()
            && (self.partial.is_some() || !self.budget_full(0))
            && self.end - self.start < self.rbuf.len();
        let budget_waiting = self.budget.is_waiting();
        let want_write = !self.replies.is_empty();
        let mut events = 0;
        if want_read {
            events |= libc::POLLIN;
        }
        if want_write {
            events |= libc::POLLOUT;
        }
        let mut fds = [
            libc::pollfd {
                fd: self.socket.as_raw_fd(),
                events,
                revents: 0,
            },
            libc::pollfd {
                fd: self.queue.notifier(),
                events: if self.queue.in_flight() > 0 {
                    libc::POLLIN
                } else {
                    0
                },
                revents: 0,
            },
            libc::pollfd {
                fd: self.budget_wake.as_raw_fd(),
                events: if budget_waiting { libc::POLLIN } else { 0 },
                revents: 0,
            },
        ];
        // Between requests with nothing in flight the client may stay silent forever; in the
        // middle of one, or with replies it does not take, only for `io_timeout`. Waiting for
        // the daemon's memory is not the client's doing.
        let stuck = self.partial.is_some()
            || (self.end > self.start && !self.budget_full(0) && !budget_waiting)
            || want_write;
        let timeout_ms = if stuck {
            let left = self
                .config
                .io_timeout
                .saturating_sub(self.last_progress.elapsed());
            i32::try_from(left.as_millis()).unwrap_or(i32::MAX)
        } else {
            -1
        };
        // SAFETY: three valid pollfd structs, length 3.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 3, timeout_ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(e.into());
        }
        if n == 0 && stuck {
            return Err(Error::Protocol(format!(
                "the client stalled for {} s in the middle of a request or without taking \
                 replies; closing",
                self.config.io_timeout.as_secs()
            )));
        }
        if fds[2].revents != 0 {
            // The grant itself is collected by the next parse.
            self.budget_wake.clear();
        }
        if want_read && fds[0].revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            self.read_socket()?;
        }
        Ok(())
    }

    /// Reads what the socket has: into the payload buffer of a WRITE in progress when the
    /// read buffer holds none of it (large payloads skip the copy), else into the read
    /// buffer.
    fn read_socket(&mut self) -> Result<(), Error> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.start > 0
            && (self.start > self.rbuf.len() / 2 || self.end == self.rbuf.len())
        {
            self.rbuf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let direct = match &mut self.partial {
            Some(p) if self.start == self.end => {
                let len = p.job.request.length as usize;
                p.job.buf.as_mut().map(|b| &mut b[p.filled..len])
            }
            _ => None,
        };
        let result = match direct {
            Some(target) => (&*self.socket).read(target).map(|n| (n, true)),
            None => (&*self.socket)
                .read(&mut self.rbuf[self.end..])
                .map(|n| (n, false)),
        };
        match result {
            Ok((0, _)) => self.peer_closed = true,
            Ok((n, true)) => {
                if let Some(p) = &mut self.partial {
                    p.filled += n;
                }
                self.last_progress = Instant::now();
            }
            Ok((n, false)) => {
                self.end += n;
                self.last_progress = Instant::now();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }
}
