//! The patch libblkio carries for SPDK (vendor/README.md): its `hugepages` property against
//! `Server` (rings and buffers in 2 MiB hugetlb pages), and the patched client against SPDK's
//! vhost target, the benchmark's peer (e): DPDK's vhost offers no CONFIGURE_MEM_SLOTS, so
//! every memory region goes in a SET_MEM_TABLE (sent whole again when a region is added while
//! the queue runs), and SPDK needs the client's memory in hugepages. Each test needs free
//! hugepages, the second an SPDK build (`SPDK_DIR`, from scripts/build-spdk.sh); they are
//! skipped, saying so, without them.
use cryptblk_testutil::vhost_user::{pattern, Daemon};

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use cryptblk_block::{OpenOptions, RawFile};
use cryptblk_vhost_user_blk::ServeOptions;

const MIB: usize = 1 << 20;

struct Spdk {
    child: Child,
    dir: PathBuf,
}

impl Drop for Spdk {
    fn drop(&mut self) {
        // SPDK v24.01 can hang in its shutdown after a client left: no SIGTERM grace here.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn check<T>(r: blkio::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("blkio {what}: {e} (errno {:?})", e.errno()))
}

/// SPDK's vhost serving a 64 MiB RAM bdev as controller `vhost.0` in `dir`, or why not.
fn start_spdk(dir: &Path) -> Result<Spdk, String> {
    let spdk = PathBuf::from(std::env::var_os("SPDK_DIR").ok_or("SPDK_DIR is not set")?);
    let vhost = spdk.join("build/bin/vhost");
    if !vhost.is_file() {
        return Err(format!("{} not built", vhost.display()));
    }
    let free = free_hugepages();
    if free < 256 {
        return Err(format!("{free} free 2 MiB hugepages, 256 needed"));
    }
    let rpc = dir.join("rpc.sock");
    let libs = ["build/lib", "isa-l/.libs", "isa-l-crypto/.libs"]
        .map(|l| spdk.join(l).display().to_string())
        .join(":");
    let log = std::fs::File::create(dir.join("spdk.log")).unwrap();
    let child = Command::new(&vhost)
        .args(["-m", "0x1", "--no-pci", "-s", "256", "-S"])
        .arg(dir)
        .arg("-r")
        .arg(&rpc)
        .env("LD_LIBRARY_PATH", libs)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let server = Spdk {
        child,
        dir: dir.to_path_buf(),
    };
    let rpc_py = |args: &[&str]| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = Command::new("python3")
                .arg(spdk.join("scripts/rpc.py"))
                .arg("-s")
                .arg(&rpc)
                .args(args)
                .stdin(Stdio::null())
                .output()
                .unwrap();
            if out.status.success() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "rpc.py {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    rpc_py(&["bdev_malloc_create", "-b", "Malloc0", "64", "4096"]);
    rpc_py(&["vhost_create_blk_controller", "vhost.0", "Malloc0"]);
    Ok(server)
}

/// 2 MiB hugepages still available in the system pool: `HugePages_Free` less `HugePages_Rsvd`
/// (pages a shared mapping reserved but did not touch yet), from /proc/meminfo.
fn free_hugepages() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let field = |name: &str| -> u64 {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map_or(0, |v| v.trim().parse().unwrap())
    };
    field("HugePages_Free:") - field("HugePages_Rsvd:")
}

