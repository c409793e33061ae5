//! The independent-client test: `Server` driven by libblkio's Rust crate (`blkio`, driver
//! `virtio-blk-vhost-user`), a vhost-user-blk frontend written by other people than the
//! in-repo harness in `common`. It checks what blkio reads from the device (capacity,
//! alignment, limits), many requests in flight on two queues at once with every byte
//! verified, FLUSH, WRITE_ZEROES, reconnects, a read-only export, and that a LUKS2 image
//! written this way decrypts to the same data when opened afresh.
mod common;

use std::mem::MaybeUninit;
use std::path::Path;
use std::sync::Arc;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use common::{open_raw, pattern, raw_image, Daemon};
use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_vhost_user_blk::ServeOptions;
use cryptblk_volume::{open_luks_volume, VolumeOptions};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const PW: &[u8] = b"blkio client passphrase";

fn opts(num_queues: u16) -> ServeOptions {
    ServeOptions {
        num_queues,
        queue_size: 256,
        read_only: false,
        serial: "blkio".into(),
        discard: false,
        // libblkio's memfds are not sealed against shrinking.
        unsealed_memory: true,
        ..Default::default()
    }
}

/// A LUKS2 image (aes-xts-plain64, 512-bit key, 4096-byte sectors) with `size` bytes of
/// payload, passphrase `PW`.
fn luks2_image(dir: &Path, size: u64) -> std::path::PathBuf {
    let img = dir.join("disk.luks2");
    cryptblk_testutil::luks::cheap_luks2(&img, PW, size, 4096);
    img
}

/// A blkio instance connected to `socket` and started with `num_queues` queues, with one
/// mapped memory region of `mem_len` bytes for data buffers.
struct Client {
    // Field order: queues first, then the instance (its drop disconnects).
    queues: Vec<Blkioq>,
    region: MemoryRegion,
    blkio: Blkio,
}

fn check<T>(r: blkio::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("blkio {what}: {e} (errno {:?})", e.errno()))
}

impl Client {
    fn connect(socket: &Path, num_queues: i32, read_only: bool, mem_len: usize) -> Client {
        let mut blkio = check(Blkio::new("virtio-blk-vhost-user"), "new");
        check(blkio.set_str("path", socket.to_str().unwrap()), "set path");
        check(blkio.set_bool("read-only", read_only), "set read-only");
        check(blkio.connect(), "connect");
        check(blkio.set_i32("num-queues", num_queues), "set num-queues");
        let started = check(blkio.start(), "start");
        assert_eq!(started.queues.len(), num_queues as usize);
        let region = check(blkio.alloc_mem_region(mem_len), "alloc_mem_region");
        check(blkio.map_mem_region(&region), "map_mem_region");
        Client {
            queues: started.queues,
            region,
            blkio,
        }
    }

    fn u64_prop(&self, name: &str) -> u64 {
        check(self.blkio.get_u64(name), name)
    }

    fn i32_prop(&self, name: &str) -> i32 {
        check(self.blkio.get_i32(name), name)
    }

    fn mem(&mut self) -> &mut [u8] {
        // SAFETY: the region was allocated by blkio (a shared mapping of `len` bytes) and stays
        // mapped while `self` lives; no request is in flight when a test calls this (every
        // helper waits for its completions), so nothing else accesses the bytes meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, self.region.len) }
    }

    /// Runs one request already queued on queue `q` and returns its `ret`.
    fn wait_one(q: &mut Blkioq) -> i32 {
        let mut c = [MaybeUninit::<Completion>::uninit()];
        let n = check(q.do_io(&mut c, 1, None, None), "do_io");
        assert_eq!(n, 1);
        // SAFETY: do_io reported one completion filled in.
        unsafe { c[0].assume_init_read() }.ret
    }

    fn read(&mut self, q: usize, offset: u64, mem_off: usize, len: usize) -> i32 {
        let buf = self.region.addr + mem_off;
        assert!(mem_off + len <= self.region.len);
        let queue = &mut self.queues[q];
        queue.read(offset, buf as *mut u8, len, 0, ReqFlags::empty());
        Self::wait_one(queue)
    }

    fn write(&mut self, q: usize, offset: u64, mem_off: usize, len: usize) -> i32 {
        let buf = self.region.addr + mem_off;
        assert!(mem_off + len <= self.region.len);
        let queue = &mut self.queues[q];
        queue.write(offset, buf as *const u8, len, 0, ReqFlags::empty());
        Self::wait_one(queue)
    }

