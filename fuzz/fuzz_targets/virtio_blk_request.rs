//! Guest-controlled virtqueue contents as a virtio-blk request: the input is a descriptor table,
//! the head index and the guest memory the descriptors point into. The chain goes through
//! virtio-queue, `request::parse`, then `VirtioBlkDevice::execute_one` on the disk's asynchronous queue
//! (or `VirtioBlkDevice::reject`), as in the daemon's queue thread. Nothing may panic, and no guest byte outside the chain's device-writable
//! descriptors (and the used ring) may change. `chain::Chain`, which walks the chains of
//! requests resubmitted after a daemon restart, must yield exactly the descriptors
//! virtio-queue yields for the same head. Then the same ring goes through the daemon's own
//! queue worker (`RingDriver`) on a copy of guest memory as it was before: guest memory must
//! end up byte for byte as the steps above left it, unless those rejected a segment over this
//! target's small size_max (the worker has the daemon's 1 MiB).
//!
//! Input layout (missing bytes read as zero):
//! - bytes 0..256: the 16-entry descriptor table (addr u64, len u32, flags u16, next u16, LE);
//! - bytes 256..258: the head index (u16 LE, taken modulo the queue size);
//! - byte 258: bit 0 = read-only disk, bit 1 = discard enabled;
//! - the rest: guest memory from `DATA` on (headers, data, range descriptors, indirect tables).
#![no_main]

use std::sync::{Arc, Mutex};

use cryptblk_block::{BlockDevice, BlockError};
use cryptblk_vhost_user_blk::chain::Chain;
use cryptblk_vhost_user_blk::{request, GuestMem, RingDriver, VirtioBlkDevice};
use libfuzzer_sys::fuzz_target;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest memory: two adjacent 8 KiB regions, so a buffer can straddle a region boundary.
const REGION: usize = 0x2000;
const MEM: usize = 2 * REGION;
const QSIZE: u16 = 16;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x200;
const USED: u64 = 0x300;
const USED_END: u64 = 0x400;
const DATA: u64 = 0x400;
/// A small size_max so that segments over it fit in the fuzzer's memory.
const SIZE_MAX: u32 = 4096;
const DISK: usize = 64 * 1024;
/// SEG_MAX + 2, as the daemon computes it for this queue size.
const MAX_DESCRIPTORS: usize = QSIZE as usize;

struct MemDisk(Mutex<Vec<u8>>);

impl BlockDevice for MemDisk {
    fn size(&self) -> u64 {
        DISK as u64
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        let d = self.0.lock().unwrap();
        let o = usize::try_from(offset).unwrap();
        buf.copy_from_slice(&d[o..o + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        let mut d = self.0.lock().unwrap();
        let o = usize::try_from(offset).unwrap();
        d[o..o + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> Result<(), BlockError> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[
        (GuestAddress(0), REGION),
        (GuestAddress(REGION as u64), REGION),
    ])
    .unwrap();
    let table_len = usize::from(QSIZE) * 16;
    let table = &data[..data.len().min(table_len)];
    mem.write_slice(table, GuestAddress(DESC)).unwrap();
    let byte = |i: usize| data.get(i).copied().unwrap_or(0);
    let head = u16::from_le_bytes([byte(table_len), byte(table_len + 1)]) % QSIZE;
    let flags = byte(table_len + 2);
    if let Some(rest) = data.get(table_len + 3..) {
        let n = rest.len().min(MEM - DATA as usize);
        mem.write_slice(&rest[..n], GuestAddress(DATA)).unwrap();
    }
    // One available chain.
    mem.write_obj(0u16, GuestAddress(AVAIL)).unwrap();
    mem.write_obj(1u16, GuestAddress(AVAIL + 2)).unwrap();
    mem.write_obj(head, GuestAddress(AVAIL + 4)).unwrap();

    let disk = VirtioBlkDevice::new(
        Arc::new(MemDisk(Mutex::new(vec![0u8; DISK]))),
        flags & 1 != 0,
        "fuzz",
    )
    .with_discard(flags & 2 != 0);
    let mut io_queue = disk.open_queue(usize::from(QSIZE)).unwrap();
    let mut queue = Queue::new(QSIZE).unwrap();
    queue.set_size(QSIZE);
    queue
        .try_set_desc_table_address(GuestAddress(DESC))
        .unwrap();
    queue
        .try_set_avail_ring_address(GuestAddress(AVAIL))
        .unwrap();
    queue.try_set_used_ring_address(GuestAddress(USED)).unwrap();
    queue.set_ready(true);
    let Some(chain) = queue.pop_descriptor_chain(&mem) else {
        return;
    };
    let writable: Vec<(u64, u64)> = chain
        .clone()
        .filter(|d| d.is_write_only())
        .map(|d| (d.addr().0, d.addr().0.saturating_add(u64::from(d.len()))))
        .collect();
    let head = chain.head_index();
    let fields =
        |d: virtio_queue::desc::split::Descriptor| (d.addr().0, d.len(), d.flags(), d.next());
    let walked: Vec<_> = Chain::new(&mem, GuestAddress(DESC), QSIZE, head)
        .map(fields)
        .collect();
    let popped: Vec<_> = chain.clone().map(fields).collect();
    assert_eq!(
        walked, popped,
        "chain::Chain and virtio-queue differ for head {head}"
    );

    let mut before = vec![0u8; MEM];
    mem.read_slice(&mut before, GuestAddress(0)).unwrap();
    let mut segments = Vec::new();
    let parsed = request::parse(
        &mem,
        chain,
        MAX_DESCRIPTORS,
        SIZE_MAX,
        disk.capacity(),
        &mut segments,
    );
    let size_max_differs = matches!(
        &parsed,
        Err(r) if matches!(r.error, request::Error::SegmentTooLarge(..))
    );
    let used_len = match parsed {
        Ok(req) => {
            assert!(segments.iter().all(|s| s.len <= SIZE_MAX));
            assert!(segments.len() + 2 <= MAX_DESCRIPTORS);
            disk.execute_one(&mut *io_queue, &Arc::new(mem.clone()), &req, &segments)
        }
        Err(rejected) => disk.reject(&mem, &rejected),
    };
    queue.add_used(&mem, head, used_len).unwrap();

    let mut after = vec![0u8; MEM];
    mem.read_slice(&mut after, GuestAddress(0)).unwrap();
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        let at = i as u64;
        if a == b || (USED..USED_END).contains(&at) {
            continue;
        }
        assert!(
            writable.iter().any(|&(s, e)| (s..e).contains(&at)),
            "byte {at:#x} changed outside the chain's writable buffers"
        );
    }

    // The same ring through the daemon's queue worker, on guest memory as it was before.
    let worker_mem = GuestMem::from_ranges(&[
        (GuestAddress(0), REGION),
        (GuestAddress(REGION as u64), REGION),
    ])
    .unwrap();
    worker_mem.write_slice(&before, GuestAddress(0)).unwrap();
    let worker_disk = VirtioBlkDevice::new(
        Arc::new(MemDisk(Mutex::new(vec![0u8; DISK]))),
        flags & 1 != 0,
        "fuzz",
    )
    .with_discard(flags & 2 != 0);
    let mut ring = RingDriver::new(worker_disk, worker_mem, QSIZE, DESC, AVAIL, USED).unwrap();
    ring.kick().unwrap();
    ring.settle();
    if !size_max_differs {
        let mut served = vec![0u8; MEM];
        ring.memory()
            .read_slice(&mut served, GuestAddress(0))
            .unwrap();
        assert!(served == after, "the queue worker answered differently");
    }
});
