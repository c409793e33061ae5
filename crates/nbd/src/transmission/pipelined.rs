//! Plain connections: requests go through an asynchronous I/O queue of the export's device.
//!
//! The connection thread reads requests, pushes them into the queue (READ into a pooled
//! aligned buffer that becomes the reply's data, WRITE from a pooled buffer the payload was
//! read into) and submits each burst — everything the read buffer holds — with one system
//! call. A completion thread sleeps on the queue's eventfd, collects finished requests and
//! sends their replies, several in one `writev`. The queue sits behind a mutex the two
//! threads take briefly (push/submit, drain); socket writes are serialised by another.
//! BLOCK_STATUS (a metadata lookup) and refusals are answered by the connection thread.
//!
//! Back-pressure: at most `queue_depth` requests and `max_in_flight_bytes` payload bytes are
//! in flight; the connection thread submits what it pushed and then waits for completions.

use super::reply::{
    block_status, read_reply_header, refuse_oversized_write, reply_status, ReplyBuffer,
    READ_REPLY_HEADER_MAX,
};
use super::{
    check_request, errno_of, io_kind, lock, read_request_header, ConnectionConfig, Session,
};
use crate::protocol::*;
use crate::socket::Socket;
use crate::Error;
use cryptblk_block::aio::{open_queue, Completion, IoOp, IoQueue, IoRequest, IoVec, QueueOptions};
use cryptblk_block::{AlignedBuf, IoKind};
use std::io::{self, BufRead, BufReader, IoSlice, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// Reader buffer: large enough to take a burst of queued 4 KiB writes in one `read`.
const READ_BUFFER_LEN: usize = 256 << 10;
/// Pooled buffers above this size are freed instead of kept, so one 32 MiB request does not
/// pin 32 MiB for the rest of the connection.
const MAX_POOLED_BUFFER: usize = 1 << 20;
/// What an idle connection keeps in pooled buffers at most.
const MAX_POOLED_BYTES: usize = 8 << 20;
/// Replies sent per `writev` at most (two iovecs each; IOV_MAX is 1024).
const REPLIES_PER_WRITE: usize = 256;

/// A request between push and reply.
struct Job {
    request: RequestHeader,
    started: Instant,
    /// READ: the data read; WRITE: the payload.
    buf: Option<AlignedBuf>,
    budget_bytes: u64,
    /// TRIM / WRITE_ZEROES with FUA: a flush follows before the reply.
    flush_after: bool,
}

/// What the two threads share under the queue mutex.
struct IoSide {
    queue: Box<dyn IoQueue>,
    /// Jobs in flight by tag.
    jobs: Vec<Option<Job>>,
    free: Vec<u32>,
    /// Pushed but not yet submitted.
    unsubmitted: bool,
}

/// Requests and payload bytes in flight.
#[derive(Default)]
struct Budget {
    requests: usize,
    bytes: u64,
}

struct Pipeline<'s, 'e> {
    session: &'s Session<'e>,
    socket: &'s Socket,
    io: Mutex<IoSide>,
    /// Serialises writes to the socket.
    writer: Mutex<()>,
    budget: Mutex<Budget>,
    freed: Condvar,
    max_requests: usize,
    max_bytes: u64,
    buffers: BufferPool,
    /// Replies can no longer be delivered; the reader stops.
    broken: AtomicBool,
    /// The reader has stopped taking requests: the completion thread ends once every
    /// request in flight is answered.
    reader_done: AtomicBool,
    /// A second handle on the queue's eventfd: the completion thread sleeps on it, the
    /// reader pokes it when it stops.
    wake: cryptblk_block::aio::Notifier,
}

/// Aligned buffers for READ data and WRITE payloads, reused across requests.
#[derive(Default)]
struct BufferPool {
    idle: Mutex<(Vec<AlignedBuf>, usize)>,
}

impl BufferPool {
    /// A buffer of at least `len` bytes (contents unspecified).
    fn take(&self, len: usize) -> AlignedBuf {
        let mut idle = lock(&self.idle);
        if let Some(i) = idle.0.iter().position(|b| b.len() >= len) {
            let buf = idle.0.swap_remove(i);
            idle.1 -= buf.len();
            return buf;
        }
        drop(idle);
        // Whole 4 KiB units, so a buffer serves the next request of a similar size.
        AlignedBuf::zeroed(len.max(1).next_multiple_of(4096))
    }

    fn put(&self, buf: AlignedBuf) {
        let mut idle = lock(&self.idle);
        if buf.len() <= MAX_POOLED_BUFFER && idle.1 + buf.len() <= MAX_POOLED_BYTES {
            idle.1 += buf.len();
            idle.0.push(buf);
        }
    }
}

/// Writes all of `slices`, continuing after short writes.
fn write_all_vectored(mut out: &Socket, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match out.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Pipeline<'_, '_> {
    fn send(&self, slices: &mut [IoSlice<'_>]) {
        if self.broken.load(Ordering::Relaxed) {
            return;
        }
        let _writer = lock(&self.writer);
        if let Err(e) = write_all_vectored(self.socket, slices) {
            tracing::debug!(export = %self.session.export.name, "cannot send reply: {e}");
            self.broken.store(true, Ordering::Relaxed);
            // Wake the reader so the connection winds down.
            self.socket.shutdown(Shutdown::Read);
        }
    }

    fn send_one(&self, reply: &[u8]) {
        self.send(&mut [IoSlice::new(reply)]);
    }

    /// Sends what was pushed to the device.
    fn submit(&self, io: &mut IoSide) {
        if !io.unsubmitted {
            return;
        }
        io.unsubmitted = false;
        if let Err(e) = io.queue.submit() {
            tracing::error!(export = %self.session.export.name, "submitting I/O: {e}");
        }
    }

    /// Waits until one more request of `bytes` payload fits in the budget. Submits first,
    /// so that what the reader pushed can complete and free the budget.
    fn acquire(&self, bytes: u64) {
        let mut budget = lock(&self.budget);
        let fits = |b: &Budget| {
            b.requests < self.max_requests && (b.bytes == 0 || b.bytes + bytes <= self.max_bytes)
        };
        if !fits(&budget) {
            drop(budget);
            self.submit(&mut lock(&self.io));
            budget = lock(&self.budget);
            while !fits(&budget) {
                budget = self
                    .freed
                    .wait(budget)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        }
        budget.requests += 1;
        budget.bytes += bytes;
    }

    fn release(&self, requests: usize, bytes: u64) {
        let mut budget = lock(&self.budget);
        budget.requests -= requests;
        budget.bytes -= bytes;
        self.freed.notify_one();
    }

    /// Pushes a job's I/O; on a refusal by the queue (never expected: the budget keeps it
    /// below capacity) answers it with EIO.
    fn push(&self, job: Job, op: IoOp) {
        let mut io = lock(&self.io);
        let Some(tag) = io.free.pop() else {
            drop(io);
            self.fail_now(job, NbdErrno::Io);
            return;
        };
        let request = job.request;
        let mut iov = [IoVec::from_raw(std::ptr::null_mut(), 0)];
        let mut job = job;
        let req = match op {
            IoOp::Read | IoOp::Write => {
                let buf = job
                    .buf
                    .as_mut()
                    .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr());
                iov[0] = IoVec::from_raw(buf, request.length as usize);
                let fua = request.flags & CMD_FLAG_FUA != 0;
                if op == IoOp::Read {
                    IoRequest::read(request.offset, &iov, u64::from(tag))
                } else {
                    IoRequest::write(request.offset, &iov, fua, u64::from(tag))
                }
            }
            IoOp::Flush => IoRequest::flush(u64::from(tag)),
            IoOp::Discard | IoOp::WriteZeroes => IoRequest::range(
                op,
                request.offset,
                u64::from(request.length),
                u64::from(tag),
            ),
        };
        // SAFETY: the buffer belongs to the job, which is parked in `jobs` (and not touched)
        // until its completion has been drained.
        let pushed = unsafe { io.queue.push(&req) };
        if pushed.is_err() {
            io.free.push(tag);
            drop(io);
            self.fail_now(job, NbdErrno::Io);
            return;
        }
        io.jobs[tag as usize] = Some(job);
        io.unsubmitted = true;
    }

    /// Answers a job that never reached the device.
    fn fail_now(&self, job: Job, errno: NbdErrno) {
        let mut reply = ReplyBuffer::default();
        reply_status(self.session, &job.request, Err(errno), &mut reply);
        self.send_one(reply.bytes());
        self.finish_job(job, false);
    }

    /// Records a finished job and gives back its buffer and budget.
    fn finish_job(&self, job: Job, ok: bool) {
        self.session.export.stats.complete(
            io_kind(job.request.command),
            u64::from(job.request.length),
            job.started,
            ok,
        );
        if let Some(buf) = job.buf {
            self.buffers.put(buf);
        }
        self.release(1, job.budget_bytes);
    }
}

/// Serves a plain connection until the client disconnects, the connection fails, or it is
/// shut down from outside (read side closed).
pub(super) fn serve(
    socket: &Socket,
    session: &Session<'_>,
    config: &ConnectionConfig,
) -> Result<(), Error> {
    let depth = config.queue_depth.max(1);
    let queue = open_queue(&session.export.device, &QueueOptions { depth })
        .map_err(|e| Error::Protocol(format!("opening the export's I/O queue: {e}")))?;
    let notifier = queue.notifier();
    let wake = cryptblk_block::aio::Notifier::dup_of(notifier)?;
    let capacity = queue.capacity();
    let pipeline = Pipeline {
        session,
        socket,
        io: Mutex::new(IoSide {
            queue,
            jobs: (0..capacity).map(|_| None).collect(),
            free: (0..capacity as u32).rev().collect(),
            unsubmitted: false,
        }),
        writer: Mutex::new(()),
        budget: Mutex::new(Budget::default()),
        freed: Condvar::new(),
        max_requests: capacity,
        max_bytes: config.max_in_flight_bytes,
        buffers: BufferPool::default(),
        broken: AtomicBool::new(false),
        reader_done: AtomicBool::new(false),
        wake,
    };
    std::thread::scope(|scope| {
        let completer = std::thread::Builder::new()
            .name("nbd-completions".into())
            .spawn_scoped(scope, || complete_requests(&pipeline))?;
        let result = read_requests(&pipeline, socket);
        // Everything pushed goes out; the completion thread answers it and then ends.
        pipeline.submit(&mut lock(&pipeline.io));
        pipeline.reader_done.store(true, Ordering::SeqCst);
        pipeline.wake.notify();
        let _ = completer.join();
        result
    })
}

fn read_requests(pipeline: &Pipeline<'_, '_>, socket: &Socket) -> Result<(), Error> {
    let session = pipeline.session;
    let stats = &session.export.stats;
    let mut reader = BufReader::with_capacity(READ_BUFFER_LEN, socket);
    let mut reply = ReplyBuffer::default();
    loop {
        if pipeline.broken.load(Ordering::Relaxed) {
            return Ok(());
        }
        // A burst ends when the read buffer holds no further request: send it to the device
        // before blocking for more.
        if reader.buffer().is_empty() {
            pipeline.submit(&mut lock(&pipeline.io));
        }
        let request = match read_request_header(&mut reader)? {
            Some(request) if request.command != CMD_DISC => request,
            _ => return Ok(()),
        };
        let started = stats.begin();
        if request.command == CMD_WRITE && request.length > MAX_PAYLOAD {
            let error = refuse_oversized_write(session, &request, &mut reply);
            pipeline.send_one(reply.bytes());
            stats.complete(IoKind::Write, 0, started, false);
            return Err(error);
        }
        let op = match request.command {
            CMD_READ => Some(IoOp::Read),
            CMD_WRITE => Some(IoOp::Write),
            CMD_FLUSH => Some(IoOp::Flush),
            CMD_TRIM => Some(IoOp::Discard),
            CMD_WRITE_ZEROES => Some(IoOp::WriteZeroes),
            _ => None,
        };
        let budget_bytes = match request.command {
            CMD_READ | CMD_WRITE => u64::from(request.length),
            _ => 0,
        };
        pipeline.acquire(budget_bytes);
        let mut job = Job {
            request,
            started,
            buf: None,
            budget_bytes,
            flush_after: matches!(request.command, CMD_TRIM | CMD_WRITE_ZEROES)
                && request.flags & CMD_FLAG_FUA != 0,
        };
        if request.command == CMD_WRITE {
            let mut buf = pipeline.buffers.take(request.length as usize);
            if let Err(e) = read_payload(&mut reader, &mut buf[..request.length as usize]) {
                // A partial payload is never written.
                pipeline.buffers.put(buf);
                pipeline.release(1, budget_bytes);
                stats.complete(IoKind::Write, 0, started, false);
                return Err(e.into());
            }
            job.buf = Some(buf);
        }
        if let Err(errno) = check_request(session, &request) {
            pipeline.fail_now(job, errno);
            continue;
        }
        if matches!(request.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES) {
            session.wrote.store(true, Ordering::Relaxed);
        }
        match op {
            Some(IoOp::Read) => {
                job.buf = Some(pipeline.buffers.take(request.length as usize));
                pipeline.push(job, IoOp::Read);
            }
            Some(op) => pipeline.push(job, op),
            None if request.command == CMD_BLOCK_STATUS => {
                let ok = match block_status(session, &request, &mut reply) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(export = %session.export.name, "block status failed: {e}");
                        reply_status(session, &request, Err(errno_of(&e, false)), &mut reply);
                        false
                    }
                };
                pipeline.send_one(reply.bytes());
                pipeline.finish_job(job, ok);
            }
            None => pipeline.fail_now(job, NbdErrno::Inval),
        }
    }
}

/// Fills `payload` with what the read buffer holds and the rest straight from the socket:
/// refilling the buffer would copy the rest twice.
fn read_payload(reader: &mut BufReader<&Socket>, payload: &mut [u8]) -> io::Result<()> {
    let buffered = reader.buffer().len().min(payload.len());
    payload[..buffered].copy_from_slice(&reader.buffer()[..buffered]);
    reader.consume(buffered);
    reader.get_mut().read_exact(&mut payload[buffered..])
}

/// A finished job and its reply header.
struct Done {
    job: Job,
    header: [u8; READ_REPLY_HEADER_MAX],
    header_len: usize,
    ok: bool,
}

fn complete_requests(pipeline: &Pipeline<'_, '_>) {
    let session = pipeline.session;
    let mut finished: Vec<Completion> = Vec::new();
    let mut done: Vec<Done> = Vec::new();
    loop {
        pipeline.wake.wait();
        {
            let mut io = lock(&pipeline.io);
            io.queue.drain(&mut |c| finished.push(c));
            for c in finished.drain(..) {
                let Some(mut job) = io.jobs.get_mut(c.tag as usize).and_then(Option::take) else {
                    continue;
                };
                if c.result.is_ok() && job.flush_after {
                    // TRIM / WRITE_ZEROES with FUA: durable before the reply.
                    job.flush_after = false;
                    let req = IoRequest::flush(c.tag);
                    // SAFETY: a flush carries no buffers.
                    if unsafe { io.queue.push(&req) }.is_ok() {
                        io.jobs[c.tag as usize] = Some(job);
                        io.unsubmitted = true;
                        continue;
                    }
                }
                io.free.push(c.tag as u32);
                done.push(reply_for(session, job, c.result));
            }
            pipeline.submit(&mut io);
        }
        for batch in done.chunks(REPLIES_PER_WRITE) {
            // On the stack: sending a batch allocates nothing.
            let mut slices = [IoSlice::new(&[]); 2 * REPLIES_PER_WRITE];
            let mut n = 0;
            for d in batch {
                slices[n] = IoSlice::new(&d.header[..d.header_len]);
                n += 1;
                if d.ok && d.job.request.command == CMD_READ {
                    if let Some(buf) = &d.job.buf {
                        slices[n] = IoSlice::new(&buf[..d.job.request.length as usize]);
                        n += 1;
                    }
                }
            }
            pipeline.send(&mut slices[..n]);
        }
        for d in done.drain(..) {
            pipeline.finish_job(d.job, d.ok);
        }
        let in_flight = lock(&pipeline.io).queue.in_flight();
        if pipeline.reader_done.load(Ordering::SeqCst) && in_flight == 0 {
            return;
        }
    }
}

/// The reply header of a finished job (READ data follows it from the job's buffer).
fn reply_for(
    session: &Session<'_>,
    job: Job,
    result: Result<(), cryptblk_block::BlockError>,
) -> Done {
    let mut header = [0u8; READ_REPLY_HEADER_MAX];
    let request = &job.request;
    match result {
        Ok(()) if request.command == CMD_READ => {
            let header_len = read_reply_header(session, request, &mut header);
            Done {
                job,
                header,
                header_len,
                ok: true,
            }
        }
        Ok(()) => {
            header[..SIMPLE_REPLY_HEADER_LEN]
                .copy_from_slice(&encode_simple_reply(0, request.cookie));
            Done {
                job,
                header,
                header_len: SIMPLE_REPLY_HEADER_LEN,
                ok: true,
            }
        }
        Err(e) => {
            tracing::warn!(export = %session.export.name, "request failed: {e}");
            let modifies = matches!(request.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
            let mut reply = ReplyBuffer::default();
            reply_status(session, request, Err(errno_of(&e, modifies)), &mut reply);
            let bytes = reply.bytes();
            let header_len = bytes.len().min(READ_REPLY_HEADER_MAX);
            header[..header_len].copy_from_slice(&bytes[..header_len]);
            Done {
                job,
                header,
                header_len,
                ok: false,
            }
        }
    }
}
