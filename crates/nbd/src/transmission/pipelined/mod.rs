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
//!
//! This file holds a connection's state and its event loop (sleep, read the socket); the
//! request side (read buffer -> queue) is `requests.rs`, the reply side (completions ->
//! socket) `replies.rs`.

mod replies;
mod requests;

use super::{io_kind, ConnectionConfig, Session};
use crate::protocol::*;
use crate::socket::Socket;
use crate::Error;
use cryptblk_block::aio::{Completion, IoBuffers, IoQueue, Notifier, QueueOptions};
use cryptblk_block::buffers::PooledBuf;
use cryptblk_block::open_pipeline;
use cryptblk_block::{BudgetShare, MemoryBudget};
use replies::Reply;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use std::collections::VecDeque;
use std::io::{self, Read};
use std::sync::Arc;
use std::time::Instant;

/// Read buffer: large enough to take a burst of queued 4 KiB writes in one `read`.
const READ_BUFFER_LEN: usize = 256 << 10;

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
    /// The READ at the head of the read buffer waits for the export's read rate until then
    /// (`Export::read_rate`); `read_admitted` once the rate took it.
    paced_until: Option<Instant>,
    read_admitted: bool,
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
        paced_until: None,
        read_admitted: false,
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

/// A poll(2) timeout in whole milliseconds, rounded up so that a wait does not end just before
/// its moment.
fn poll_timeout(wait: std::time::Duration) -> Timespec {
    let ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as i64;
    Timespec {
        tv_sec: ms / 1000,
        tv_nsec: (ms % 1000) * 1_000_000,
    }
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
        let mut events = PollFlags::empty();
        if want_read {
            events |= PollFlags::IN;
        }
        if want_write {
            events |= PollFlags::OUT;
        }
        let listen_if = |yes: bool| {
            if yes {
                PollFlags::IN
            } else {
                PollFlags::empty()
            }
        };
        let mut fds = [
            PollFd::new(self.socket, events),
            PollFd::from_borrowed_fd(self.queue.notifier(), listen_if(self.queue.in_flight() > 0)),
            PollFd::new(&*self.budget_wake, listen_if(budget_waiting)),
        ];
        // Between requests with nothing in flight the client may stay silent forever; in the
        // middle of one, or with replies it does not take, only for `io_timeout`. Waiting for
        // the daemon's memory is not the client's doing.
        // Nor is waiting for the export's read rate.
        let paced = self
            .paced_until
            .map(|until| until.saturating_duration_since(Instant::now()));
        let stuck = self.partial.is_some()
            || (self.end > self.start
                && !self.budget_full(0)
                && !budget_waiting
                && paced.is_none())
            || want_write;
        let stuck_left = stuck.then(|| {
            self.config
                .io_timeout
                .saturating_sub(self.last_progress.elapsed())
        });
        let timeout = match (stuck_left, paced) {
            (None, None) => None,
            (Some(left), None) | (None, Some(left)) => Some(left),
            (Some(stuck), Some(paced)) => Some(stuck.min(paced)),
        }
        .map(poll_timeout);
        let n = match poll(&mut fds, timeout.as_ref()) {
            Ok(n) => n,
            Err(Errno::INTR) => return Ok(()),
            Err(e) => return Err(io::Error::from(e).into()),
        };
        let (socket_ready, budget_woke) = (fds[0].revents(), !fds[2].revents().is_empty());
        if n == 0 && stuck && stuck_left.is_some_and(|left| paced.is_none_or(|p| left <= p)) {
            return Err(Error::Protocol(format!(
                "the client stalled for {} s in the middle of a request or without taking \
                 replies; closing",
                self.config.io_timeout.as_secs()
            )));
        }
        if budget_woke {
            // The grant itself is collected by the next parse.
            self.budget_wake.clear();
        }
        if want_read && socket_ready.intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR) {
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
