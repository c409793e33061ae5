//! Taking requests from the ring: pop (or resubmit after a restart), mark in the inflight
//! record, parse, plan and push into the I/O queue under a free tag, submit in batches.

use std::io;
use std::sync::Arc;

use cryptblk_block::aio::{IoOp, MemoryOwner};

use vhost_user_backend::VringT;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestAddressSpace};

use super::answer::{add_used, signal};
use super::{event_idx, Pending, Ring, Worker};
use crate::chain::Chain;
use crate::config::SIZE_MAX;
use crate::device::{Start, STATUS_IOERR, STATUS_OK};
use crate::fault::{self, Point};
use crate::request;
use crate::{GuestMem, GuestRam};

/// Requests popped in one run that are submitted (and their completions collected) together.
/// Measured on 2 vCPUs with the libblkio client, 4 KiB requests at depth 32 from tmpfs, one
/// queue: submitting a whole run at once gave 300k IOPS (raw) / 330k (LUKS2), the server
/// idle a third of the time while the guest waited for the run's end; batches of 16 gave
/// 550k / 420k; 4 and 8 less than 16, 24 no more.
const SUBMIT_BATCH: usize = 16;

/// Bytes of writes pushed since the last submit that send the batch to the device early. An
/// encrypted volume encrypts each write as it is pushed, so a batch of 16 64 KiB writes was
/// 1 MiB of encryption (about 120 µs here) before the first of them reached the device.
/// Measured (`cryptblk-bench read-path`, 64 KiB writes at depth 16 on ext4, LUKS2, each
/// against the previous binary in the same rounds): 128 KiB gave 1.37x the IOPS of batches
/// of 16, 64 KiB a further 1.15x; the LUKS2 server then writes as fast as fio does on the
/// same payload (0.97-0.99). Reads are decrypted after they complete, so going early gains
/// them little (on ext4, 64 KiB reads batched by 16 made 0.95 of one by one, median of three
/// rounds from 0.83 to 0.99), and on tmpfs, where the `threads` engine runs a batch of
/// one on the queue's own thread instead of waking a pool thread, counting them made 64 KiB
/// reads one core's work: 0.61x (`cryptblk-bench run --preset serve --baseline`).
const SUBMIT_BYTES: u64 = 64 << 10;

impl Worker {
    /// Serves the ring after a kick, a start or an enable: after a start (or an enable), first
    /// what a predecessor daemon left in the inflight record, then every available request; submits,
    /// answers what already completed and signals the guest (after a start, even with
    /// nothing to do: completions a killed predecessor put on the used ring may never have
    /// been signalled).
    pub(super) fn serve_ring(&mut self) -> io::Result<()> {
        let Some(mut ring) = self.ring.take() else {
            return Ok(());
        };
        let result = self.serve(&mut ring);
        self.ring = Some(ring);
        result
    }

    fn serve(&mut self, ring: &mut Ring) -> io::Result<()> {
        let started = std::mem::take(&mut ring.start_seen);
        let resubmit = if started {
            std::mem::take(&mut ring.resubmit)
        } else {
            Vec::new()
        };
        let mut answered = false;
        if event_idx(&self.ctx) {
            // Keep taking until the guest added nothing between the last pop and re-enabling
            // notifications (virtio's EVENT_IDX protocol), so no kick is lost.
            let mut resubmit = resubmit.as_slice();
            let mut empty_passes = 0;
            loop {
                ring.vring
                    .disable_notification()
                    .map_err(|e| io::Error::other(format!("disable_notification: {e}")))?;
                let taken = self.take_requests(ring, std::mem::take(&mut resubmit), true)?;
                answered |= taken.answered;
                // A ring that says it has requests but yields none (an available index the
                // guest set past the ring's size, or a queue its frontend has just stopped)
                // would keep this loop spinning and the worker deaf to its messages: after a
                // second pass that took nothing, wait for the next kick or message instead.
                empty_passes = if taken.popped { 0 } else { empty_passes + 1 };
                if self.draining
                    || empty_passes >= 2
                    || !ring
                        .vring
                        .enable_notification()
                        .map_err(|e| io::Error::other(format!("enable_notification: {e}")))?
                {
                    break;
                }
            }
        } else {
            answered |= self.take_requests(ring, &resubmit, true)?.answered;
        }
        if self.submit_and_answer(ring) || answered {
            signal(&ring.vring)?;
        }
        if started {
            ring.vring.signal_used_queue()?;
        }
        Ok(())
    }

    /// Runs the heads a predecessor left in the inflight record on a ring that takes no new requests (a
    /// stop before the worker served the ring's start).
    pub(super) fn take_and_submit(&mut self, resubmit: &[u16]) -> io::Result<()> {
        let Some(mut ring) = self.ring.take() else {
            return Ok(());
        };
        let result = self.take_requests(&mut ring, resubmit, false).and_then(
            |Taken { answered, .. }| {
                if self.submit_and_answer(&ring) || answered {
                    signal(&ring.vring)?;
                }
                Ok(())
            },
        );
        self.ring = Some(ring);
        result
    }

