//! vu_bench: a vhost-user-blk load generator built on libblkio's Rust crate (`blkio`, driver
//! `virtio-blk-vhost-user`), so it measures any vhost-user-blk server the same way
//! (`cryptblk serve`, qemu-storage-daemon's vhost-user-blk export, ...).
//!
//! ```text
//! cargo run --release -p cryptblk-vhost-user-blk --example vu_bench -- \
//!     --socket PATH --rw randread|randwrite|read|write --bs 4096 --iodepth 32 --queues 1 \
//!     --runtime 10 [--size BYTES] [--queue-size N] [--once] [--server-pid PID]
//! ```
//!
//! One thread per queue keeps `iodepth` requests in flight and waits for completions with a
//! blocking `do_io(min_completions = 1)` (the queue's completion eventfd, no busy polling).
//! Requests are aligned to `bs`, within the first `--size` bytes (default: the whole disk);
//! sequential workloads start each queue at its own slice of that area and wrap around.
//! `--hugepages` puts the rings and buffers in 2 MiB hugepages (libblkio's `hugepages` property,
//! vendor/README.md): SPDK's vhost target needs it; the system must have free hugepages
//! (`/proc/sys/vm/nr_hugepages`).
//! `--once` makes one pass over the area instead of running for `--runtime` (use
//! `--rw write --once` to fill a disk before timing reads). Prints one JSON line:
//! `{"iops":..,"mib_s":..,"lat_avg_us":..,"lat_max_us":..,"queue_ios":[..],"queue_balance":..,...}`
//! (`queue_balance` = least-served queue's I/O count / most-served queue's), then
//! `lat_p50_us`, `lat_p99_us`, `lat_p999_us` (from a histogram with 64 buckets per power of two,
//! so within 1.6 %) and `client_cpu_pct` (this process's utime + stime over the measured window,
//! 100 = one core); with `--server-pid PID` also `server_cpu_pct`, that process's CPU over the
//! same window (connecting and setting up memory are outside it). Exits 1 on any failed
//! request.
//!
//! `--idle SECS` instead connects, starts the queues, maps its buffers and then sits idle for
//! SECS seconds without a request (to measure a server's CPU use with an idle frontend).

use std::mem::MaybeUninit;
use std::process::exit;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, ReqFlags};

// In a folder of its own: a file directly in examples/ would be built as an example.
#[path = "vu_bench/histogram.rs"]
mod histogram;
use histogram::Histogram;

const USAGE: &str = "usage: vu_bench --socket PATH --rw randread|randwrite|read|write \
[--bs BYTES (4096)] [--iodepth N (32)] [--queues N (1)] [--runtime SECS (10)] [--size BYTES] \
[--queue-size N] [--once] [--hugepages] [--server-pid PID] | vu_bench --socket PATH --idle SECS [--queues N]";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Rw {
    RandRead,
    RandWrite,
    Read,
    Write,
}

impl Rw {
    fn is_write(self) -> bool {
        matches!(self, Rw::RandWrite | Rw::Write)
    }
    fn is_random(self) -> bool {
        matches!(self, Rw::RandRead | Rw::RandWrite)
    }
    fn name(self) -> &'static str {
        match self {
            Rw::RandRead => "randread",
            Rw::RandWrite => "randwrite",
            Rw::Read => "read",
            Rw::Write => "write",
        }
    }
}

struct Args {
    socket: String,
    rw: Rw,
    bs: usize,
    iodepth: usize,
    queues: usize,
    runtime: f64,
    size: Option<u64>,
    queue_size: Option<i32>,
    once: bool,
    hugepages: bool,
    idle: Option<f64>,
    server_pid: Option<u32>,
}

fn fail(msg: impl std::fmt::Display) -> ! {
    eprintln!("vu_bench: {msg}");
    exit(1)
}

