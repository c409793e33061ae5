//! Walking a descriptor chain from its head index, for requests resubmitted after a restart.
//!
//! A request the daemon had taken from the ring before it died is known only by its head
//! index (`inflight`); it is not in the available ring any more, so virtio-queue cannot pop it,
//! and its `DescriptorChain::new` is crate-private. `Chain` walks the descriptor table exactly
//! as virtio-queue's `DescriptorChain` iterator does for a popped chain, with the same limits
//! on untrusted descriptors (a test compares the two on random tables): the walk ends at an
//! index outside the table, after as many descriptors as the table holds (loops), at a second
//! level of indirection, at an indirect table whose length is not a multiple of 16 or holds
//! more than 65535 entries, at a descriptor outside guest memory, and once the chain would
//! exceed 2^32 bytes. What it yields then goes through `request::parse` like any other chain,
//! which rejects whatever is left malformed.

use std::mem::size_of;

use virtio_bindings::virtio_ring::VRING_DESC_ALIGN_SIZE;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

/// The descriptors of the chain starting at `head`, read from guest memory as the walk goes.
pub struct Chain<'a, M> {
    mem: &'a M,
    /// The table being walked: the ring's descriptor table, then possibly an indirect one.
    table: GuestAddress,
    table_len: u16,
    next: u16,
    /// Descriptors left before the walk gives up (loop protection).
    ttl: u16,
    bytes: u32,
    indirect: bool,
}

impl<'a, M: GuestMemory> Chain<'a, M> {
    /// The chain whose head is descriptor `head` of the ring's `queue_size`-entry descriptor
    /// table at `desc_table`.
    pub fn new(mem: &'a M, desc_table: GuestAddress, queue_size: u16, head: u16) -> Self {
        Chain {
            mem,
            table: desc_table,
            table_len: queue_size,
            next: head,
            ttl: queue_size,
            bytes: 0,
            indirect: false,
        }
    }

    /// Continues in the indirect table `desc` points at; false when that is not allowed.
    fn enter_indirect(&mut self, desc: &Descriptor) -> bool {
        // One level only (virtio 1.2, 2.7.5.3.1), and a whole number of descriptors.
        if self.indirect || !desc.len().is_multiple_of(VRING_DESC_ALIGN_SIZE) {
            return false;
        }
        let Ok(len) = u16::try_from(desc.len() / VRING_DESC_ALIGN_SIZE) else {
            return false;
        };
        self.table = desc.addr();
        self.table_len = len;
        self.next = 0;
        self.ttl = len;
        self.indirect = true;
        true
    }
}