    /// Pushes the heads in `resubmit` (taken by a predecessor daemon, still marked in the
    /// inflight record) and then, with `pop`, every available request into the I/O queue;
    /// rejected chains and requests needing no I/O are answered at once. Returns whether
    /// anything was answered since the guest was last signalled, and whether a request was
    /// popped.
    fn take_requests(&mut self, ring: &mut Ring, resubmit: &[u16], pop: bool) -> io::Result<Taken> {
        let mem = self.mem.memory().into_inner();
        let ram = self.ram_of(&mem);
        self.buffers.set_owner(ram);
        let fua = self.ctx.config.write_through();
        let mut answered = false;
        let mut popped = false;
        // inflight: requests a predecessor daemon took from the ring and did not complete,
        // oldest first. Still marked in the record; parsed and run like new ones.
        if !resubmit.is_empty() {
            let (table, size) = {
                let state = ring.vring.get_ref();
                (state.get_queue().desc_table(), state.get_queue().size())
            };
            for &head in resubmit {
                let chain = Chain::new(&*mem, GuestAddress(table), size, head);
                answered |= self.take_request(&mem, ring, head, chain, fua);
            }
        }
        // A draining worker takes nothing new.
        while pop && !self.draining {
            let chain = ring
                .vring
                .get_mut()
                .get_queue_mut()
                .pop_descriptor_chain(self.mem.memory());
            let Some(chain) = chain else { break };
            popped = true;
            let head = chain.head_index();
            fault::hit(Point::Popped);
            // inflight: mark the head taken before anything else happens to it.
            if let Some(record) = &mut ring.record {
                record.popped(head);
            }
            fault::hit(Point::Marked);
            answered |= self.take_request(&mem, ring, head, chain, fua);
            // A long run of requests goes to the device in batches, each answered as soon
            // as it completes: the guest gets its first completions (and refills its queue)
            // while later requests are still being popped, instead of after the whole run.
            let batch_full =
                self.unsubmitted >= SUBMIT_BATCH || self.unsubmitted_bytes >= SUBMIT_BYTES;
            if batch_full && (self.submit_and_answer(ring) || answered) {
                signal(&ring.vring)?;
                answered = false;
            }
        }
        Ok(Taken { answered, popped })
    }

    /// The owner of request buffers in `mem`: made once per memory table, not per request.
    fn ram_of(&mut self, mem: &Arc<GuestMem>) -> Arc<dyn MemoryOwner> {
        match &self.ram {
            Some((seen, owner)) if Arc::ptr_eq(seen, mem) => owner.clone(),
            _ => {
                let owner = GuestRam::owner(mem.clone());
                self.ram = Some((mem.clone(), owner.clone()));
                owner
            }
        }
    }

    /// Parses the chain of `head` and pushes its I/O, or answers it at once (rejected, or no
    /// I/O needed). Returns whether it was answered.
    fn take_request(
        &mut self,
        mem: &Arc<GuestMem>,
        ring: &Ring,
        head: u16,
        descriptors: impl IntoIterator<Item = Descriptor>,
        fua: bool,
    ) -> bool {
        let ctx = &*self.ctx;
        let mut segments = self.spare_segments.pop().unwrap_or_default();
        let answer = |spare: &mut Vec<_>, segments, used_len| {
            add_used(&ring.vring, ring.record.as_ref(), head, used_len);
            spare.push(segments);
            true
        };
        let req = match request::parse(
            &**mem,
            descriptors,
            ctx.config.max_descriptors(),
            SIZE_MAX,
            ctx.disk.capacity(),
            &mut segments,
        ) {
            Ok(req) => req,
            Err(rejected) => {
                tracing::debug!(disk = %ctx.name, "rejected request: {}", rejected.error);
                let used_len = ctx.disk.reject(&**mem, &rejected);
                return answer(&mut self.spare_segments, segments, used_len);
            }
        };
        let start = self.stats.begin();
        let planned = match ctx.disk.start(&**mem, &req, &segments, &mut self.buffers) {
            Start::Io(planned) => planned,
            Start::Done(status, data_len) => {
                let (status, used_len) = ctx.disk.answer(&**mem, &req, status, data_len);
                let ok = status == STATUS_OK;
                self.stats
                    .complete(super::answer::io_kind(&req), 0, start, ok);
                return answer(&mut self.spare_segments, segments, used_len);
            }
        };
        let Some(tag) = self.free.pop() else {
            // More requests than the ring holds: only a frontend breaking the protocol.
            let (_, used_len) = ctx.disk.answer(&**mem, &req, STATUS_IOERR, 0);
            return answer(&mut self.spare_segments, segments, used_len);
        };
        // The queue keeps the buffers' memory table mapped until it hands the completion out.
        let request = planned.request(&self.buffers, fua, u64::from(tag));
        if self.io.push(&request).is_err() {
            self.free.push(tag);
            let (_, used_len) = ctx.disk.answer(&**mem, &req, STATUS_IOERR, 0);
            return answer(&mut self.spare_segments, segments, used_len);
        }
        self.unsubmitted += 1;
        if request.op == IoOp::Write {
            self.unsubmitted_bytes += request.len;
        }
        self.requests[usize::from(tag)] = Some(Pending {
            head,
            req,
            segments,
            start,
            mem: mem.clone(),
        });
        false
    }
}

/// What one pass of [`take_requests`](Worker::take_requests) did.
struct Taken {
    /// Something was answered since the guest was last signalled.
    answered: bool,
    /// A request was popped from the ring.
    popped: bool,
}