    fn flush(&mut self, q: usize) -> i32 {
        let queue = &mut self.queues[q];
        queue.flush(0, ReqFlags::empty());
        Self::wait_one(queue)
    }

    fn write_zeroes(&mut self, q: usize, offset: u64, len: u64, flags: ReqFlags) -> i32 {
        let queue = &mut self.queues[q];
        queue.write_zeroes(offset, len, 0, flags);
        Self::wait_one(queue)
    }
}

/// Drives one queue from its own thread: writes `data` to the disk at `disk_off` with
/// `depth` requests of varying sizes in flight, then reads it back the same way (other
/// sizes, other order) into a second buffer and returns what was read.
///
/// `wbuf` and `rbuf` are addresses in the client's mapped region, `data.len()` bytes each,
/// used by this queue only.
fn drive_queue(
    queue: &mut Blkioq,
    wbuf: usize,
    rbuf: usize,
    disk_off: u64,
    data: &[u8],
    depth: usize,
    align: usize,
) -> Vec<u8> {
    // SAFETY: `wbuf` and `rbuf` point at `data.len()` bytes of a live blkio memory region that
    // only this thread uses; the slices are not touched while requests on them are in flight
    // (writes complete before `rbuf` is read, and `wbuf` is only filled before any request).
    let (w, r) = unsafe {
        (
            std::slice::from_raw_parts_mut(wbuf as *mut u8, data.len()),
            std::slice::from_raw_parts_mut(rbuf as *mut u8, data.len()),
        )
    };
    w.copy_from_slice(data);
    r.fill(0xa5);

    // Split the area into requests of 1..=16 alignment units (4 KiB to 64 KiB for 4 KiB
    // sectors), different for reads and writes.
    let split = |seed: usize| {
        let mut pieces = Vec::new();
        let (mut off, mut k) = (0usize, seed);
        while off < data.len() {
            k = k.wrapping_mul(1103515245).wrapping_add(12345);
            let len = ((k >> 8) % 16 + 1) * align;
            let len = len.min(data.len() - off);
            pieces.push((off, len));
            off += len;
        }
        pieces
    };
    for write in [true, false] {
        let mut pieces = split(if write { 7 } else { 11 });
        if !write {
            pieces.reverse();
        }
        let mut next = 0;
        let mut in_flight = 0;
        let mut done = 0;
        let mut comps: Vec<MaybeUninit<Completion>> =
            (0..depth).map(|_| MaybeUninit::uninit()).collect();
        while done < pieces.len() {
            while in_flight < depth && next < pieces.len() {
                let (off, len) = pieces[next];
                let dev = disk_off + off as u64;
                if write {
                    queue.write(dev, (wbuf + off) as *const u8, len, next, ReqFlags::empty());
                } else {
                    queue.read(dev, (rbuf + off) as *mut u8, len, next, ReqFlags::empty());
                }
                next += 1;
                in_flight += 1;
            }
            let n = check(queue.do_io(&mut comps, 1, None, None), "do_io");
            assert!(n >= 1);
            for c in &comps[..n] {
                // SAFETY: do_io filled in the first `n` completions.
                let c = unsafe { c.assume_init_read() };
                let (off, len) = pieces[c.user_data];
                assert_eq!(
                    c.ret,
                    0,
                    "{} of {len} bytes at {} failed",
                    if write { "write" } else { "read" },
                    disk_off + off as u64
                );
            }
            in_flight -= n;
            done += n;
        }
    }
    r.to_vec()
}

