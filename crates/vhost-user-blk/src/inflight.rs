//! vhost-user inflight I/O tracking (VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD) for split rings,
//! and what a ring needs when it starts after a daemon restart.
//!
//! The frontend (QEMU) gets a shared memory region from the daemon (GET_INFLIGHT_FD), keeps it
//! for as long as the VM's device lives and hands it to every daemon that connects
//! (SET_INFLIGHT_FD). In it the daemon records which descriptor heads it has taken from each
//! ring and not yet put on the used ring. A daemon that dies (crash, `kill -9`, OOM) leaves
//! that record behind: its successor resubmits exactly those heads, in the order they were
//! taken, and resumes the available ring after them, whatever order requests completed in. A
//! frontend on its own can only restart a ring at used->idx (QEMU 7.2 does), which runs some
//! requests twice and never answers others once completions were out of order.
//!
//! Layout (vhost-user spec, "Inflight I/O tracking"; as libvhost-user and QEMU lay it out):
//! one part per queue, `queue_part_size(queue_size)` bytes each, made of a 16-byte header
//! {features u64, version u16, desc_num u16, last_batch_head u16, used_idx u16} and one
//! 16-byte entry per descriptor {inflight u8, padding [u8; 5], next u16, counter u64}.
//!
//! Protocol per ring; every step is one atomic store, so a daemon killed between any two
//! leaves a record its successor reads correctly:
//! - take a head from the available ring: its counter = the ring's next counter, inflight = 1;
//! - complete it, under the ring's lock so completions happen one at a time:
//!   last_batch_head = head, then the used ring entry and used->idx, then inflight = 0 and
//!   used_idx = used->idx;
//! - ring start (`Rings::ring_started`): a fresh region (version 0) only gets version 1 and
//!   used_idx = used->idx, so that a later start never takes its zeroed last_batch_head for a
//!   real completion and clears descriptor 0 (SPDK issue #3766). Otherwise, when used->idx is
//!   one past used_idx, the last completion reached the used ring without being recorded:
//!   last_batch_head is cleared. Every head still marked is resubmitted, oldest counter first,
//!   and the ring resumes taking heads at used->idx + their number.
//!
//! The region is untrusted input: SET_INFLIGHT_FD is checked against what this daemon serves
//! (queue count, queue size, the file's size and that it is sealed against shrinking, so it
//! cannot be truncated under the mapping) before it is mapped, and heads read from it are
//! checked against the ring's size. Resubmitted chains go through the same parser as any other.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use vhost::vhost_user::message::VhostUserInflight;
use vhost_user_backend::{VringRwLock, VringT};
use virtio_queue::{Error as QueueError, QueueT};
use vm_memory::mmap::MmapRegion;
use vm_memory::{Bytes, FileOffset, GuestMemoryAtomic, VolatileMemory};

use crate::fault::{self, Point};
use crate::GuestMem;

type Vring = VringRwLock<GuestMemoryAtomic<GuestMem>>;

/// Each queue's part starts on a 64-byte boundary.
const PART_ALIGN: u64 = 64;
/// The region version this daemon writes and reads.
const VERSION: u16 = 1;

// Header fields and descriptor entry fields (byte offsets).
const VERSION_AT: usize = 8;
const DESC_NUM_AT: usize = 10;
const LAST_BATCH_HEAD_AT: usize = 12;
const USED_IDX_AT: usize = 14;
const HEADER_LEN: usize = 16;
const ENTRY_LEN: usize = 16;
const INFLIGHT_AT: usize = 0;
const COUNTER_AT: usize = 8;

/// Bytes of one queue's part of the region: ALIGN_UP(16 * queue_size + 2, 64), the size
/// libvhost-user and QEMU use (it always has room for the 16-byte header as well).
pub fn queue_part_size(queue_size: u16) -> u64 {
    (16 * u64::from(queue_size) + 2).div_ceil(PART_ALIGN) * PART_ALIGN
}