/// `4096`, `4k`, `64K`, `1M`, `1G` (binary suffixes).
fn parse_size(s: &str) -> u64 {
    let (num, mul) = match s.chars().last().map(|c| c.to_ascii_lowercase()) {
        Some('k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m') => (&s[..s.len() - 1], 1 << 20),
        Some('g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .unwrap_or_else(|| fail(format!("invalid size '{s}'\n{USAGE}")))
}

fn parse_args() -> Args {
    let mut a = Args {
        socket: String::new(),
        rw: Rw::RandRead,
        bs: 4096,
        iodepth: 32,
        queues: 1,
        runtime: 10.0,
        size: None,
        queue_size: None,
        once: false,
        hugepages: false,
        idle: None,
        server_pid: None,
    };
    let mut rw = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            exit(0);
        }
        if flag == "--once" {
            a.once = true;
            continue;
        }
        if flag == "--hugepages" {
            a.hugepages = true;
            continue;
        }
        let val = it
            .next()
            .unwrap_or_else(|| fail(format!("{flag} needs a value\n{USAGE}")));
        let num = |v: &str| -> usize {
            v.parse()
                .unwrap_or_else(|_| fail(format!("invalid {flag} '{v}'")))
        };
        match flag.as_str() {
            "--socket" => a.socket = val,
            "--rw" => {
                rw = Some(match val.as_str() {
                    "randread" => Rw::RandRead,
                    "randwrite" => Rw::RandWrite,
                    "read" => Rw::Read,
                    "write" => Rw::Write,
                    _ => fail(format!("invalid --rw '{val}'\n{USAGE}")),
                })
            }
            "--bs" => a.bs = parse_size(&val) as usize,
            "--iodepth" => a.iodepth = num(&val),
            "--queues" => a.queues = num(&val),
            "--runtime" => {
                a.runtime = val
                    .parse()
                    .unwrap_or_else(|_| fail(format!("invalid --runtime '{val}'")))
            }
            "--size" => a.size = Some(parse_size(&val)),
            "--queue-size" => a.queue_size = Some(num(&val) as i32),
            "--server-pid" => a.server_pid = Some(num(&val) as u32),
            "--idle" => {
                a.idle = Some(
                    val.parse()
                        .unwrap_or_else(|_| fail(format!("invalid --idle '{val}'"))),
                )
            }
            _ => fail(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    if a.socket.is_empty() {
        fail(format!("--socket is required\n{USAGE}"));
    }
    a.rw = match (rw, a.idle) {
        (Some(rw), None) => rw,
        (None, Some(_)) => Rw::Read,
        _ => fail(format!("give one of --rw and --idle\n{USAGE}")),
    };
    if a.bs == 0 || !a.bs.is_multiple_of(512) {
        fail("--bs must be a positive multiple of 512");
    }
    if a.iodepth == 0 || a.queues == 0 || a.runtime <= 0.0 {
        fail("--iodepth, --queues and --runtime must be positive");
    }
    a
}

fn check<T>(r: blkio::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| fail(format!("{what}: {e} ({:?})", e.errno())))
}

/// utime + stime of a process in clock ticks (`/proc/PID/stat`, fields counted after the
/// command name's closing parenthesis, which may hold spaces).
fn cpu_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// CPU ticks over `secs` seconds as a share of one core, in percent.
fn cpu_pct(ticks: u64, secs: f64) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks as f64 / hz / secs * 100.0
}

/// What one queue's thread did.
struct QueueResult {
    ios: u64,
    lat_sum: Duration,
    lat_max: Duration,
    lat: Histogram,
}

struct Job {
    rw: Rw,
    bs: usize,
    iodepth: usize,
    /// Bytes of the disk the requests fall in (a multiple of `bs`).
    area: u64,
    /// Where this queue's sequential stream starts.
    seq_start: u64,
    seed: u64,
    deadline: Option<Instant>,
    /// `--once`: requests to issue in total on this queue.
    total: Option<u64>,
    /// Address of this queue's `iodepth * bs` bytes of buffers in the mapped region.
    bufs: usize,
}

fn run_queue(mut q: Blkioq, job: Job) -> QueueResult {
    let blocks = job.area / job.bs as u64;
    let mut rng = job.seed | 1;
    let mut pos = job.seq_start;
    let mut next_offset = || {
        if job.rw.is_random() {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % blocks) * job.bs as u64
        } else {
            let off = pos;
            pos = (pos + job.bs as u64) % job.area;
            off
        }
    };
    let mut submitted_at = vec![Instant::now(); job.iodepth];
    let mut issued = 0u64;
    let mut in_flight = 0usize;
    let mut res = QueueResult {
        ios: 0,
        lat_sum: Duration::ZERO,
        lat_max: Duration::ZERO,
        lat: Histogram::new(),
    };
    let mut comps: Vec<MaybeUninit<Completion>> =
        (0..job.iodepth).map(|_| MaybeUninit::uninit()).collect();
    let more = |issued: u64| match (job.total, job.deadline) {
        (Some(total), _) => issued < total,
        (None, Some(deadline)) => Instant::now() < deadline,
        (None, None) => false,
    };
    let mut submit = |q: &mut Blkioq, slot: usize, submitted_at: &mut [Instant]| {
        let buf = job.bufs + slot * job.bs;
        let off = next_offset();
        submitted_at[slot] = Instant::now();
        if job.rw.is_write() {
            q.write(off, buf as *const u8, job.bs, slot, ReqFlags::empty());
        } else {
            q.read(off, buf as *mut u8, job.bs, slot, ReqFlags::empty());
        }
    };
    for slot in 0..job.iodepth {
        if !more(issued) {
            break;
        }
        submit(&mut q, slot, &mut submitted_at);
        issued += 1;
        in_flight += 1;
    }
    while in_flight > 0 {
        // Blocks on the completion eventfd until at least one request completes.
        let n = check(q.do_io(&mut comps, 1, None, None), "do_io");
        let now = Instant::now();
        for c in &comps[..n] {
            // SAFETY: do_io filled in the first `n` entries.
            let c = unsafe { c.assume_init_read() };
            if c.ret != 0 {
                fail(format!(
                    "{} request failed: {}",
                    job.rw.name(),
                    std::io::Error::from_raw_os_error(-c.ret)
                ));
            }
            res.ios += 1;
            let lat = now - submitted_at[c.user_data];
            res.lat_sum += lat;
            res.lat_max = res.lat_max.max(lat);
            res.lat.add(lat.as_nanos() as u64);
            in_flight -= 1;
            if more(issued) {
                submit(&mut q, c.user_data, &mut submitted_at);
                issued += 1;
                in_flight += 1;
            }
        }
    }
    res
}

