//! Descriptor tables a hostile guest builds to make one request large: many data descriptors
//! that alias the same guest buffer, each up to the daemon's `size_max` (1 MiB), directly in
//! the ring or in an indirect table, so the sum can pass `request::MAX_REQUEST_BYTES` (4 MiB)
//! while the guest owns only ~1 MiB. Shared by the `virtio_blk_aliased` fuzz target and the
//! stable replay in crates/vhost-user-blk/tests/fuzz_aliased_replay.rs.
//!
//! Checks, as a user relies on them: nothing panics; a request whose data descriptors add up
//! to more than `MAX_REQUEST_BYTES` is never executed (the device sees no I/O) and, when every
//! descriptor is otherwise valid, is answered IOERR; what an accepted request makes the daemon
//! hold (`Request::data_len`, the planned I/O length) never exceeds `MAX_REQUEST_BYTES`.
//! Then the same chain goes through the daemon's own queue worker (`RingDriver`) on a copy of
//! guest memory as it was before: no oversized request reaches the device there either, and
//! guest memory ends up byte for byte as the steps above left it (status, data, used ring).
//!
//! Input (missing bytes read as zero; the last descriptor pattern repeats):
//! - byte 0: request type (IN, OUT, FLUSH, GET_ID, DISCARD, WRITE_ZEROES, unsupported);
//! - byte 1: bit 0 indirect table, bit 1 read-only disk, bit 2 one descriptor with the wrong
//!   direction, bit 3 discard on;
//! - byte 2: number of data descriptors (at most `QSIZE - 2`);
//! - bytes 3..5: the sector (u16 LE);
//! - then 2 bytes per data descriptor: buffer (low 2 bits: the big buffer, the big buffer +
//!   512, the small buffer, the previous descriptor's) and length class (bits 2..5: 512, 4 KiB,
//!   16 KiB, 64 KiB, size_max, size_max + 512, 0, the second byte * 512).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cryptblk_block::aio::IoBuffers;
use cryptblk_block::{BlockDevice, BlockError};
use cryptblk_vhost_user_blk::config::SIZE_MAX;
use cryptblk_vhost_user_blk::device::{Start, STATUS_IOERR};
use cryptblk_vhost_user_blk::request::{self, advertised_limits, Error, MAX_REQUEST_BYTES};
use cryptblk_vhost_user_blk::{GuestMem, GuestRam, RingDriver, VirtioBlkDevice};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const QSIZE: u16 = 256;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const HEADER: u64 = 0x3000;
const STATUS: u64 = 0x3010;
const INDIRECT: u64 = 0x4000;
const SMALL: u64 = 0x6000;
/// Region A (rings, header, indirect table, a small buffer) ends here; region B is the big
/// buffer, a little over size_max so two aliasing 1 MiB descriptors fit at offsets 0 and 512.
const REGION_A: u64 = 0x1_0000;
const BIG: u64 = REGION_A;
const REGION_B: u64 = SIZE_MAX as u64 + 0x1000;
const DISK: u64 = 8 << 20;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;

/// An in-memory disk that counts what reaches it.
struct CountingDisk {
    data: Mutex<Vec<u8>>,
    calls: AtomicU64,
}

