//! A plain connection's request side: complete requests taken from the read buffer (as far as
//! the connection's bounds and the memory budget allow), checked, and pushed into the queue as
//! I/O, or answered at once when they never reach the device.

use super::{Connection, Job, PartialWrite};
use crate::protocol::*;
use crate::transmission::reply::{block_status, refuse_oversized_write, reply_status, ReplyBuffer};
use crate::transmission::{check_request, errno_of};
use crate::Error;
use cryptblk_block::aio::{IoOp, IoRequest};
use cryptblk_block::buffers;
use std::sync::atomic::Ordering;
use std::time::Instant;

impl Connection<'_, '_> {
    /// After the client closed its side: once the read buffer holds no complete request,
    /// there are no more; bytes of an incomplete one are an error.
    pub(super) fn end_of_requests(&mut self) {
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
    pub(super) fn next_request_fits(&self) -> bool {
        if self.eof || self.error.is_some() || self.partial.is_some() || self.budget.is_waiting() {
            return false;
        }
        if self.paced_until.is_some_and(|until| until > Instant::now()) {
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

    /// Whether the export's read rate lets the READ at the head of the read buffer go now;
    /// else the connection waits (`paced_until`). Asked again after a wait for the budget,
    /// the rate does not count the read twice.
    fn admitted_by_read_rate(&mut self, request: &RequestHeader) -> bool {
        let Some(pacer) = &self.session.export.read_rate else {
            return true;
        };
        if self.read_admitted {
            return true;
        }
        let now = Instant::now();
        match pacer.admit(u64::from(request.length), now) {
            Ok(()) => {
                self.paced_until = None;
                self.read_admitted = true;
                true
            }
            Err(wait) => {
                self.paced_until = Some(now + wait);
                false
            }
        }
    }

    pub(super) fn budget_full(&self, bytes: u64) -> bool {
        self.requests >= self.max_requests
            || (self.bytes > 0 && self.bytes + bytes > self.config.max_pending_bytes)
    }

    /// Turns every complete request of the read buffer into queue I/O (or a reply), as far
    /// as the budget allows.
    pub(super) fn parse_requests(&mut self) {
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
            if request.command == CMD_READ && !self.admitted_by_read_rate(&request) {
                return;
            }
            let Some(reserved) = self.reserve(&request) else {
                // Taken once the budget grants it (the wake-up comes through `budget_wake`).
                return;
            };
            self.start += REQUEST_HEADER_LEN;
            self.read_admitted = false;
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

    pub(super) fn submit(&mut self) {
        if std::mem::take(&mut self.unsubmitted) {
            if let Err(e) = self.queue.submit() {
                tracing::error!(export = %self.session.export.name, "submitting I/O: {e}");
            }
        }
    }
}
