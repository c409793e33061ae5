//! Stable-Rust stand-in for a fuzz target over guest-controlled descriptors: random descriptor
//! tables (bad links, loops, bad lengths and directions, addresses outside memory, indirect
//! flags, random headers) go through virtio-queue, the parser and the executor. Nothing may
//! panic, and guest memory outside the chain's device-writable descriptors (and the used ring)
//! must be unchanged.

use std::sync::{Arc, Mutex};

use cryptblk_block::{BlockDevice, BlockError};
use cryptblk_vhost_user_blk::request;
use cryptblk_vhost_user_blk::VirtioBlkDevice;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const MEM: usize = 1 << 20;
const QSIZE: u16 = 16;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const USED_END: u64 = 0x3000;
const DATA: u64 = 0x1_0000;
const DISK: usize = 256 * 1024;

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
        let o = offset as usize;
        buf.copy_from_slice(&d[o..o + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        let mut d = self.0.lock().unwrap();
        let o = offset as usize;
        d[o..o + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> Result<(), BlockError> {
        Ok(())
    }
}

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
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn random_len(rng: &mut Rng) -> u32 {
    match rng.below(8) {
        0 => 1,
        1 => 16,
        2 => 0,
        3 => 512,
        4 => 4096,
        5 => rng.below(70_000) as u32,
        6 => u32::MAX - rng.below(4) as u32,
        _ => rng.below(9000) as u32,
    }
}

fn random_addr(rng: &mut Rng) -> u64 {
    match rng.below(10) {
        0 => rng.next(),
        1 => MEM as u64 - rng.below(64),
        2 => rng.below(USED_END),
        _ => DATA + rng.below(MEM as u64 - DATA),
    }
}

#[test]
fn random_descriptor_chains_never_write_outside_their_buffers() {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
    let disk = VirtioBlkDevice::new(
        Arc::new(MemDisk(Mutex::new(vec![0u8; DISK]))),
        false,
        "random",
    );
    let mut io_queue = disk.open_queue(16).unwrap();
    let mut rng = Rng(0x5eed_1234_abcd_9876);
    let mut segments = Vec::new();
    let mut fill = vec![0u8; MEM];
    let (mut ok, mut rejected) = (0, 0);
    for iteration in 0..2000 {
        // Random background, then a random descriptor table and headers.
        for b in fill.iter_mut() {
            *b = rng.next() as u8;
        }
        mem.write_slice(&fill, GuestAddress(0)).unwrap();
        for i in 0..u64::from(QSIZE) {
            let flags = (rng.below(4) as u16) | if rng.chance(5) { 4 } else { 0 };
            let mut raw = [0u8; 16];
            raw[0..8].copy_from_slice(&random_addr(&mut rng).to_le_bytes());
            raw[8..12].copy_from_slice(&random_len(&mut rng).to_le_bytes());
            raw[12..14].copy_from_slice(&flags.to_le_bytes());
            let next = if rng.chance(90) {
                (i as u16 + 1) % QSIZE
            } else {
                rng.below(24) as u16
            };
            raw[14..16].copy_from_slice(&next.to_le_bytes());
            mem.write_slice(&raw, GuestAddress(DESC + i * 16)).unwrap();
        }
        // Make many headers plausible: put typed headers where descriptors point.
        for i in 0..u64::from(QSIZE) {
            let addr: u64 = mem.read_obj(GuestAddress(DESC + i * 16)).unwrap();
            if addr >= DATA && addr + 16 <= MEM as u64 {
                let kind: u32 = [0, 1, 4, 8, 13, 11, rng.next() as u32][rng.below(7) as usize];
                let sector = if rng.chance(80) {
                    rng.below(DISK as u64 / 512)
                } else {
                    rng.next()
                };
                mem.write_obj(kind, GuestAddress(addr)).unwrap();
                mem.write_obj(sector, GuestAddress(addr + 8)).unwrap();
            }
        }
        // Often, a well-formed request with at most one field damaged, at head 0.
        let structured = rng.chance(60);
        if structured {
            let kind: u32 = [0, 1, 4, 8, 13][rng.below(5) as usize];
            let n_data = if kind == 4 { 0 } else { 1 + rng.below(4) };
            let device_writes = kind == 0 || kind == 8;
            let mut next_buf = DATA;
            let mut descs = Vec::new();
            descs.push((next_buf, 16u32, 0u16));
            let sector = rng.below(DISK as u64 / 512 - 64);
            mem.write_obj(kind, GuestAddress(next_buf)).unwrap();
            mem.write_obj(sector, GuestAddress(next_buf + 8)).unwrap();
            next_buf += 0x100;
            for _ in 0..n_data {
                let len = match kind {
                    13 => 16,
                    8 => 20,
                    _ => 512 * (1 + rng.below(8) as u32),
                };
                if kind == 13 {
                    mem.write_obj(sector, GuestAddress(next_buf)).unwrap();
                    mem.write_obj(rng.below(64) as u32, GuestAddress(next_buf + 8))
                        .unwrap();
                    mem.write_obj(0u32, GuestAddress(next_buf + 12)).unwrap();
                }
                descs.push((next_buf, len, if device_writes { 2 } else { 0 }));
                next_buf += u64::from(len) + 0x100;
            }
            descs.push((next_buf, 1, 2));
            if rng.chance(40) {
                let i = rng.below(descs.len() as u64) as usize;
                match rng.below(3) {
                    0 => descs[i].0 = random_addr(&mut rng),
                    1 => descs[i].1 = random_len(&mut rng),
                    _ => descs[i].2 ^= 2,
                }
            }
            let last = descs.len() - 1;
            for (i, &(addr, len, flags)) in descs.iter().enumerate() {
                let mut raw = [0u8; 16];
                raw[0..8].copy_from_slice(&addr.to_le_bytes());
                raw[8..12].copy_from_slice(&len.to_le_bytes());
                let (flags, next) = if i < last {
                    (flags | 1, i as u16 + 1)
                } else {
                    (flags, 0)
                };
                raw[12..14].copy_from_slice(&flags.to_le_bytes());
                raw[14..16].copy_from_slice(&next.to_le_bytes());
                mem.write_slice(&raw, GuestAddress(DESC + i as u64 * 16))
                    .unwrap();
            }
        }
        // One available chain.
        let head = if structured {
            0
        } else {
            rng.below(u64::from(QSIZE)) as u16
        };
        mem.write_obj(0u16, GuestAddress(AVAIL)).unwrap();
        mem.write_obj(1u16, GuestAddress(AVAIL + 2)).unwrap();
        mem.write_obj(head, GuestAddress(AVAIL + 4)).unwrap();

        let mut before = vec![0u8; MEM];
        mem.read_slice(&mut before, GuestAddress(0)).unwrap();

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
            continue;
        };
        // The device-writable buffers of this chain, as the queue walks it.
        let writable: Vec<(u64, u64)> = chain
            .clone()
            .filter(|d| d.is_write_only())
            .map(|d| (d.addr().0, d.addr().0.saturating_add(u64::from(d.len()))))
            .collect();
        let head = chain.head_index();
        let used_len = match request::parse(
            &mem,
            chain,
            18,
            cryptblk_vhost_user_blk::config::SIZE_MAX,
            disk.capacity(),
            &mut segments,
        ) {
            Ok(req) => {
                ok += 1;
                disk.execute_one(&mut *io_queue, &Arc::new(mem.clone()), &req, &segments)
            }
            Err(r) => {
                rejected += 1;
                disk.reject(&mem, &r)
            }
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
                writable.iter().any(|&(s, e)| s <= at && at < e),
                "iteration {iteration}: byte {at:#x} changed outside the chain's writable buffers"
            );
        }
    }
    // The generator must reach the executor often enough to mean something.
    assert!(ok > 400, "only {ok} valid requests ({rejected} rejected)");
    eprintln!("{ok} executed, {rejected} rejected");
}
