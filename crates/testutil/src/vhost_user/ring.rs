//! The driver's side of one split virtqueue in guest memory. Descriptors are written through
//! virtio-queue's mock `DescriptorTable` as its `Descriptor`s, completions read as its
//! `VirtqUsedElem`s, ring offsets come from virtio-bindings' `vring_avail` / `vring_used`.
//!
//! virtio-queue's `MockSplitQueue` itself is not used: it borrows the guest memory (a
//! `Guest` owns its memory, so it could not keep one), creating one zeroes the rings (so one
//! cannot be made again per call), and in 0.18 it puts the used ring `queue size` bytes after
//! the avail ring's entries start instead of `2 * size + 2`, so with more than 126 entries the
//! two rings overlap.

use std::mem::{offset_of, size_of};
use std::sync::atomic::{fence, Ordering};

use virtio_bindings::virtio_ring::{
    vring_avail, vring_used, vring_used_elem, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT,
    VRING_DESC_F_WRITE,
};
use virtio_queue::desc::split::{Descriptor, VirtqUsedElem};
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::DescriptorTable;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};

/// A descriptor to put in a chain.
#[derive(Clone, Copy, Debug)]
pub struct Desc {
    pub addr: GuestAddress,
    pub len: u32,
    /// Device-writable.
    pub write: bool,
}

/// Where one queue's rings live and how far the driver got on them.
pub(super) struct DriverRing {
    pub size: u16,
    pub desc: GuestAddress,
    pub avail: GuestAddress,
    pub used: GuestAddress,
    /// Next free avail index (free-running).
    avail_idx: u16,
    /// Used entries consumed so far (free-running).
    used_seen: u16,
    /// Next free descriptor slot (wraps around the table).
    next_desc: u16,
    /// Descriptors of chains published and not yet seen in the used ring, and each chain's
    /// length by head, so that a test cannot overwrite descriptors still in flight.
    descs_in_flight: usize,
    chain_len: Vec<u16>,
}

impl DriverRing {
    /// Rings of `size` entries: the descriptor table at `base`, the avail ring 16 KiB and the
    /// used ring 32 KiB above it (each on pages of its own, so tests can tell which one the
    /// device wrote).
    pub fn new(base: GuestAddress, size: u16) -> DriverRing {
        DriverRing {
            size,
            desc: base,
            avail: base.unchecked_add(0x4000),
            used: base.unchecked_add(0x8000),
            avail_idx: 0,
            used_seen: 0,
            next_desc: 0,
            descs_in_flight: 0,
            chain_len: vec![0; usize::from(size)],
        }
    }

    /// The used ring's index as the device last published it.
    pub fn used_idx(&self, mem: &GuestMemoryMmap) -> u16 {
        mem.read_obj(self.used.unchecked_add(offset_of!(vring_used, idx) as u64))
            .unwrap()
    }

    /// Used entries published and not taken yet.
    pub fn used_pending(&self, mem: &GuestMemoryMmap) -> usize {
        usize::from(self.used_idx(mem).wrapping_sub(self.used_seen))
    }

    /// Writes a chain into the descriptor table and publishes it (no kick); returns its head.
    /// For each `(i, to)` in `links`, descriptor `i` of the chain points `next` at chain
    /// position `to` (loops, bad links).
    pub fn publish(
        &mut self,
        mem: &GuestMemoryMmap,
        descs: &[Desc],
        links: &[(usize, usize)],
    ) -> u16 {
        let n = descs.len() as u16;
        assert!(
            self.descs_in_flight + usize::from(n) <= usize::from(self.size),
            "test bug: more descriptors in flight than the queue has"
        );
        self.descs_in_flight += usize::from(n);
        let ids: Vec<u16> = (0..n).map(|i| (self.next_desc + i) % self.size).collect();
        self.next_desc = (self.next_desc + n) % self.size;
        let table = DescriptorTable::new(mem, self.desc, self.size);
        for (i, d) in descs.iter().enumerate() {
            let mut flags = if d.write {
                VRING_DESC_F_WRITE as u16
            } else {
                0
            };
            let link = match links.iter().find(|l| l.0 == i) {
                Some(&(_, to)) => Some(to),
                None => (i + 1 < descs.len()).then_some(i + 1),
            };
            if link.is_some() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let next = link.map_or(0, |to| ids[to]);
            let raw = RawDescriptor::from(Descriptor::new(d.addr.0, d.len, flags, next));
            table.store(ids[i], raw).unwrap();
        }
        self.make_available(mem, ids[0], n)
    }