/// With `hugepages` set, the rings and the buffers blkio allocates are 2 MiB hugetlb pages:
/// the region is 2 MiB-aligned, the system's free hugepages drop while it is mapped, I/O
/// through it reads back what was written, and a region of part of a page is refused.
#[test]
fn hugepages_property_puts_rings_and_buffers_in_hugepages() {
    // Rings (one page) + a 4 MiB buffer region (two pages).
    let before = free_hugepages();
    if before < 3 {
        eprintln!(
            "SKIP: {before} free 2 MiB hugepages, 3 needed (echo 16 > /proc/sys/vm/nr_hugepages)"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.raw");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 * MIB as u64)
        .unwrap();
    let rw = OpenOptions {
        writable: true,
        lock: true,
    };
    let opts = ServeOptions {
        num_queues: 1,
        // libblkio's memfds are not sealed against shrinking.
        unsealed_memory: true,
        ..Default::default()
    };
    let daemon = Daemon::start(Arc::new(RawFile::open(&img, rw).unwrap()), opts);
    let want = pattern(MIB, 7);
    {
        let mut blkio = check(Blkio::new("virtio-blk-vhost-user"), "new");
        check(
            blkio.set_str("path", daemon.socket.to_str().unwrap()),
            "path",
        );
        check(blkio.set_bool("hugepages", true), "hugepages");
        check(blkio.connect(), "connect");
        let mut q = check(blkio.start(), "start").queues.remove(0);
        let align = check(blkio.get_u64("mem-region-alignment"), "alignment");
        assert_eq!(align, 2 * MIB as u64);
        let region = check(blkio.alloc_mem_region(4 * MIB), "alloc");
        check(blkio.map_mem_region(&region), "map");
        assert_eq!(region.addr % (2 * MIB), 0);
        put(&region, &pattern(4 * MIB, 3));
        assert!(
            free_hugepages() <= before - 3,
            "blkio did not use hugepages"
        );
        put(&region, &want);
        q.write(
            2 * MIB as u64,
            region.addr as *const u8,
            MIB,
            0,
            ReqFlags::empty(),
        );
        assert_eq!(run_one(&mut q), 0);
        put(&region, &vec![0; MIB]);
        q.read(
            2 * MIB as u64,
            region.addr as *mut u8,
            MIB,
            0,
            ReqFlags::empty(),
        );
        assert_eq!(run_one(&mut q), 0);
        assert!(bytes(&region, MIB) == want);
        // A length that is not whole hugepages is refused with a message saying so.
        let err = blkio
            .alloc_mem_region(MIB)
            .err()
            .expect("a 1 MiB region with 2 MiB hugepages");
        assert!(err.to_string().contains("mem-region-alignment"), "{err}");
    }
    daemon.stop();
    let on_disk = std::fs::read(&img).unwrap();
    assert!(on_disk[2 * MIB..3 * MIB] == want[..]);
}

fn run_one(q: &mut Blkioq) -> i32 {
    let mut c = [MaybeUninit::<Completion>::uninit()];
    assert_eq!(check(q.do_io(&mut c, 1, None, None), "do_io"), 1);
    // SAFETY: do_io reported one completion filled in.
    unsafe { c[0].assume_init_read() }.ret
}

/// A copy of the first `len` bytes of a region blkio allocated.
fn bytes(region: &MemoryRegion, len: usize) -> Vec<u8> {
    assert!(len <= region.len);
    // SAFETY: blkio allocated and mapped `region.len` bytes at `region.addr`; no request is in
    // flight when the test looks at them (each request is waited for).
    unsafe { std::slice::from_raw_parts(region.addr as *const u8, len) }.to_vec()
}

/// Puts `data` at the start of a region blkio allocated.
fn put(region: &MemoryRegion, data: &[u8]) {
    assert!(data.len() <= region.len);
    // SAFETY: as in `bytes`; the region is at least `data.len()` bytes long.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), region.addr as *mut u8, data.len()) };
}

#[test]
fn blkio_drives_spdk_through_set_mem_table_and_hugepages() {
    let dir = tempfile::tempdir().unwrap();
    let spdk = match start_spdk(dir.path()) {
        Ok(s) => s,
        Err(why) => {
            eprintln!("SKIP: {why} (build SPDK with scripts/build-spdk.sh)");
            return;
        }
    };
    let mut blkio = check(Blkio::new("virtio-blk-vhost-user"), "new");
    let socket = spdk.dir.join("vhost.0");
    check(blkio.set_str("path", socket.to_str().unwrap()), "path");
    check(blkio.set_bool("hugepages", true), "hugepages");
    check(blkio.connect(), "connect");
    assert_eq!(check(blkio.get_u64("capacity"), "capacity"), 64 << 20);
    // Without CONFIGURE_MEM_SLOTS, SET_MEM_TABLE's 8 regions are the limit.
    assert_eq!(
        check(blkio.get_u64("max-mem-regions"), "max-mem-regions"),
        8
    );
    let mut q = check(blkio.start(), "start").queues.remove(0);

    let first = check(blkio.alloc_mem_region(2 * MIB), "alloc");
    check(blkio.map_mem_region(&first), "map");
    let want: Vec<u8> = (0..MIB).map(|i| (i * 7 + i / 4096) as u8).collect();
    put(&first, &want);
    q.write(
        MIB as u64,
        first.addr as *const u8,
        MIB,
        0,
        ReqFlags::empty(),
    );
    assert_eq!(run_one(&mut q), 0);

    // A second region while the queue runs: the whole table goes again; SPDK restarts the
    // session with both regions and reads into the new one.
    let second = check(blkio.alloc_mem_region(2 * MIB), "alloc");
    check(blkio.map_mem_region(&second), "map second");
    q.read(
        MIB as u64,
        second.addr as *mut u8,
        MIB,
        0,
        ReqFlags::empty(),
    );
    assert_eq!(run_one(&mut q), 0);
    assert!(bytes(&second, MIB) == want);

    // And after the first is unmapped (the table sent again without it), the second still
    // works.
    blkio.unmap_mem_region(&first);
    put(&second, &vec![0; MIB]);
    q.read(
        MIB as u64,
        second.addr as *mut u8,
        MIB,
        0,
        ReqFlags::empty(),
    );
    assert_eq!(run_one(&mut q), 0);
    assert!(bytes(&second, MIB) == want);
}
