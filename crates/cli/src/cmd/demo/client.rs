//! The demo's VM stand-in: libblkio's vhost-user-blk driver, the same client the benchmarks
//! use (`vu_bench`), connected to a socket of the daemon the demo started. One queue keeps
//! `depth` requests in flight and sleeps on the completion eventfd between completions, as a
//! guest's virtio-blk driver would.
use anyhow::{bail, Context, Result};
use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use std::mem::MaybeUninit;
use std::path::Path;
use std::time::{Duration, Instant};

/// What a load run asks for.
#[derive(Clone, Copy)]
pub struct Load {
    pub write: bool,
    pub random: bool,
    pub block: usize,
    pub depth: usize,
    pub time: Duration,
}

impl Load {
    pub fn describe(&self) -> String {
        format!(
            "{}k {} {}, depth {}",
            self.block / 1024,
            if self.random { "random" } else { "sequential" },
            if self.write { "write" } else { "read" },
            self.depth
        )
    }
}

/// Requests per second and bytes per second of one run.
pub struct Rate {
    pub iops: f64,
    pub bytes_per_sec: f64,
}

impl Rate {
    /// The rate over two runs of equal length.
    pub fn mean(&self, other: &Rate) -> Rate {
        Rate {
            iops: (self.iops + other.iops) / 2.0,
            bytes_per_sec: (self.bytes_per_sec + other.bytes_per_sec) / 2.0,
        }
    }
}

/// A connected vhost-user-blk disk with one started queue and `len` bytes of memory shared
/// with the server.
pub struct Disk {
    queue: Blkioq,
    region: MemoryRegion,
    capacity: u64,
    // Kept last: the queue and the region belong to this instance.
    _blkio: Blkio,
}

fn blkio<T>(r: blkio::Result<T>, what: &str) -> Result<T> {
    r.map_err(|e| anyhow::anyhow!("libblkio: {what}: {e}"))
}

impl Disk {
    /// Connects to `socket` with one queue and `len` bytes of request buffers.
    pub fn connect(socket: &Path, len: usize) -> Result<Disk> {
        let mut b = blkio(Blkio::new("virtio-blk-vhost-user"), "virtio-blk-vhost-user")?;
        let path = socket.to_str().context("socket path is not UTF-8")?;
        blkio(b.set_str("path", path), "path")?;
        blkio(b.connect(), &format!("connecting to {}", socket.display()))?;
        let capacity = blkio(b.get_u64("capacity"), "capacity")?;
        blkio(b.set_i32("queue-size", 256), "queue-size")?;
        blkio(b.set_i32("num-queues", 1), "num-queues")?;
        let mut started = blkio(b.start(), "start")?;
        let region = blkio(b.alloc_mem_region(len.next_multiple_of(4096)), "memory")?;
        blkio(b.map_mem_region(&region), "mapping memory")?;
        let queue = started.queues.pop().context("libblkio started no queue")?;
        Ok(Disk {
            queue,
            region,
            capacity,
            _blkio: b,
        })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The shared buffer as a raw pointer: the server reads and writes it while requests are in
    /// flight, so it is never handed out as a Rust reference while a request may be pending.
    fn buffer(&self) -> *mut u8 {
        self.region.addr as *mut u8
    }

    /// Fills the shared buffer with pseudo-random data from `seed` (no request is in flight).
    pub fn fill(&mut self, seed: u64) {
        let mut x = seed | 1;
        for i in 0..self.region.len / 8 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // SAFETY: `i * 8 + 8 <= region.len`, the region is mapped for this process, and no
            // request is in flight, so nothing else writes it now.
            unsafe { self.buffer().add(i * 8).cast::<u64>().write_unaligned(x) };
        }
    }

    /// A copy of the first `len` bytes of the shared buffer (no request is in flight).
    pub fn snapshot(&self, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len.min(self.region.len)];
        // SAFETY: the source is `out.len()` mapped bytes no request is using; the regions do
        // not overlap.
        unsafe { std::ptr::copy_nonoverlapping(self.buffer(), out.as_mut_ptr(), out.len()) };
        out
    }

    /// One request and its completion.
    pub fn transfer(&mut self, write: bool, offset: u64, len: usize) -> Result<()> {
        assert!(len <= self.region.len);
        if write {
            self.queue
                .write(offset, self.buffer(), len, 0, ReqFlags::empty());
        } else {
            self.queue
                .read(offset, self.buffer(), len, 0, ReqFlags::empty());
        }
        let mut done = [MaybeUninit::<Completion>::uninit()];
        let n = blkio(self.queue.do_io(&mut done, 1, None, None), "waiting")?;
        if n != 1 {
            bail!("libblkio: no completion for the request");
        }
        // SAFETY: do_io filled in the first `n` (= 1) entries.
        let c = unsafe { done[0].assume_init_read() };
        check(&c)
    }

    /// Runs `load` over the disk's first `area` bytes for its time and measures it.
    pub fn run(&mut self, load: Load, area: u64) -> Result<Rate> {
        assert!(load.depth * load.block <= self.region.len);
        let blocks = area / load.block as u64;
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = 0u64;
        let mut offset = || {
            let block = if load.random {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % blocks
            } else {
                next = (next + 1) % blocks;
                next
            };
            block * load.block as u64
        };
        let base = self.buffer();
        let mut submit = |q: &mut Blkioq, slot: usize| {
            // Each slot has its own buffer: a request in flight owns it until it completes.
            let buf = base.wrapping_add(slot * load.block);
            if load.write {
                q.write(offset(), buf, load.block, slot, ReqFlags::empty());
            } else {
                q.read(offset(), buf, load.block, slot, ReqFlags::empty());
            }
        };
        let start = Instant::now();
        let deadline = start + load.time;
        for slot in 0..load.depth {
            submit(&mut self.queue, slot);
        }
        let mut outstanding = load.depth;
        let mut completed = 0u64;
        let mut done: Vec<MaybeUninit<Completion>> =
            (0..load.depth).map(|_| MaybeUninit::uninit()).collect();
        while outstanding > 0 {
            // Sleeps on the completion eventfd until at least one request completes.
            let n = blkio(self.queue.do_io(&mut done, 1, None, None), "waiting")?;
            let more = Instant::now() < deadline;
            for c in &done[..n] {
                // SAFETY: do_io filled in the first `n` entries.
                let c = unsafe { c.assume_init_read() };
                check(&c)?;
                completed += 1;
                outstanding -= 1;
                if more {
                    submit(&mut self.queue, c.user_data);
                    outstanding += 1;
                }
            }
        }
        let secs = start.elapsed().as_secs_f64();
        Ok(Rate {
            iops: completed as f64 / secs,
            bytes_per_sec: (completed * load.block as u64) as f64 / secs,
        })
    }
}

fn check(c: &Completion) -> Result<()> {
    if c.ret != 0 {
        bail!(
            "the daemon failed a request: {}",
            std::io::Error::from_raw_os_error(-c.ret)
        );
    }
    Ok(())
}