impl BlockDevice for CountingDisk {
    fn size(&self) -> u64 {
        DISK
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let d = self.data.lock().unwrap();
        let o = usize::try_from(offset).unwrap();
        buf.copy_from_slice(&d[o..o + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut d = self.data.lock().unwrap();
        let o = usize::try_from(offset).unwrap();
        d[o..o + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// One 8 MiB disk for every input (allocating it per input would dominate the run), held
/// locked for the whole input: its call counter is per input, and the stable replay runs
/// inputs on several test threads.
fn device() -> MutexGuard<'static, Arc<CountingDisk>> {
    static DEVICE: OnceLock<Mutex<Arc<CountingDisk>>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            Mutex::new(Arc::new(CountingDisk {
                data: Mutex::new(vec![0u8; DISK as usize]),
                calls: AtomicU64::new(0),
            }))
        })
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

#[derive(Clone, Copy)]
struct Desc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

fn write_table(mem: &GuestMemoryMmap<()>, at: u64, table: &[Desc]) {
    for (i, d) in table.iter().enumerate() {
        let mut raw = [0u8; 16];
        raw[0..8].copy_from_slice(&d.addr.to_le_bytes());
        raw[8..12].copy_from_slice(&d.len.to_le_bytes());
        raw[12..14].copy_from_slice(&d.flags.to_le_bytes());
        raw[14..16].copy_from_slice(&d.next.to_le_bytes());
        mem.write_slice(&raw, GuestAddress(at + 16 * i as u64))
            .unwrap();
    }
}

fn in_one_region(addr: u64, len: u32) -> bool {
    let end = addr + u64::from(len);
    (addr < REGION_A && end <= REGION_A) || (addr >= BIG && end <= BIG + REGION_B)
}

/// What became of one input's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Over `MAX_REQUEST_BYTES` with every descriptor otherwise valid: answered IOERR.
    OversizedRejected,
    /// Rejected for something else.
    Rejected,
    /// Executed, with this many data bytes.
    Executed(u64),
}

/// Runs one input; panics when a checked property does not hold.
pub fn run(data: &[u8]) -> Outcome {
    let byte = |i: usize| data.get(i).copied().unwrap_or(0);
    let kind: u32 = [0, 1, 4, 8, 11, 13, 99][usize::from(byte(0)) % 7];
    let flags = byte(1);
    let indirect = flags & 1 != 0;
    let n = usize::from(byte(2)).min(usize::from(QSIZE) - 2);
    let sector = u64::from(u16::from_le_bytes([byte(3), byte(4)]));
    // Data direction the request type wants (device-writable for IN and GET_ID).
    let writable = matches!(kind, 0 | 8);
    let wrong_one = if flags & 4 != 0 && n > 0 {
        usize::from(byte(5)) % n
    } else {
        usize::MAX
    };

    let mut data_descs = Vec::with_capacity(n);
    let patterns = &data[data.len().min(6)..];
    let mut prev_addr = BIG;
    for i in 0..n {
        let p = if patterns.len() >= 2 {
            let j = (2 * i).min((patterns.len() / 2 - 1) * 2);
            [patterns[j], patterns[j + 1]]
        } else {
            [0x10, 0] // size_max at the big buffer: the aliasing case
        };
        let addr = match p[0] & 3 {
            0 => BIG,
            1 => BIG + 512,
            2 => SMALL,
            _ => prev_addr,
        };
        let len = match (p[0] >> 2) & 7 {
            0 => 512,
            1 => 4096,
            2 => 16 << 10,
            3 => 64 << 10,
            4 => SIZE_MAX,
            5 => SIZE_MAX + 512,
            6 => 0,
            _ => u32::from(p[1]) * 512,
        };
        prev_addr = addr;
        let dir = if (i == wrong_one) != writable {
            F_WRITE
        } else {
            0
        };
        data_descs.push(Desc {
            addr,
            len,
            flags: dir,
            next: 0,
        });
    }

    let mem = GuestMemoryMmap::<()>::from_ranges(&[
        (GuestAddress(0), REGION_A as usize),
        (GuestAddress(BIG), REGION_B as usize),
    ])
    .unwrap();
    let mut header = [0u8; 16];
    header[0..4].copy_from_slice(&kind.to_le_bytes());
    header[8..16].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&header, GuestAddress(HEADER)).unwrap();
    mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();

    // header, data..., status, linked in order.
    let mut chain = Vec::with_capacity(n + 2);
    chain.push(Desc {
        addr: HEADER,
        len: 16,
        flags: 0,
        next: 0,
    });
    chain.extend(data_descs.iter().copied());
    chain.push(Desc {
        addr: STATUS,
        len: 1,
        flags: F_WRITE,
        next: 0,
    });
    let last = chain.len() - 1;
    for (i, d) in chain.iter_mut().enumerate() {
        if i < last {
            d.flags |= F_NEXT;
            d.next = (i + 1) as u16;
        }
    }
    if indirect {
        write_table(&mem, INDIRECT, &chain);
        let head = Desc {
            addr: INDIRECT,
            len: (16 * chain.len()) as u32,
            flags: F_INDIRECT,
            next: 0,
        };
        write_table(&mem, DESC, &[head]);
    } else {
        write_table(&mem, DESC, &chain);
    }
    mem.write_obj(0u16, GuestAddress(AVAIL)).unwrap();
    mem.write_obj(1u16, GuestAddress(AVAIL + 2)).unwrap();
    mem.write_obj(0u16, GuestAddress(AVAIL + 4)).unwrap();
    let before = snapshot(&mem);

    let device = device();
    let dev = Arc::clone(&device);
    dev.calls.store(0, Ordering::Relaxed);
    let disk =
        VirtioBlkDevice::new(dev.clone(), flags & 2 != 0, "fuzz").with_discard(flags & 8 != 0);
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
    let popped = queue
        .pop_descriptor_chain(&mem)
        .expect("the chain is available");
    let head = popped.head_index();

    // What the daemon must conclude, from the chain as built: the running total of data
    // descriptors that each pass the per-descriptor checks (direction, size_max, memory)
    // passes the cap before any descriptor fails one.
    let total: u64 = data_descs.iter().map(|d| u64::from(d.len)).sum();
    let supported = kind != 99;
    let mut running = 0u64;
    let mut oversized_and_valid = false;
    for d in &data_descs {
        let wants = match kind {
            0 | 8 => Some(true),
            4 => None,
            _ => Some(false),
        };
        if wants.is_some_and(|w| w != (d.flags & F_WRITE != 0))
            || d.len > SIZE_MAX
            || !in_one_region(d.addr, d.len)
        {
            break;
        }
        running += u64::from(d.len);
        if running > MAX_REQUEST_BYTES {
            oversized_and_valid = supported;
            break;
        }
    }

    let (seg_max, _) = advertised_limits(QSIZE);
    let mut segments = Vec::new();
    let parsed = request::parse(
        &mem,
        popped,
        seg_max as usize + 2,
        SIZE_MAX,
        disk.capacity(),
        &mut segments,
    );
    let mut outcome = Outcome::Rejected;
    let used_len = match parsed {
        Ok(req) => {
            outcome = Outcome::Executed(req.data_len);
            assert!(
                total <= MAX_REQUEST_BYTES,
                "a request of {total} data bytes was accepted"
            );
            assert!(req.data_len <= MAX_REQUEST_BYTES);
            assert_eq!(
                req.data_len,
                segments.iter().map(|s| u64::from(s.len)).sum::<u64>()
            );
            let mut buffers = IoBuffers::new();
            buffers.set_owner(GuestRam::owner(Arc::new(mem.clone())));
            match disk.start(&mem, &req, &segments, &mut buffers) {
                Start::Done(status, len) => disk.answer(&mem, &req, status, len).1,
                Start::Io(planned) => {
                    assert!(
                        planned.len <= MAX_REQUEST_BYTES,
                        "planned I/O of {} bytes",
                        planned.len
                    );
                    let result = cryptblk_block::aio::run_one(
                        &mut *io_queue,
                        &planned.request(&buffers, false, 0),
                    );
                    disk.finish(&mem, &req, &segments, &result).1
                }
            }
        }
        Err(rejected) => {
            if oversized_and_valid {
                assert_eq!(
                    rejected.error,
                    Error::RequestTooLarge(MAX_REQUEST_BYTES),
                    "an oversized request rejected for another reason"
                );
            }
            let used = disk.reject(&mem, &rejected);
            assert_eq!(
                dev.calls.load(Ordering::Relaxed),
                0,
                "a rejected request ran"
            );
            used
        }
    };
    if oversized_and_valid {
        let status: u8 = mem.read_obj(GuestAddress(STATUS)).unwrap();
        assert_eq!(
            status, STATUS_IOERR,
            "an oversized request was not answered IOERR"
        );
        assert_eq!(used_len, 1);
        outcome = Outcome::OversizedRejected;
    }
    if total > MAX_REQUEST_BYTES {
        assert_eq!(
            dev.calls.load(Ordering::Relaxed),
            0,
            "an oversized request ran"
        );
    }
    queue.add_used(&mem, head, used_len).unwrap();

    // The same chain through the daemon's queue worker, on guest memory as it was before.
    dev.calls.store(0, Ordering::Relaxed);
    let worker_mem = GuestMem::from_ranges(&[
        (GuestAddress(0), REGION_A as usize),
        (GuestAddress(BIG), REGION_B as usize),
    ])
    .unwrap();
    restore(&worker_mem, &before);
    let worker_disk =
        VirtioBlkDevice::new(dev.clone(), flags & 2 != 0, "fuzz").with_discard(flags & 8 != 0);
    let mut ring = RingDriver::new(worker_disk, worker_mem, QSIZE, DESC, AVAIL, USED).unwrap();
    ring.kick().unwrap();
    ring.settle();
    if total > MAX_REQUEST_BYTES {
        assert_eq!(
            dev.calls.load(Ordering::Relaxed),
            0,
            "an oversized request ran on the queue worker"
        );
    }
    assert!(
        snapshot(&*ring.memory()) == snapshot(&mem),
        "the queue worker answered differently (kind {kind}, {n} data descriptors)"
    );
    outcome
}

/// Guest memory's two regions, as bytes.
fn snapshot<M: Bytes<GuestAddress>>(mem: &M) -> [Vec<u8>; 2]
where
    M::E: std::fmt::Debug,
{
    let mut a = vec![0u8; REGION_A as usize];
    let mut b = vec![0u8; REGION_B as usize];
    mem.read_slice(&mut a, GuestAddress(0)).unwrap();
    mem.read_slice(&mut b, GuestAddress(BIG)).unwrap();
    [a, b]
}

fn restore(mem: &GuestMem, regions: &[Vec<u8>; 2]) {
    mem.write_slice(&regions[0], GuestAddress(0)).unwrap();
    mem.write_slice(&regions[1], GuestAddress(BIG)).unwrap();
}
