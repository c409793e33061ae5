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
//! - ring start (`InflightRegion::ring_started`): a fresh region (version 0) only gets version 1 and
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

mod record;

use rustix::fs::{fcntl_add_seals, fcntl_get_seals, memfd_create, MemfdFlags, SealFlags};
use std::fs::File;
use std::io;
use std::sync::{Arc, Mutex, PoisonError};

use vhost::vhost_user::message::VhostUserInflight;
use vhost_user_backend::{VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, GuestMemoryAtomic};

use crate::GuestMem;
pub(crate) use record::{add_used, RingRecord};

type Vring = VringRwLock<GuestMemoryAtomic<GuestMem>>;

/// Each queue's part starts on a 64-byte boundary.
const PART_ALIGN: u64 = 64;
/// The region version this daemon writes and reads.
pub(crate) const VERSION: u16 = 1;

// Header fields and descriptor entry fields (byte offsets).
pub(crate) const VERSION_AT: usize = 8;
pub(crate) const DESC_NUM_AT: usize = 10;
pub(crate) const LAST_BATCH_HEAD_AT: usize = 12;
pub(crate) const USED_IDX_AT: usize = 14;
pub(crate) const HEADER_LEN: usize = 16;
pub(crate) const ENTRY_LEN: usize = 16;
pub(crate) const INFLIGHT_AT: usize = 0;
pub(crate) const COUNTER_AT: usize = 8;

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
pub(crate) fn create_region(num_queues: u16, queue_size: u16) -> Result<(File, u64), Error> {
    let size = u64::from(num_queues) * queue_part_size(queue_size);
    let fd = memfd_create(
        "cryptblk-inflight",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(|e| Error::Create(e.into()))?;
    let file = File::from(fd);
    file.set_len(size).map_err(Error::Create)?;
    let seals = SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL;
    fcntl_add_seals(&file, seals).map_err(|e| Error::Create(e.into()))?;
    Ok((file, size))
}

/// A mapped inflight region, shared with the frontend.
pub(crate) struct Region {
    pub(crate) map: MmapRegion<()>,
    pub(crate) num_queues: u16,
    pub(crate) queue_size: u16,
}

impl Region {
    /// Maps the region SET_INFLIGHT_FD passed, after checking it against what the device
    /// serves (`num_queues` queues of at most `max_queue_size` entries).
    pub(crate) fn open(
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
        if !fcntl_get_seals(&file).is_ok_and(|seals| seals.contains(SealFlags::SHRINK)) {
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

/// The inflight region of one connection, as the message thread sees it: created or set by
/// the frontend, read when a ring starts.
pub(crate) struct InflightRegion {
    num_queues: u16,
    max_queue_size: u16,
    /// Only the message thread uses it; a lock because the backend is shared (`Sync`).
    region: Mutex<Option<Arc<Region>>>,
}

/// What a ring starts with: its inflight record, when the region covers it, and the heads a
/// predecessor took and did not complete, oldest first.
#[derive(Default)]
pub(crate) struct RingStart {
    pub(crate) record: Option<RingRecord>,
    pub(crate) resubmit: Vec<u16>,
}

impl InflightRegion {
    pub(crate) fn new(num_queues: u16, max_queue_size: u16) -> InflightRegion {
        InflightRegion {
            num_queues,
            max_queue_size,
            region: Mutex::new(None),
        }
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
    /// left in the inflight region and sets where the ring resumes; returns the record and
    /// the heads to resubmit, for the worker.
    pub(crate) fn ring_started(&self, queue: usize, vring: &Vring) -> RingStart {
        let region = self
            .region
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(region) = region else {
            return RingStart::default();
        };
        let Some(mut record) = u16::try_from(queue)
            .ok()
            .and_then(|q| RingRecord::new(&region, q))
        else {
            tracing::warn!("queue {queue}: the inflight region has no part for it; not tracked");
            return RingStart::default();
        };
        let ring_size = vring.get_ref().get_queue().size();
        if ring_size > record.entries {
            tracing::warn!(
                "queue {queue}: ring of {ring_size} entries but the inflight region tracks {}; \
                 not tracked",
                record.entries
            );
            return RingStart::default();
        }
        let used_idx = match vring.queue_used_idx() {
            Ok(idx) => idx,
            Err(e) => {
                tracing::warn!("queue {queue}: cannot read the used index ({e}); not tracked");
                return RingStart::default();
            }
        };
        let (resubmit, resume) = record.recover(used_idx, ring_size, queue);
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
        RingStart {
            record: Some(record),
            resubmit,
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

    #[test]
    fn set_inflight_fd_is_checked_before_mapping() {
        let rings = InflightRegion::new(2, 256);
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
