//! What the device tells the guest about itself: the virtio feature bits, the vhost-user
//! protocol features, and the virtio-blk config space (`struct virtio_blk_config`), whose
//! only guest-writable field is the write cache mode.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use crate::device::{VirtioBlkDevice, MAX_DISCARD_SECTORS, MAX_WRITE_ZEROES_SECTORS};
use crate::request::SECTOR_SIZE;

/// Offset of the `writeback` byte in `struct virtio_blk_config`.
const CONFIG_WCE_OFFSET: usize = 32;
/// Bytes of config space this device defines (up to `write_zeroes_may_unmap` and its
/// padding); reads past it return zeros.
const CONFIG_LEN: usize = 60;
/// Largest config read answered (the virtio-blk config struct is well below this).
const CONFIG_MAX: usize = 256;

/// Largest data descriptor accepted (`size_max`, VIRTIO_BLK_F_SIZE_MAX): 1 MiB. Longer ones
/// get IOERR. Linux uses it as the queue's max_segment_size, so it never builds one larger.
pub const SIZE_MAX: u32 = 1 << 20;

/// The virtio feature bits offered for `disk`.
pub(crate) fn features(disk: &VirtioBlkDevice) -> u64 {
    let mut f = (1u64 << VIRTIO_F_VERSION_1)
        | (1 << VIRTIO_RING_F_EVENT_IDX)
        | (1 << VIRTIO_RING_F_INDIRECT_DESC)
        | (1 << VIRTIO_BLK_F_SIZE_MAX)
        | (1 << VIRTIO_BLK_F_SEG_MAX)
        | (1 << VIRTIO_BLK_F_BLK_SIZE)
        | (1 << VIRTIO_BLK_F_TOPOLOGY)
        | (1 << VIRTIO_BLK_F_FLUSH)
        | (1 << VIRTIO_BLK_F_CONFIG_WCE)
        | (1 << VIRTIO_BLK_F_MQ)
        // Dirty page logging for live migration: every guest page the device writes is
        // marked in the frontend's log once SET_LOG_BASE shared it (see `GuestMem`).
        | VhostUserVirtioFeatures::LOG_ALL.bits()
        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    if disk.read_only() {
        f |= 1 << VIRTIO_BLK_F_RO;
    } else {
        f |= 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        if disk.discard() {
            f |= 1 << VIRTIO_BLK_F_DISCARD;
        }
    }
    f
}

/// The vhost-user protocol features offered.
pub(crate) fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        // Memory shared region by region (ADD_MEM_REG/REM_MEM_REG), which libblkio requires
        // and vhost-user-backend implements.
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        // The dirty log comes as a shared memory fd (SET_LOG_BASE), as QEMU requires with
        // LOG_ALL.
        | VhostUserProtocolFeatures::LOG_SHMFD
        // Requests taken from the rings are recorded in a region the frontend keeps, so that
        // a restarted daemon resubmits them (`inflight`).
        | VhostUserProtocolFeatures::INFLIGHT_SHMFD
        // A channel to the frontend (SET_BACKEND_REQ_FD), on which a resize is announced
        // (CONFIG_CHANGE_MSG): QEMU then reads the capacity again and tells the guest.
        | VhostUserProtocolFeatures::BACKEND_REQ
}

/// The config space of one connection: fixed at its start but for the write cache mode.
pub(crate) struct ConfigSpace {
    num_queues: u16,
    /// `seg_max`: data descriptors per request.
    seg_max: u32,
    /// Guest write cache enabled (CONFIG_WCE); when off, every write is durable before it
    /// completes (FUA).
    writeback: AtomicBool,
}

impl ConfigSpace {
    pub(crate) fn new(num_queues: u16, queue_size: u16) -> ConfigSpace {
        ConfigSpace {
            num_queues,
            seg_max: u32::from(queue_size.saturating_sub(2)).max(1),
            writeback: AtomicBool::new(true),
        }
    }

    /// Most descriptors a request's chain may have: header, `seg_max` data, status.
    pub(crate) fn max_descriptors(&self) -> usize {
        self.seg_max as usize + 2
    }

    /// Writes must be durable before they complete (the guest turned its cache off).
    pub(crate) fn write_through(&self) -> bool {
        !self.writeback.load(Ordering::Relaxed)
    }

    /// GET_CONFIG: `size` bytes at `offset`; nothing for a read past `CONFIG_MAX`.
    pub(crate) fn read(&self, disk: &VirtioBlkDevice, offset: u32, size: u32) -> Vec<u8> {
        let (offset, size) = (offset as usize, size as usize);
        let Some(end) = offset.checked_add(size).filter(|&e| e <= CONFIG_MAX) else {
            return Vec::new();
        };
        let mut out = vec![0u8; size];
        let config = self.bytes(disk);
        for (i, byte) in (offset..end).zip(out.iter_mut()) {
            if let Some(b) = config.get(i) {
                *byte = *b;
            }
        }
        out
    }

    /// SET_CONFIG: only the writeback byte is guest-writable; switching to write-through
    /// makes earlier writes durable now.
    pub(crate) fn write(&self, disk: &VirtioBlkDevice, offset: u32, buf: &[u8]) -> io::Result<()> {
        let Some(rel) = CONFIG_WCE_OFFSET.checked_sub(offset as usize) else {
            return Ok(());
        };
        if let Some(&wce) = buf.get(rel) {
            self.writeback.store(wce != 0, Ordering::Relaxed);
            if wce == 0 {
                disk.device()
                    .flush()
                    .map_err(|e| io::Error::other(e.to_string()))?;
            }
        }
        Ok(())
    }

    /// The config space as the guest sees it.
    fn bytes(&self, disk: &VirtioBlkDevice) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        let capacity = disk.capacity() / SECTOR_SIZE;
        c[0..8].copy_from_slice(&capacity.to_le_bytes());
        c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        c[12..16].copy_from_slice(&self.seg_max.to_le_bytes());
        let blk_size = disk.device().logical_block_size();
        c[20..24].copy_from_slice(&blk_size.to_le_bytes());
        // Topology, in units of logical blocks (Linux multiplies each field by blk_size):
        // physical_block_exp = log2(physical / logical) = 0, as a BlockDevice's physical
        // block is its logical block (a LUKS volume's encryption sector, or 512 for raw);
        // alignment_offset 0; min_io_size 1 block, so guests never issue sub-block I/O;
        // opt_io_size 0 (no preference: every request size costs the same per byte).
        c[24] = 0; // physical_block_exp
        c[25] = 0; // alignment_offset
        c[26..28].copy_from_slice(&1u16.to_le_bytes()); // min_io_size
        c[28..32].copy_from_slice(&0u32.to_le_bytes()); // opt_io_size
        c[CONFIG_WCE_OFFSET] = u8::from(self.writeback.load(Ordering::Relaxed));
        c[34..36].copy_from_slice(&self.num_queues.to_le_bytes());
        if disk.discard() {
            c[36..40].copy_from_slice(&MAX_DISCARD_SECTORS.to_le_bytes());
            c[40..44].copy_from_slice(&1u32.to_le_bytes()); // max_discard_seg
            let align = (blk_size / SECTOR_SIZE as u32).max(1); // discard_sector_alignment
            c[44..48].copy_from_slice(&align.to_le_bytes());
        }
        c[48..52].copy_from_slice(&MAX_WRITE_ZEROES_SECTORS.to_le_bytes());
        c[52..56].copy_from_slice(&1u32.to_le_bytes()); // max_write_zeroes_seg
        c[56] = 0; // write_zeroes_may_unmap: zeroes are always written
        c
    }
}
