//! A plain connection's reply side: finished requests collected from the queue, their replies
//! queued in any order (NBD replies carry the request's cookie) and written with `writev` as far
//! as the socket takes them; a request's buffer and budget are given back once its reply is gone.

use super::{Connection, Job};
use crate::protocol::*;
use crate::transmission::reply::{
    read_reply_header, reply_status, ReplyBuffer, READ_REPLY_HEADER_MAX,
};
use crate::transmission::{errno_of, io_kind};
use crate::Error;
use cryptblk_block::aio::IoRequest;
use cryptblk_block::BlockError;
use std::io::{self, IoSlice, Write};
use std::time::Instant;

/// Replies written per `writev` at most (two iovecs each; IOV_MAX is 1024).
const REPLIES_PER_WRITE: usize = 256;

/// A reply waiting for the socket.
pub(super) struct Reply {
    /// The whole reply when short (a status, a READ's header), else the start of it.
    header: [u8; READ_REPLY_HEADER_MAX],
    header_len: usize,
    /// A long reply's bytes (BLOCK_STATUS), sent instead of `header`.
    long: Vec<u8>,
    /// READ data sent after the header (the job's buffer).
    pub(super) job: Job,
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

impl Connection<'_, '_> {
    /// Collects finished requests and queues their replies.
    pub(super) fn collect(&mut self) {
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
    pub(super) fn queue_reply(&mut self, job: Job, bytes: Vec<u8>, ok: bool) {
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
    pub(super) fn reply_error(&mut self, job: Job, errno: NbdErrno) {
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
    pub(super) fn send(&mut self) -> Result<(), Error> {
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
}
