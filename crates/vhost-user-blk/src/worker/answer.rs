//! Answering requests: completions collected from the I/O queue get their status byte,
//! their used ring entry (recorded in the inflight record around it) and their statistics,
//! each as the I/O queue hands it out; the guest is signalled at the latest `SIGNAL_AFTER`
//! after the first answer it has not heard of.

use std::io;
use std::time::{Duration, Instant};

use cryptblk_block::IoKind;
use vhost_user_backend::VringT;

use super::{Ring, Vring, Worker};
use crate::device::STATUS_OK;
use crate::fault::{self, Point};
use crate::inflight::{self, RingRecord};
use crate::request::{Request, RequestType};

/// Answers put on the used ring wait at most about this long for the guest to be signalled
/// while a batch of completions is being finished.
const SIGNAL_AFTER: Duration = Duration::from_micros(20);

/// What one collection of completions answered.
#[derive(Default)]
pub(super) struct Answered {
    /// Requests put on the used ring.
    pub(super) total: usize,
    /// Of those, put there after the guest was last signalled.
    pub(super) unsignalled: usize,
}

impl Worker {
    /// The I/O queue's eventfd fired: answer what completed.
    pub(super) fn completions(&mut self) -> io::Result<()> {
        if self.answer_completions().unsignalled > 0 {
            if let Some(ring) = &self.ring {
                signal(&ring.vring)?;
            }
        }
        Ok(())
    }

    pub(super) fn answer_completions(&mut self) -> Answered {
        let ring = self.ring.take();
        let answered = self.answer_into(ring.as_ref());
        self.ring = ring;
        answered
    }

    /// Collects the finished requests: status byte, used ring (when the ring is still
    /// there), statistics. Each is put on the used ring as the I/O queue hands it out, and
    /// the guest is signalled whenever answers have waited `SIGNAL_AFTER` (a volume
    /// decrypting a batch hands its reads out one by one), so it refills its queue while the
    /// rest are still being finished.
    pub(super) fn answer_into(&mut self, ring: Option<&Ring>) -> Answered {
        let Worker {
            ctx,
            stats,
            io,
            requests,
            free,
            spare_segments,
            ..
        } = self;
        let mut unsignalled = 0usize;
        let mut n = 0usize;
        let mut first_unsignalled: Option<Instant> = None;
        io.drain(&mut |c| {
            let Some(pending) = usize::try_from(c.tag)
                .ok()
                .and_then(|t| requests.get_mut(t))
                .and_then(Option::take)
            else {
                return;
            };
            if let Err(e) = &c.result {
                tracing::warn!(
                    disk = %ctx.name,
                    "{} of {} bytes at sector {} failed: {e}",
                    pending.req.kind.name(),
                    pending.req.data_len,
                    pending.req.sector
                );
            }
            let (status, used_len) =
                ctx.disk
                    .finish(&*pending.mem, &pending.req, &pending.segments, &c.result);
            let bytes = match pending.req.kind {
                RequestType::In | RequestType::Out => pending.req.data_len,
                _ => 0,
            };
            stats.complete(
                io_kind(&pending.req),
                bytes,
                pending.start,
                status == STATUS_OK,
            );
            if let Some(ring) = ring {
                add_used(&ring.vring, ring.record.as_ref(), pending.head, used_len);
            }
            free.push(c.tag as u16);
            spare_segments.push(pending.segments);
            n += 1;
            unsignalled += 1;
            let now = Instant::now();
            match (first_unsignalled, ring) {
                (Some(t), Some(ring)) if now.duration_since(t) >= SIGNAL_AFTER => {
                    if let Err(e) = signal(&ring.vring) {
                        tracing::warn!(disk = %ctx.name, "signalling the guest: {e}");
                    }
                    first_unsignalled = None;
                    unsignalled = 0;
                }
                (Some(_), _) => {}
                (None, _) => first_unsignalled = Some(now),
            }
        });
        Answered {
            total: n,
            unsignalled,
        }
    }

    /// Submits what was pushed and answers what already completed (page-cache hits finish
    /// inside the submission), optionally polling for more before the thread goes back to
    /// sleep in epoll. Returns whether answers wait for a signal.
    pub(super) fn submit_and_answer(&mut self, ring: &Ring) -> bool {
        self.unsubmitted = 0;
        self.unsubmitted_bytes = 0;
        if let Err(e) = self.io.submit() {
            tracing::error!(disk = %self.ctx.name, "submitting I/O: {e}");
        }
        let mut done = self.answer_into(Some(ring));
        let poll = self.ctx.poll;
        if done.total == 0 && !poll.is_zero() && self.io.in_flight() > 0 {
            let deadline = Instant::now() + poll;
            while done.total == 0 && Instant::now() < deadline {
                std::hint::spin_loop();
                done = self.answer_into(Some(ring));
            }
        }
        done.unsignalled > 0
    }
}

/// Puts a request on the used ring; inflight: recorded around the used ring update, under the
/// ring's lock.
pub(super) fn add_used(vring: &Vring, record: Option<&RingRecord>, head: u16, used_len: u32) {
    if let Err(e) = inflight::add_used(vring, record, head, used_len) {
        // The ring is unusable (e.g. the frontend reset it); the connection's next message
        // or disconnect handles that.
        tracing::warn!("completing request: {e}");
    }
}

pub(super) fn io_kind(req: &Request) -> IoKind {
    match req.kind {
        RequestType::In => IoKind::Read,
        RequestType::Out => IoKind::Write,
        RequestType::Flush => IoKind::Flush,
        RequestType::Discard => IoKind::Discard,
        _ => IoKind::Other,
    }
}

/// Interrupts the guest if it wants to hear about the new used entries (EVENT_IDX).
pub(super) fn signal(vring: &Vring) -> io::Result<()> {
    fault::hit(Point::BeforeSignal);
    if vring
        .needs_notification()
        .map_err(|e| io::Error::other(format!("needs_notification: {e}")))?
    {
        vring.signal_used_queue()?;
    }
    Ok(())
}
