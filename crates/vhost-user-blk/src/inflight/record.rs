//! One ring's part of the inflight region: marking heads taken, recording completions around
//! the used ring update, and reading back what a predecessor left (the protocol in the
//! parent module's doc).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use vhost_user_backend::VringT;
use virtio_queue::{Error as QueueError, QueueT};
use vm_memory::{Bytes, VolatileMemory};

use super::{
    queue_part_size, Region, Vring, COUNTER_AT, DESC_NUM_AT, ENTRY_LEN, HEADER_LEN, INFLIGHT_AT,
    LAST_BATCH_HEAD_AT, USED_IDX_AT, VERSION, VERSION_AT,
};
use crate::fault::{self, Point};

/// One ring's part of the region (its inflight record), owned by the ring's worker between
/// the ring's start and its stop.
pub(crate) struct RingRecord {
    region: Arc<Region>,
    /// Offset of the part in the region.
    base: usize,
    /// Entries in the part (the region's queue size).
    pub(super) entries: u16,
    /// The counter the next head taken gets.
    next_counter: u64,
}

impl RingRecord {
    pub(super) fn new(region: &Arc<Region>, queue: u16) -> Option<RingRecord> {
        if queue >= region.num_queues {
            return None;
        }
        let base = usize::from(queue) * queue_part_size(region.queue_size) as usize;
        Some(RingRecord {
            region: region.clone(),
            base,
            entries: region.queue_size,
            next_counter: 0,
        })
    }

    fn load16(&self, at: usize) -> u16 {
        // Offsets are within the part and 2-aligned by construction; a failure is a bug.
        self.region
            .map
            .as_volatile_slice()
            .load(self.base + at, Ordering::Acquire)
            .expect("inflight region offset inside the mapping")
    }

    fn store16(&self, at: usize, value: u16) {
        self.region
            .map
            .as_volatile_slice()
            .store(value, self.base + at, Ordering::Release)
            .expect("inflight region offset inside the mapping");
    }

    pub(super) fn entry(&self, head: u16) -> Option<usize> {
        (head < self.entries).then(|| HEADER_LEN + usize::from(head) * ENTRY_LEN)
    }

    fn inflight(&self, head: u16) -> bool {
        self.entry(head).is_some_and(|e| {
            let v: u8 = self
                .region
                .map
                .as_volatile_slice()
                .load(self.base + e + INFLIGHT_AT, Ordering::Acquire)
                .expect("inflight region offset inside the mapping");
            v == 1
        })
    }

    fn set_inflight(&self, head: u16, on: bool) {
        if let Some(e) = self.entry(head) {
            self.region
                .map
                .as_volatile_slice()
                .store(u8::from(on), self.base + e + INFLIGHT_AT, Ordering::Release)
                .expect("inflight region offset inside the mapping");
        }
    }

    fn counter(&self, head: u16) -> u64 {
        self.entry(head).map_or(0, |e| {
            self.region
                .map
                .as_volatile_slice()
                .load(self.base + e + COUNTER_AT, Ordering::Acquire)
                .expect("inflight region offset inside the mapping")
        })
    }

    /// Records that `head` was taken from the available ring.
    pub(crate) fn popped(&mut self, head: u16) {
        let Some(e) = self.entry(head) else { return };
        let counter = self.next_counter;
        self.next_counter = counter.wrapping_add(1);
        self.region
            .map
            .as_volatile_slice()
            .store(counter, self.base + e + COUNTER_AT, Ordering::Release)
            .expect("inflight region offset inside the mapping");
        self.set_inflight(head, true);
    }