impl<M: GuestMemory> Iterator for Chain<'_, M> {
    type Item = Descriptor;

    fn next(&mut self) -> Option<Descriptor> {
        loop {
            if self.ttl == 0 || self.next >= self.table_len {
                return None;
            }
            let at = self
                .table
                .checked_add(u64::from(self.next) * size_of::<Descriptor>() as u64)?;
            let desc: Descriptor = self.mem.read_obj(at).ok()?;
            if desc.refers_to_indirect_table() {
                if !self.enter_indirect(&desc) {
                    return None;
                }
                continue;
            }
            // A chain longer than 2^32 bytes is invalid (virtio 1.2, 2.7.5.2).
            self.bytes = self.bytes.checked_add(desc.len())?;
            if desc.has_next() {
                self.next = desc.next();
                self.ttl -= 1;
            } else {
                self.ttl = 0;
            }
            return Some(desc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{
        VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    };
    use virtio_queue::{Queue, QueueT};
    use vm_memory::GuestMemoryMmap;

    const MEM: u64 = 0x4_0000;
    const QSIZE: u16 = 16;
    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    /// Indirect tables are put here (one per descriptor slot that may point at one).
    const INDIRECT: u64 = 0x1_0000;

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    fn write_desc(mem: &GuestMemoryMmap, at: u64, addr: u64, len: u32, flags: u16, next: u16) {
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..16].copy_from_slice(&next.to_le_bytes());
        mem.write_slice(&raw, GuestAddress(at)).unwrap();
    }

    /// A random descriptor: mostly chained to a neighbour, sometimes looping, out of range,
    /// huge, indirect (to a table of random length that may itself hold indirect entries).
    fn random_desc(rng: &mut Rng, index: u64, table_len: u64, indirect_table: u64) -> [u64; 4] {
        const NEXT: u64 = VRING_DESC_F_NEXT as u64;
        const WRITE: u64 = VRING_DESC_F_WRITE as u64;
        const IND: u64 = VRING_DESC_F_INDIRECT as u64;
        let mut flags =
            [0, NEXT, NEXT, NEXT, NEXT | WRITE, NEXT | WRITE, WRITE][rng.below(7) as usize];
        let mut addr = 0x8000 + rng.below(0x4000);
        let mut len = [1, 16, 512, 4096, u32::MAX as u64, rng.below(70_000)][rng.below(6) as usize];
        if rng.below(8) == 0 {
            flags |= IND;
            addr = indirect_table;
            len =
                [16 * rng.below(20), 16 * rng.below(20) + rng.below(16), 0][rng.below(3) as usize];
        }
        let next = match rng.below(10) {
            0 => rng.below(u64::from(u16::MAX) + 1),
            1 => rng.below(table_len + 4),
            _ => (index + 1) % table_len.max(1),
        };
        [addr, len, flags, next]
    }

    #[test]
    fn walks_like_virtio_queue_on_random_tables() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
        let mut rng = Rng(0x0123_4567_89ab_cdef);
        let (mut total, mut via_indirect, mut long) = (0usize, 0usize, 0usize);
        for _ in 0..5000 {
            for i in 0..u64::from(QSIZE) {
                let table = INDIRECT + i * 0x200;
                let [a, l, f, n] = random_desc(&mut rng, i, u64::from(QSIZE), table);
                write_desc(&mem, DESC + i * 16, a, l as u32, f as u16, n as u16);
                for j in 0..20 {
                    let [a, l, f, n] = random_desc(&mut rng, j, 20, table);
                    write_desc(&mem, table + j * 16, a, l as u32, f as u16, n as u16);
                }
            }
            let head = rng.below(u64::from(QSIZE) + 2) as u16;
            mem.write_obj(1u16, GuestAddress(AVAIL + 2)).unwrap();
            mem.write_obj(head, GuestAddress(AVAIL + 4)).unwrap();

            let mut queue = Queue::new(QSIZE).unwrap();
            queue
                .try_set_desc_table_address(GuestAddress(DESC))
                .unwrap();
            queue
                .try_set_avail_ring_address(GuestAddress(AVAIL))
                .unwrap();
            queue.try_set_used_ring_address(GuestAddress(USED)).unwrap();
            queue.set_ready(true);
            let popped = queue
                .pop_descriptor_chain(&mem)
                .expect("one available chain");
            let expected: Vec<[u64; 4]> = popped.map(fields).collect();
            let walked: Vec<[u64; 4]> = Chain::new(&mem, GuestAddress(DESC), QSIZE, head)
                .map(fields)
                .collect();
            assert_eq!(walked, expected, "head {head}");
            total += walked.len();
            long += usize::from(walked.len() > 3);
            let first: Descriptor = mem
                .read_obj(GuestAddress(DESC + u64::from(head) * 16))
                .unwrap_or_default();
            via_indirect += usize::from(first.refers_to_indirect_table() && !walked.is_empty());
        }
        // The generator must exercise long chains and indirect tables.
        assert!(
            long > 300 && via_indirect > 100,
            "long {long}, via indirect {via_indirect}, {total} descriptors"
        );
    }

    fn fields(d: Descriptor) -> [u64; 4] {
        [
            d.addr().0,
            u64::from(d.len()),
            u64::from(d.flags()),
            u64::from(d.next()),
        ]
    }

    #[test]
    fn stops_on_loops_and_bad_indirect_tables() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
        let next = VRING_DESC_F_NEXT as u16;
        // 0 -> 1 -> 0 -> ...: at most the table's size in descriptors.
        write_desc(&mem, DESC, 0x8000, 16, next, 1);
        write_desc(&mem, DESC + 16, 0x8100, 16, next, 0);
        assert_eq!(Chain::new(&mem, GuestAddress(DESC), 4, 0).count(), 4);
        // A head outside the table yields nothing.
        assert_eq!(Chain::new(&mem, GuestAddress(DESC), 4, 4).count(), 0);
        // An indirect table of 17 bytes is refused; of 32 bytes it is walked.
        let ind = VRING_DESC_F_INDIRECT as u16;
        write_desc(&mem, DESC, INDIRECT, 17, ind, 0);
        assert_eq!(Chain::new(&mem, GuestAddress(DESC), 4, 0).count(), 0);
        write_desc(&mem, DESC, INDIRECT, 32, ind, 0);
        write_desc(&mem, INDIRECT, 0x8000, 16, next, 1);
        write_desc(&mem, INDIRECT + 16, 0x8100, 1, VRING_DESC_F_WRITE as u16, 0);
        assert_eq!(Chain::new(&mem, GuestAddress(DESC), 4, 0).count(), 2);
        // An indirect entry inside an indirect table ends the walk there.
        write_desc(&mem, INDIRECT + 16, INDIRECT, 32, ind, 0);
        assert_eq!(Chain::new(&mem, GuestAddress(DESC), 4, 0).count(), 1);
        // A table outside guest memory yields nothing.
        assert_eq!(Chain::new(&mem, GuestAddress(MEM - 8), 4, 0).count(), 0);
    }
}