/// Why a frontend's GET/SET_INFLIGHT_FD was refused.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("inflight region for {requested} queues, but this device has {served}")]
    QueueCount { requested: u16, served: u16 },
    #[error("inflight region for queues of {requested} entries, but this device's queues have at most {max}")]
    QueueSize { requested: u16, max: u16 },
    #[error("inflight region of {given} bytes, but {needed} are needed for {queues} queues of {queue_size}")]
    TooSmall {
        given: u64,
        needed: u64,
        queues: u16,
        queue_size: u16,
    },
    #[error("inflight region file is {len} bytes, shorter than offset {offset} + {needed} bytes")]
    FileTooShort { len: u64, offset: u64, needed: u64 },
    #[error("inflight region file is not sealed against shrinking (F_SEAL_SHRINK), so it could be truncated under the mapping; pass the memfd GET_INFLIGHT_FD returned")]
    NotSealed,
    #[error("creating the inflight region: {0}")]
    Create(io::Error),
    #[error("mapping the inflight region: {0}")]
    Map(vm_memory::mmap::MmapRegionError),
}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        let kind = match e {
            Error::Create(_) | Error::Map(_) => io::ErrorKind::Other,
            _ => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, e)
    }
}

/// Creates a region for `num_queues` queues of `queue_size` entries: a sealed memfd (it can
/// neither grow nor shrink), all zeros (version 0: fresh).
fn create_region(num_queues: u16, queue_size: u16) -> Result<(File, u64), Error> {
    let size = u64::from(num_queues) * queue_part_size(queue_size);
    // SAFETY: the name is a NUL-terminated string; the result is checked before use.
    let fd = unsafe {
        libc::memfd_create(
            c"cryptblk-inflight".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(Error::Create(io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).map_err(Error::Create)?;
    let seals = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor owned by `file`, with an integer argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(Error::Create(io::Error::last_os_error()));
    }
    Ok((file, size))
}

/// A mapped inflight region, shared with the frontend.
struct Region {
    map: MmapRegion<()>,
    num_queues: u16,
    queue_size: u16,
}

impl Region {
    /// Maps the region SET_INFLIGHT_FD passed, after checking it against what the device
    /// serves (`num_queues` queues of at most `max_queue_size` entries).
    fn open(
        file: File,
        msg: &VhostUserInflight,
        num_queues: u16,
        max_queue_size: u16,
    ) -> Result<Region, Error> {
        if msg.num_queues == 0 || msg.num_queues > num_queues {
            return Err(Error::QueueCount {
                requested: msg.num_queues,
                served: num_queues,
            });
        }
        if msg.queue_size == 0 || msg.queue_size > max_queue_size {
            return Err(Error::QueueSize {
                requested: msg.queue_size,
                max: max_queue_size,
            });
        }
        let needed = u64::from(msg.num_queues) * queue_part_size(msg.queue_size);
        if msg.mmap_size < needed {
            return Err(Error::TooSmall {
                given: msg.mmap_size,
                needed,
                queues: msg.num_queues,
                queue_size: msg.queue_size,
            });
        }
        // SAFETY: fcntl on a descriptor owned by `file`, no pointer argument.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::NotSealed);
        }
        let len = file.metadata().map_err(Error::Create)?.len();
        if msg
            .mmap_offset
            .checked_add(needed)
            .is_none_or(|end| end > len)
        {
            return Err(Error::FileTooShort {
                len,
                offset: msg.mmap_offset,
                needed,
            });
        }
        // `needed` is at most 64 queues of 1024 entries: a few MiB, fits usize.
        let map = MmapRegion::from_file(FileOffset::new(file, msg.mmap_offset), needed as usize)
            .map_err(Error::Map)?;
        Ok(Region {
            map,
            num_queues: msg.num_queues,
            queue_size: msg.queue_size,
        })
    }
}

/// One queue's part of a region, as a ring uses it between its start and its stop.
pub(crate) struct QueuePart {
    region: Arc<Region>,
    /// Offset of the part in the region.
    base: usize,
    /// Entries in the part (the region's queue size).
    entries: u16,
    /// The counter the next head taken gets.
    next_counter: AtomicU64,
}

impl QueuePart {
    fn new(region: &Arc<Region>, queue: u16) -> Option<QueuePart> {
        if queue >= region.num_queues {
            return None;
        }
        let base = usize::from(queue) * queue_part_size(region.queue_size) as usize;
        Some(QueuePart {
            region: region.clone(),
            base,
            entries: region.queue_size,
            next_counter: AtomicU64::new(0),
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

    fn entry(&self, head: u16) -> Option<usize> {
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
    pub(crate) fn popped(&self, head: u16) {
        let Some(e) = self.entry(head) else { return };
        let counter = self.next_counter.fetch_add(1, Ordering::Relaxed);
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
    fn recover(&self, used_idx: u16, ring_size: u16, queue: usize) -> (Vec<u16>, Option<u16>) {
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
        self.next_counter.store(next_counter, Ordering::Relaxed);
        let resume = used_idx.wrapping_add(pending.len() as u16);
        (pending.into_iter().map(|(_, h)| h).collect(), Some(resume))
    }
}

/// Puts `head` on the used ring with `len` bytes written, recording the completion in the
/// ring's inflight part (when it has one) around the used ring update, all under the ring's
/// lock, so that at most one completion is ever between the used ring and the record.
pub(crate) fn add_used(
    vring: &Vring,
    part: Option<&QueuePart>,
    head: u16,
    len: u32,
) -> Result<(), QueueError> {
    let Some(part) = part else {
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

/// What one ring has between its start and its stop.
#[derive(Default)]
struct RingSlot {
    /// The ring, while it runs (to signal the guest, and to resubmit from `stop_vring`).
    vring: Option<Vring>,
    /// Its inflight part, when the frontend shared a region covering it.
    part: Option<Arc<QueuePart>>,
    /// Heads a predecessor took and did not complete, oldest first, not resubmitted yet.
    resubmit: Vec<u16>,
}

/// The rings of one connection and its inflight region.
pub(crate) struct Rings {
    num_queues: u16,
    max_queue_size: u16,
    region: Mutex<Option<Arc<Region>>>,
    slots: Vec<Mutex<RingSlot>>,
}

impl Rings {
    pub(crate) fn new(num_queues: u16, max_queue_size: u16) -> Rings {
        Rings {
            num_queues,
            max_queue_size,
            region: Mutex::new(None),
            slots: (0..num_queues)
                .map(|_| Mutex::new(RingSlot::default()))
                .collect(),
        }
    }

    fn slot(&self, queue: usize) -> Option<std::sync::MutexGuard<'_, RingSlot>> {
        self.slots
            .get(queue)
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// GET_INFLIGHT_FD: a new, zeroed region for the queue count and size the frontend asks.
    pub(crate) fn get_fd(&self, msg: &VhostUserInflight) -> io::Result<(VhostUserInflight, File)> {
        if msg.num_queues == 0 || msg.num_queues > self.num_queues {
            return Err(Error::QueueCount {
                requested: msg.num_queues,
                served: self.num_queues,
            }
            .into());
        }
        if msg.queue_size == 0 || msg.queue_size > self.max_queue_size {
            return Err(Error::QueueSize {
                requested: msg.queue_size,
                max: self.max_queue_size,
            }
            .into());
        }
        let (file, size) = create_region(msg.num_queues, msg.queue_size)?;
        tracing::info!(
            "inflight region: {size} bytes for {} queues of {}",
            msg.num_queues,
            msg.queue_size
        );
        Ok((
            VhostUserInflight::new(size, 0, msg.num_queues, msg.queue_size),
            file,
        ))
    }

    /// SET_INFLIGHT_FD: the region rings record into from their next start.
    pub(crate) fn set_fd(&self, msg: &VhostUserInflight, file: File) -> io::Result<()> {
        let region = Region::open(file, msg, self.num_queues, self.max_queue_size)?;
        *self.region.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(region));
        Ok(())
    }

    /// Ring `queue` was started (SET_VRING_KICK with its addresses and base set), on the
    /// message thread, before the ring's worker may touch it: takes over what a predecessor
    /// left in the inflight region, sets where the ring resumes and keeps the heads to
    /// resubmit for the worker (`take_resubmits`).
    pub(crate) fn ring_started(&self, queue: usize, vring: &Vring) {
        let region = self
            .region
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(mut slot) = self.slot(queue) else {
            return;
        };
        slot.vring = Some(vring.clone());
        slot.part = None;
        slot.resubmit.clear();
        let Some(region) = region else { return };
        let Some(part) = u16::try_from(queue)
            .ok()
            .and_then(|q| QueuePart::new(&region, q))
        else {
            tracing::warn!("queue {queue}: the inflight region has no part for it; not tracked");
            return;
        };
        let ring_size = vring.get_ref().get_queue().size();
        if ring_size > part.entries {
            tracing::warn!(
                "queue {queue}: ring of {ring_size} entries but the inflight region tracks {}; \
                 not tracked",
                part.entries
            );
            return;
        }
        let used_idx = match vring.queue_used_idx() {
            Ok(idx) => idx,
            Err(e) => {
                tracing::warn!("queue {queue}: cannot read the used index ({e}); not tracked");
                return;
            }
        };
        let (resubmit, resume) = part.recover(used_idx, ring_size, queue);
        if let Some(next_avail) = resume {
            if next_avail != vring.queue_next_avail() || !resubmit.is_empty() {
                tracing::info!(
                    "queue {queue}: resuming at available index {next_avail} (used index \
                     {used_idx}), resubmitting {} request(s) taken before a restart",
                    resubmit.len()
                );
            }
            vring.set_queue_next_avail(next_avail);
        }
        slot.part = Some(Arc::new(part));
        slot.resubmit = resubmit;
    }

    /// Ring `queue` was stopped (GET_VRING_BASE) and has nothing in flight.
    pub(crate) fn ring_stopped(&self, queue: usize) {
        if let Some(mut slot) = self.slot(queue) {
            *slot = RingSlot::default();
        }
    }

    /// The ring's inflight part while it runs and is tracked.
    pub(crate) fn part(&self, queue: usize) -> Option<Arc<QueuePart>> {
        self.slot(queue).and_then(|s| s.part.clone())
    }

    /// The heads to resubmit (oldest first), once: whoever takes them runs them.
    pub(crate) fn take_resubmits(&self, queue: usize) -> Vec<u16> {
        self.slot(queue)
            .map(|mut s| std::mem::take(&mut s.resubmit))
            .unwrap_or_default()
    }

    /// The ring, while it runs.
    pub(crate) fn vring(&self, queue: usize) -> Option<Vring> {
        self.slot(queue).and_then(|s| s.vring.clone())
    }

    /// Signals the guest on every running ring, whether or not it asked for a notification.
    pub(crate) fn signal_all(&self) {
        for queue in 0..self.slots.len() {
            if let Some(vring) = self.vring(queue) {
                if let Err(e) = vring.signal_used_queue() {
                    tracing::warn!("queue {queue}: signalling the guest: {e}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_sizes_are_libvhost_users() {
        // ALIGN_UP(16 * n + 2, 64), never less than header + entries.
        assert_eq!(queue_part_size(1), 64);
        assert_eq!(queue_part_size(3), 64);
        assert_eq!(queue_part_size(4), 128);
        assert_eq!(queue_part_size(128), 2112);
        assert_eq!(queue_part_size(256), 4160);
        assert_eq!(queue_part_size(1024), 16448);
        for n in 1..=1024u16 {
            assert!(queue_part_size(n) >= 16 + 16 * u64::from(n));
        }
    }

    fn region(queues: u16, size: u16) -> Arc<Region> {
        let (file, len) = create_region(queues, size).unwrap();
        Arc::new(Region::open(file, &VhostUserInflight::new(len, 0, queues, size), 8, 256).unwrap())
    }

    #[test]
    fn fresh_region_starts_where_the_ring_is_and_resubmits_nothing() {
        let r = region(1, 8);
        let part = QueuePart::new(&r, 0).unwrap();
        // A migrated or long-running ring: used index far from 0. Descriptor 0 is not taken
        // for a completion (SPDK #3766): nothing is cleared or resubmitted.
        assert_eq!(part.recover(500, 8, 0), (vec![], None));
        assert_eq!(part.load16(VERSION_AT), VERSION);
        assert_eq!(part.load16(USED_IDX_AT), 500);
        part.popped(0);
        part.popped(3);
        // The daemon dies; its successor resubmits both, the ring resumes after them.
        let next = QueuePart::new(&r, 0).unwrap();
        assert_eq!(next.recover(500, 8, 0), (vec![0, 3], Some(502)));
    }

    #[test]
    fn resubmits_in_counter_order_and_clears_a_completion_not_recorded() {
        let r = region(2, 8);
        let part = QueuePart::new(&r, 1).unwrap();
        part.recover(10, 8, 1);
        for head in [5, 2, 7, 1] {
            part.popped(head);
        }
        // 2 completed fully; 7 reached the used ring (11 -> 12) but was not cleared.
        part.store16(LAST_BATCH_HEAD_AT, 2);
        part.set_inflight(2, false);
        part.store16(USED_IDX_AT, 11);
        part.store16(LAST_BATCH_HEAD_AT, 7);
        let next = QueuePart::new(&r, 1).unwrap();
        assert_eq!(next.recover(12, 8, 1), (vec![5, 1], Some(14)));
        assert!(!next.inflight(7));
        // New heads continue the counter after the oldest-first resubmissions.
        next.popped(3);
        assert!(next.counter(3) > next.counter(1));
        // Queue 0's part is untouched.
        let q0 = QueuePart::new(&r, 0).unwrap();
        assert_eq!(q0.load16(VERSION_AT), 0);
    }

    #[test]
    fn heads_outside_the_ring_are_dropped() {
        let r = region(1, 16);
        let part = QueuePart::new(&r, 0).unwrap();
        part.recover(0, 16, 0);
        part.popped(12);
        part.popped(1);
        assert_eq!(part.recover(0, 8, 0), (vec![1], Some(1)));
        assert!(!part.inflight(12));
    }

    #[test]
    fn set_inflight_fd_is_checked_before_mapping() {
        let rings = Rings::new(2, 256);
        let msg = |q, s| VhostUserInflight::new(0, 0, q, s);
        assert!(rings.get_fd(&msg(3, 256)).is_err());
        assert!(rings.get_fd(&msg(2, 512)).is_err());
        assert!(rings.get_fd(&msg(0, 256)).is_err());
        let (reply, file) = rings.get_fd(&msg(2, 128)).unwrap();
        assert_eq!(reply.mmap_size, 2 * 2112);
        assert_eq!(file.metadata().unwrap().len(), reply.mmap_size);
        let dup = || file.try_clone().unwrap();
        let with = |size, offset, q, s| VhostUserInflight::new(size, offset, q, s);
        let refused = |m: VhostUserInflight, f: File| rings.set_fd(&m, f).unwrap_err().to_string();
        assert!(refused(with(4224, 0, 3, 128), dup()).contains("3 queues"));
        assert!(refused(with(4224, 0, 2, 1024), dup()).contains("at most 256"));
        assert!(refused(with(4000, 0, 2, 128), dup()).contains("4224 are needed"));
        assert!(refused(with(4224, 4096, 2, 128), dup()).contains("shorter than"));
        // A file that could be truncated under the mapping (here an unsealed one).
        let plain = tempfile::tempfile().unwrap();
        plain.set_len(8192).unwrap();
        assert!(refused(with(4224, 0, 2, 128), plain).contains("F_SEAL_SHRINK"));
        // The memfd itself cannot be shrunk (sealed), and is accepted.
        assert!(file.set_len(10).is_err());
        rings.set_fd(&reply, dup()).unwrap();
    }
}