/// Both queues at once, each on its own disk area, from two threads.
fn two_queues_concurrently(client: &mut Client, area: u64, depth: usize, align: usize) -> Vec<u8> {
    let base = client.region.addr;
    let want: Vec<Vec<u8>> = (0..2).map(|q| pattern(area as usize, 100 + q)).collect();
    let mut queues = std::mem::take(&mut client.queues);
    let got: Vec<Vec<u8>> = std::thread::scope(|s| {
        let handles: Vec<_> = queues
            .iter_mut()
            .zip(&want)
            .enumerate()
            .map(|(q, (queue, data))| {
                let wbuf = base + 2 * q * area as usize;
                let rbuf = wbuf + area as usize;
                s.spawn(move || drive_queue(queue, wbuf, rbuf, q as u64 * area, data, depth, align))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    client.queues = queues;
    for q in 0..2 {
        assert!(got[q] == want[q], "queue {q}: data read back differs");
    }
    want.concat()
}

#[test]
fn luks2_4k_sectors_through_blkio() {
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB;
    let img = luks2_image(dir.path(), size);
    let rw = VolumeOptions {
        writable: true,
        ..Default::default()
    };
    let volume = open_luks_volume(&img, PW, &rw).unwrap();
    assert_eq!(volume.size(), size);
    let daemon = Daemon::start(Arc::new(volume), opts(2));

    let area = 2 * MIB;
    let mut client = Client::connect(&daemon.socket, 2, false, 4 * area as usize);

    // What blkio derives from the config space and features.
    assert_eq!(client.u64_prop("capacity"), size);
    assert_eq!(client.i32_prop("request-alignment"), 4096);
    assert_eq!(client.i32_prop("optimal-io-alignment"), 4096);
    assert_eq!(client.i32_prop("optimal-io-size"), 0);
    assert!(client.i32_prop("max-queues") >= 2);
    assert_eq!(client.i32_prop("max-segment-len"), 1 << 20);
    assert_eq!(client.i32_prop("max-segments"), 254);
    assert!(client.u64_prop("max-write-zeroes-len") >= 4096);
    assert!(check(client.blkio.get_bool("flush-needed"), "flush-needed"));
    assert!(!check(client.blkio.get_bool("read-only"), "read-only"));

    // 2 queues x 2 MiB, 8 requests of 4-64 KiB in flight on each, every byte verified.
    let mut want = two_queues_concurrently(&mut client, area, 8, 4096);
    assert_eq!(client.flush(0), 0);
    assert_eq!(client.flush(1), 0);

    // WRITE_ZEROES, with and without the unmap hint, then read back through blkio.
    assert_eq!(
        client.write_zeroes(0, 12 * KIB, 20 * KIB, ReqFlags::empty()),
        0
    );
    want[12 * KIB as usize..32 * KIB as usize].fill(0);
    assert_eq!(
        client.write_zeroes(1, area + 64 * KIB, 4 * KIB, ReqFlags::NO_UNMAP),
        0
    );
    let z = (area + 64 * KIB) as usize;
    want[z..z + 4096].fill(0);
    let len = 128 * KIB as usize;
    client.mem()[..len].fill(0xee);
    assert_eq!(client.read(0, 0, 0, len), 0);
    assert!(client.mem()[..len] == want[..len]);
    assert_eq!(client.read(1, area, 0, len), 0);
    assert!(client.mem()[..len] == want[area as usize..area as usize + len]);

    // A single 8 KiB write at the end of queue 1's area, through queue 0.
    let tail = pattern(8192, 7);
    client.mem()[..8192].copy_from_slice(&tail);
    let at = 2 * area as usize - 8192;
    assert_eq!(client.write(0, at as u64, 0, 8192), 0);
    want[at..].copy_from_slice(&tail);

    // A request past the end fails, and the queue keeps working.
    assert_ne!(client.read(0, size, 0, 4096), 0);
    assert_eq!(client.read(0, size - 4096, 0, 4096), 0);
    assert_eq!(client.flush(0), 0);
    drop(client);
    daemon.stop();

    // The image decrypts to the same data when opened afresh, and is really encrypted.
    let volume = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap();
    let mut back = vec![0u8; want.len()];
    volume.read_at(&mut back, 0).unwrap();
    assert!(back == want, "fresh volume differs from what blkio wrote");
    let raw = std::fs::read(&img).unwrap();
    assert!(!raw.windows(64).any(|w| w == &want[4096..4096 + 64]));
}

#[test]
fn raw_image_reconnect_and_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let size = 4 * MIB;
    let img = raw_image(dir.path(), size);
    let daemon = Daemon::start(open_raw(&img, true), opts(2));

    let area = MIB;
    let want = {
        let mut client = Client::connect(&daemon.socket, 2, false, 4 * area as usize);
        assert_eq!(client.u64_prop("capacity"), size);
        assert_eq!(client.i32_prop("request-alignment"), 512);
        assert_eq!(client.i32_prop("optimal-io-alignment"), 512);
        // 512-byte requests, 32 in flight per queue.
        let want = two_queues_concurrently(&mut client, area, 32, 512);
        assert_eq!(client.flush(0), 0);
        want
    };
    // A second connection after the first one went away sees the same data.
    {
        let mut client = Client::connect(&daemon.socket, 1, false, 2 * area as usize);
        // One segment per request and max-segment-len is 1 MiB (SIZE_MAX): two reads.
        let seg = client.i32_prop("max-segment-len") as usize;
        assert_eq!(seg, area as usize);
        assert_eq!(client.read(0, 0, 0, seg), 0);
        assert_eq!(client.read(0, area, seg, seg), 0);
        // A longer request is refused (IOERR -> EIO), and the queue keeps working.
        assert_eq!(client.read(0, 0, 0, 2 * seg), -libc::EIO);
        assert_eq!(client.read(0, 0, 0, 512), 0);
        assert!(client.mem()[..512] == want[..512]);
        assert_eq!(client.read(0, area, seg, seg), 0);
        assert!(client.mem()[..2 * area as usize] == want[..]);
    }
    daemon.stop();
    let back = std::fs::read(&img).unwrap();
    assert!(back[..2 * area as usize] == want[..]);

    // A read-only export: blkio sees VIRTIO_BLK_F_RO and refuses to start read-write.
    let daemon = Daemon::start(
        open_raw(&img, false),
        ServeOptions {
            read_only: true,
            ..opts(1)
        },
    );
    {
        let mut blkio = check(Blkio::new("virtio-blk-vhost-user"), "new");
        check(
            blkio.set_str("path", daemon.socket.to_str().unwrap()),
            "path",
        );
        check(blkio.connect(), "connect");
        let err = blkio
            .start()
            .err()
            .expect("read-write start of an RO device");
        assert_eq!(err.errno(), blkio::Errno::ROFS, "{err}");
    }
    {
        let mut client = Client::connect(&daemon.socket, 1, true, 64 * KIB as usize);
        assert!(check(client.blkio.get_bool("read-only"), "read-only"));
        assert_eq!(client.read(0, 0, 0, 64 * KIB as usize), 0);
        assert!(client.mem()[..64 * KIB as usize] == want[..64 * KIB as usize]);
    }
    daemon.stop();
}

/// The asynchronous path at depth 64 on two queues at once, in every cache mode with both aio
/// engines, for a LUKS2 and a raw image on a real filesystem (O_DIRECT works there): every
/// byte written through libblkio reads back, and reopening the image shows the same data.
#[test]
fn depth_64_on_two_queues_in_every_cache_mode_and_engine() {
    use cryptblk_block::{AioEngine, CacheMode, IoSettings};
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let area = 2 * MIB;
    for aio in AioEngine::ALL {
        for cache in CacheMode::ALL {
            for luks in [true, false] {
                let io = IoSettings { cache, aio };
                eprintln!("{aio}/{cache}/luks={luks}");
                let (img, device, align): (_, Arc<dyn BlockDevice>, usize) = if luks {
                    let img = luks2_image(dir.path(), 2 * area);
                    let rw = VolumeOptions {
                        writable: true,
                        io,
                        ..Default::default()
                    };
                    let volume = open_luks_volume(&img, PW, &rw).unwrap();
                    (img, Arc::new(volume), 4096)
                } else {
                    let img = raw_image(dir.path(), 2 * area);
                    let rw = OpenOptions {
                        writable: true,
                        lock: true,
                    };
                    let raw = RawFile::open_with(&img, rw, io).unwrap();
                    assert_eq!(
                        raw.cache(),
                        cache,
                        "O_DIRECT refused under {}",
                        dir.path().display()
                    );
                    (img, Arc::new(raw), 512)
                };
                let daemon = Daemon::start(device, opts(2));
                let mut client = Client::connect(&daemon.socket, 2, false, 4 * area as usize);
                let want = two_queues_concurrently(&mut client, area, 64, align);
                assert_eq!(client.flush(0), 0);
                drop(client);
                daemon.stop();
                let back = if luks {
                    let volume = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap();
                    let mut back = vec![0u8; want.len()];
                    volume.read_at(&mut back, 0).unwrap();
                    back
                } else {
                    std::fs::read(&img).unwrap()
                };
                assert!(
                    back == want,
                    "{aio}/{cache}/luks={luks}: image differs after reopening"
                );
                std::fs::remove_file(&img).unwrap();
            }
        }
    }
}