    /// Reads the record a predecessor left for a ring whose used->idx is now `used_idx` and
    /// which has `ring_size` entries, repairs it as the module doc says, and returns the heads
    /// to resubmit (oldest first) and where the available ring resumes (None: where the
    /// frontend said).
    pub(super) fn recover(
        &mut self,
        used_idx: u16,
        ring_size: u16,
        queue: usize,
    ) -> (Vec<u16>, Option<u16>) {
        self.store16(DESC_NUM_AT, self.entries);
        let version = self.load16(VERSION_AT);
        if version != VERSION {
            if version != 0 {
                tracing::warn!(
                    "queue {queue}: inflight region has version {version}, not {VERSION}; \
                     starting it afresh (requests it recorded are not resubmitted)"
                );
                for head in 0..self.entries {
                    self.set_inflight(head, false);
                }
            }
            self.store16(LAST_BATCH_HEAD_AT, 0);
            self.store16(USED_IDX_AT, used_idx);
            self.store16(VERSION_AT, VERSION);
            return (Vec::new(), None);
        }
        let recorded = self.load16(USED_IDX_AT);
        match used_idx.wrapping_sub(recorded) {
            0 => {}
            1 => {
                // Completed onto the used ring, then the daemon died before clearing it.
                let last = self.load16(LAST_BATCH_HEAD_AT);
                self.set_inflight(last, false);
            }
            n => tracing::warn!(
                "queue {queue}: inflight region records used index {recorded} but the ring is \
                 at {used_idx} ({n} completions apart, not 0 or 1); resubmitting what it marks"
            ),
        }
        self.store16(USED_IDX_AT, used_idx);
        let mut pending: Vec<(u64, u16)> = Vec::new();
        for head in 0..self.entries {
            if !self.inflight(head) {
                continue;
            }
            if head >= ring_size {
                tracing::warn!(
                    "queue {queue}: inflight region marks descriptor {head}, outside the \
                     ring's {ring_size} entries; dropped"
                );
                self.set_inflight(head, false);
                continue;
            }
            pending.push((self.counter(head), head));
        }
        pending.sort_unstable();
        let next_counter = pending.last().map_or(0, |&(c, _)| c.wrapping_add(1));
        self.next_counter = next_counter;
        let resume = used_idx.wrapping_add(pending.len() as u16);
        (pending.into_iter().map(|(_, h)| h).collect(), Some(resume))
    }
}

/// Puts `head` on the used ring with `len` bytes written, recording the completion in the
/// ring's inflight record (when it has one) around the used ring update, all under the ring's
/// lock, so that at most one completion is ever between the used ring and the record.
pub(crate) fn add_used(
    vring: &Vring,
    record: Option<&RingRecord>,
    head: u16,
    len: u32,
) -> Result<(), QueueError> {
    let Some(part) = record else {
        return vring.add_used(head, len);
    };
    let mut state = vring.get_mut();
    if part.entry(head).is_some() {
        part.store16(LAST_BATCH_HEAD_AT, head);
    }
    fault::hit(Point::Completing);
    state.add_used(head, len)?;
    fault::hit(Point::Used);
    part.set_inflight(head, false);
    part.store16(USED_IDX_AT, state.get_queue().next_used());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inflight::create_region;
    use vhost::vhost_user::message::VhostUserInflight;

    fn region(queues: u16, size: u16) -> Arc<Region> {
        let (file, len) = create_region(queues, size).unwrap();
        Arc::new(Region::open(file, &VhostUserInflight::new(len, 0, queues, size), 8, 256).unwrap())
    }

    #[test]
    fn fresh_region_starts_where_the_ring_is_and_resubmits_nothing() {
        let r = region(1, 8);
        let mut part = RingRecord::new(&r, 0).unwrap();
        // A migrated or long-running ring: used index far from 0. Descriptor 0 is not taken
        // for a completion (SPDK #3766): nothing is cleared or resubmitted.
        assert_eq!(part.recover(500, 8, 0), (vec![], None));
        assert_eq!(part.load16(VERSION_AT), VERSION);
        assert_eq!(part.load16(USED_IDX_AT), 500);
        part.popped(0);
        part.popped(3);
        // The daemon dies; its successor resubmits both, the ring resumes after them.
        let mut next = RingRecord::new(&r, 0).unwrap();
        assert_eq!(next.recover(500, 8, 0), (vec![0, 3], Some(502)));
    }

    #[test]
    fn resubmits_in_counter_order_and_clears_a_completion_not_recorded() {
        let r = region(2, 8);
        let mut part = RingRecord::new(&r, 1).unwrap();
        part.recover(10, 8, 1);
        for head in [5, 2, 7, 1] {
            part.popped(head);
        }
        // 2 completed fully; 7 reached the used ring (11 -> 12) but was not cleared.
        part.store16(LAST_BATCH_HEAD_AT, 2);
        part.set_inflight(2, false);
        part.store16(USED_IDX_AT, 11);
        part.store16(LAST_BATCH_HEAD_AT, 7);
        let mut next = RingRecord::new(&r, 1).unwrap();
        assert_eq!(next.recover(12, 8, 1), (vec![5, 1], Some(14)));
        assert!(!next.inflight(7));
        // New heads continue the counter after the oldest-first resubmissions.
        next.popped(3);
        assert!(next.counter(3) > next.counter(1));
        // Queue 0's part is untouched.
        let q0 = RingRecord::new(&r, 0).unwrap();
        assert_eq!(q0.load16(VERSION_AT), 0);
    }

    #[test]
    fn heads_outside_the_ring_are_dropped() {
        let r = region(1, 16);
        let mut part = RingRecord::new(&r, 0).unwrap();
        part.recover(0, 16, 0);
        part.popped(12);
        part.popped(1);
        assert_eq!(part.recover(0, 8, 0), (vec![1], Some(1)));
        assert!(!part.inflight(12));
    }
}