    /// Writes `descs` as an indirect table at `table` (room for them, 16-byte aligned) and
    /// publishes one ring descriptor pointing at it (no kick); returns its head.
    pub fn publish_indirect(
        &mut self,
        mem: &GuestMemoryMmap,
        table: GuestAddress,
        descs: &[Desc],
    ) -> u16 {
        let indirect = DescriptorTable::new(mem, table, descs.len() as u16);
        for (i, d) in descs.iter().enumerate() {
            let mut flags = if d.write {
                VRING_DESC_F_WRITE as u16
            } else {
                0
            };
            if i + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let raw = RawDescriptor::from(Descriptor::new(d.addr.0, d.len, flags, i as u16 + 1));
            indirect.store(i as u16, raw).unwrap();
        }
        assert!(
            self.descs_in_flight < usize::from(self.size),
            "test bug: more descriptors in flight than the queue has"
        );
        self.descs_in_flight += 1;
        let head = self.next_desc;
        self.next_desc = (self.next_desc + 1) % self.size;
        let len = (descs.len() * size_of::<RawDescriptor>()) as u32;
        let raw = RawDescriptor::from(Descriptor::new(
            table.0,
            len,
            VRING_DESC_F_INDIRECT as u16,
            0,
        ));
        DescriptorTable::new(mem, self.desc, self.size)
            .store(head, raw)
            .unwrap();
        self.make_available(mem, head, 1)
    }

    /// Puts the chain at `head` (`n` ring descriptors) on the avail ring.
    fn make_available(&mut self, mem: &GuestMemoryMmap, head: u16, n: u16) -> u16 {
        self.chain_len[usize::from(head)] = n;
        let slot = u64::from(self.avail_idx % self.size);
        mem.write_obj(head, self.avail_entry(slot)).unwrap();
        self.ask_for_notification(mem);
        fence(Ordering::SeqCst);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        mem.write_obj(
            self.avail_idx,
            self.avail
                .unchecked_add(offset_of!(vring_avail, idx) as u64),
        )
        .unwrap();
        fence(Ordering::SeqCst);
        head
    }

    /// Takes up to `max` used entries not taken yet: (head, length) pairs.
    pub fn take_used(&mut self, mem: &GuestMemoryMmap, max: usize) -> Vec<(u16, u32)> {
        let used_idx = self.used_idx(mem);
        fence(Ordering::SeqCst);
        let mut out = Vec::new();
        while self.used_seen != used_idx && out.len() < max {
            let slot = u64::from(self.used_seen % self.size);
            let at = self.used.unchecked_add(
                offset_of!(vring_used, ring) as u64 + slot * size_of::<vring_used_elem>() as u64,
            );
            let elem: VirtqUsedElem = mem.read_obj(at).unwrap();
            out.push((elem.id() as u16, elem.len()));
            let n = self.chain_len.get(elem.id() as usize).copied().unwrap_or(0);
            self.descs_in_flight -= usize::from(n);
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        // Keep used_event current so the device signals the next completion.
        self.ask_for_notification(mem);
        fence(Ordering::SeqCst);
        out
    }

    /// EVENT_IDX's used_event (after the avail ring's entries): notify on the next used entry.
    fn ask_for_notification(&self, mem: &GuestMemoryMmap) {
        mem.write_obj(self.used_seen, self.avail_entry(u64::from(self.size)))
            .unwrap();
    }

    fn avail_entry(&self, slot: u64) -> GuestAddress {
        self.avail
            .unchecked_add(offset_of!(vring_avail, ring) as u64 + slot * size_of::<u16>() as u64)
    }
}