fn main() {
    let a = parse_args();
    let mut blkio = check(Blkio::new("virtio-blk-vhost-user"), "blkio");
    check(blkio.set_str("path", &a.socket), "path");
    check(blkio.set_bool("hugepages", a.hugepages), "hugepages");
    check(blkio.connect(), &format!("connect to {}", a.socket));
    let capacity = check(blkio.get_u64("capacity"), "capacity");
    let max_queues = check(blkio.get_i32("max-queues"), "max-queues") as usize;
    let align = check(blkio.get_i32("request-alignment"), "request-alignment") as usize;
    let max_seg = check(blkio.get_i32("max-segment-len"), "max-segment-len");
    if a.queues > max_queues {
        fail(format!(
            "--queues {} but the device has {max_queues}",
            a.queues
        ));
    }
    if !a.bs.is_multiple_of(align) {
        fail(format!(
            "--bs {} is not a multiple of the request alignment {align}",
            a.bs
        ));
    }
    if max_seg > 0 && a.bs > max_seg as usize {
        fail(format!(
            "--bs {} is above the device's max-segment-len {max_seg}",
            a.bs
        ));
    }
    let area = a.size.unwrap_or(capacity).min(capacity) / a.bs as u64 * a.bs as u64;
    if area == 0 {
        fail("the disk (or --size) is smaller than --bs");
    }
    // A request takes 3 descriptors (header, data, status) of the split ring.
    let queue_size = a.queue_size.unwrap_or_else(|| {
        let need = (3 * a.iodepth).next_power_of_two().max(256);
        need.min(1024) as i32
    });
    check(blkio.set_i32("queue-size", queue_size), "queue-size");
    check(blkio.set_i32("num-queues", a.queues as i32), "num-queues");
    let started = check(blkio.start(), "start");

    let per_queue = a.iodepth * a.bs;
    // mem-region-alignment: 1 normally, 2 MiB with --hugepages.
    let region_align = check(
        blkio.get_u64("mem-region-alignment"),
        "mem-region-alignment",
    );
    let len = (per_queue * a.queues).next_multiple_of(4096.max(region_align as usize));
    let region = check(blkio.alloc_mem_region(len), "alloc_mem_region");
    // SAFETY: blkio just allocated and mapped `len` bytes at `region.addr` for us; nothing
    // else uses them yet.
    let mem = unsafe { std::slice::from_raw_parts_mut(region.addr as *mut u8, region.len) };
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for chunk in mem.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    check(blkio.map_mem_region(&region), "map_mem_region");

    if let Some(idle) = a.idle {
        // Connected, queues running, memory shared: nothing is submitted.
        let queues = started.queues;
        std::thread::sleep(Duration::from_secs_f64(idle));
        drop(queues);
        println!("{{\"idle_s\":{idle},\"queues\":{}}}", a.queues);
        return;
    }
    let server = a.server_pid.map(|p| p.to_string());
    let server_before = server.as_deref().and_then(cpu_ticks);
    let client_before = cpu_ticks("self");
    let start = Instant::now();
    let deadline = (!a.once).then(|| start + Duration::from_secs_f64(a.runtime));
    let blocks = area / a.bs as u64;
    let results: Vec<QueueResult> = std::thread::scope(|s| {
        let handles: Vec<_> = started
            .queues
            .into_iter()
            .enumerate()
            .map(|(i, q)| {
                let n = a.queues as u64;
                let (first, count) = (blocks * i as u64 / n, blocks * (i as u64 + 1) / n);
                let job = Job {
                    rw: a.rw,
                    bs: a.bs,
                    iodepth: a.iodepth,
                    area,
                    seq_start: first * a.bs as u64,
                    seed: 0x2545_f491_4f6c_dd1d ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9),
                    deadline,
                    total: a.once.then_some(count - first),
                    bufs: region.addr + i * per_queue,
                };
                s.spawn(move || run_queue(q, job))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let secs = start.elapsed().as_secs_f64();
    let client_after = cpu_ticks("self");
    let server_after = server.as_deref().and_then(cpu_ticks);
    let ios: u64 = results.iter().map(|r| r.ios).sum();
    let lat: Duration = results.iter().map(|r| r.lat_sum).sum();
    let iops = ios as f64 / secs;
    let mib_s = iops * a.bs as f64 / (1 << 20) as f64;
    let lat_avg_us = if ios == 0 {
        0.0
    } else {
        lat.as_secs_f64() * 1e6 / ios as f64
    };
    // Fairness between queues: the least-served queue's I/O count over the most-served one's
    // (1.0 = perfectly even), and the worst single request latency of any queue.
    let lat_max_us = results
        .iter()
        .map(|r| r.lat_max)
        .max()
        .unwrap_or_default()
        .as_secs_f64()
        * 1e6;
    let per_queue: Vec<String> = results.iter().map(|r| r.ios.to_string()).collect();
    let most = results.iter().map(|r| r.ios).max().unwrap_or(0);
    let least = results.iter().map(|r| r.ios).min().unwrap_or(0);
    let queue_balance = if most == 0 {
        1.0
    } else {
        least as f64 / most as f64
    };
    let mut lat_hist = Histogram::new();
    for r in &results {
        lat_hist.merge(&r.lat);
    }
    let mut extra = format!(
        ",\"lat_p50_us\":{:.1},\"lat_p99_us\":{:.1},\"lat_p999_us\":{:.1}",
        lat_hist.percentile_us(0.5),
        lat_hist.percentile_us(0.99),
        lat_hist.percentile_us(0.999)
    );
    if let (Some(b), Some(a)) = (client_before, client_after) {
        extra += &format!(
            ",\"client_cpu_pct\":{:.1}",
            cpu_pct(a.saturating_sub(b), secs)
        );
    }
    if let Some(pid) = &server {
        let (Some(b), Some(a)) = (server_before, server_after) else {
            fail(format!("--server-pid {pid}: cannot read /proc/{pid}/stat"));
        };
        extra += &format!(
            ",\"server_cpu_pct\":{:.1}",
            cpu_pct(a.saturating_sub(b), secs)
        );
    }
    println!(
        "{{\"iops\":{iops:.1},\"mib_s\":{mib_s:.2},\"lat_avg_us\":{lat_avg_us:.1},\
\"lat_max_us\":{lat_max_us:.1},\"queue_ios\":[{}],\"queue_balance\":{queue_balance:.3},\
\"rw\":\"{}\",\"bs\":{},\"iodepth\":{},\"queues\":{},\"runtime_s\":{secs:.3},\"ios\":{ios},\
\"area_bytes\":{area}{extra}}}",
        per_queue.join(","),
        a.rw.name(),
        a.bs,
        a.iodepth,
        a.queues
    );
}
