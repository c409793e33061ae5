//! The measuring child of `cryptblk-bench migrate` (crates/bench/src/migrate.rs, preset
//! `migrate`): on-demand read latency on the destination during postcopy, the disk version of
//! the table in QEMU's postcopy-preempt series, plus total time and downtime of a precopy
//! migration of a larger disk. The harness runs the configurations, rounds and tables:
//!
//! ```text
//! cargo run --release -p cryptblk-bench -- migrate [--size 2G] [--chunks 64K,2M,64M] [--modes a,b,c] ...
//! ```
//!
//! Latency part, for bulk chunk sizes 64 KiB, 2 MiB and 64 MiB and three modes:
//!
//! - (a) postcopy without preempt: urgent answers share the bulk channel (behind the chunk);
//! - (b) preempt, chunks not broken: urgent answers on their own channel, but only between
//!   bulk chunks;
//! - (c) full preempt: urgent answers between the slices (16 KiB) of a bulk chunk.
//!
//! Each configuration runs in a process of its own, so that the migration threads left behind
//! when the measurement stops die with it (one per configuration and round:
//! `CRYPTBLK_POSTCOPY_LATENCY_CHILD=source` writes the source image, `latency` and `big` print
//! a `RESULT key=value ...` line that crates/bench/src/migrate.rs parses). The child
//! migrates a raw image of `--size` bytes (non-zero data, so every chunk travels as data) over
//! loopback TCP with the link limited to 1 Gbit/s (`max_bandwidth = 125_000_000`, one link for
//! both channels), switches over to postcopy at once, and then reads random 4 KiB blocks on the
//! destination, one at a time every `--interval-ms`, for `--duration-secs`, while the bulk
//! stream is still running. The figures are the destination's own histogram
//! (`IncomingStatus.latency`): only reads that had to wait for a block count.
//!
//! Big part: precopy migration of a `--big-size` raw image (default 4 GiB) with a light writer
//! on the source (one random 4 KiB write per ms) during precopy; once the first sweep is done
//! and less than 8 MiB is dirty the writer stops and `switchover(false)` hands over. Reports
//! total time, downtime (`SourceStatus.downtime`: fence to destination complete), bytes sent
//! and passes.
//!
//! Images go to `--workdir` (the harness's `--dir`). Avoid tmpfs (/dev/shm): there
//! lseek(SEEK_HOLE) costs about 10 ms per GiB after the offset, paid by the sender once per
//! bulk chunk (`RawFile::block_status`), which throttles the bulk stream and delays urgent
//! answers. On a disk filesystem the images still live in the page cache.

use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_migration::{
    IncomingMigration, MigrationAddress, Phase, SourceMigration, SourceOptions,
};
use cryptblk_volume::DirtyTracker;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const CHILD_ENV: &str = "CRYPTBLK_POSTCOPY_LATENCY_CHILD";
const LINK: u64 = 125_000_000;
const BLOCK: u64 = 4096;

struct Args {
    size: u64,
    duration: Duration,
    interval: Duration,
    big_size: u64,
    big_bandwidth: Option<u64>,
    /// Child only: what to run.
    chunk: usize,
    mode: String,
    source: Option<PathBuf>,
    workdir: Option<PathBuf>,
    /// How the 1 Gbit/s link is modelled: "pacer" (the sender's --max-bandwidth) or "proxy"
    /// (a shaping proxy between the daemons; socket buffers fill as on a real link).
    link: String,
}

fn parse_size(s: &str) -> Res<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok(num.parse::<u64>()? * mult)
}

fn parse_args() -> Res<Args> {
    let mut a = Args {
        size: 2 << 30,
        duration: Duration::from_secs(8),
        interval: Duration::from_millis(5),
        big_size: 4 << 30,
        big_bandwidth: Some(LINK),
        chunk: 2 << 20,
        mode: "c".into(),
        source: None,
        workdir: None,
        link: "pacer".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--size" => a.size = parse_size(&val()?)?,
            "--duration-secs" => a.duration = Duration::from_secs_f64(val()?.parse()?),
            "--interval-ms" => a.interval = Duration::from_secs_f64(val()?.parse::<f64>()? / 1e3),
            "--big-size" => a.big_size = parse_size(&val()?)?,
            "--big-max-bandwidth" => {
                let v = val()?;
                a.big_bandwidth = if v == "none" { None } else { Some(v.parse()?) };
            }
            "--chunk" => a.chunk = parse_size(&val()?)? as usize,
            "--mode" => a.mode = val()?,
            "--source" => a.source = Some(PathBuf::from(val()?)),
            "--workdir" => a.workdir = Some(PathBuf::from(val()?)),
            "--link" => {
                a.link = val()?;
                if a.link != "pacer" && a.link != "proxy" {
                    return Err("--link is pacer or proxy".into());
                }
            }
            "-h" | "--help" => {
                eprintln!(
                    "usage: {CHILD_ENV}=source|latency|big postcopy_latency [--size BYTES] \
                     [--duration-secs N] [--interval-ms N] [--big-size BYTES] \
                     [--big-max-bandwidth BYTES_PER_SEC|none] [--chunk BYTES] [--mode a|b|c] \
                     [--link pacer|proxy] [--source PATH] [--workdir DIR] \
                     (cryptblk-bench migrate runs it)"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if !a.size.is_multiple_of(BLOCK)
        || !a.big_size.is_multiple_of(BLOCK)
        || a.size == 0
        || a.big_size == 0
    {
        return Err("sizes must be positive multiples of 4096".into());
    }
    Ok(a)
}

fn log(msg: impl AsRef<str>) {
    eprintln!("postcopy_latency: {}", msg.as_ref());
}

/// Creates a raw image of `size` bytes of non-zero data (every 4 KiB block distinct).
fn make_source(path: &Path, size: u64) -> Res<()> {
    let t = Instant::now();
    let f = RawFile::create(path, size)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut buf = vec![0u8; 8 << 20];
    rng.fill(&mut buf[..]);
    let mut off = 0;
    while off < size {
        let n = (buf.len() as u64).min(size - off) as usize;
        for (i, block) in buf[..n].chunks_mut(BLOCK as usize).enumerate() {
            let tag = (off / BLOCK + i as u64) | (1 << 63);
            block[..8].copy_from_slice(&tag.to_le_bytes());
        }
        f.write_at(&buf[..n], off)?;
        off += n as u64;
    }
    f.flush()?;
    log(format!(
        "source image {} ({} MiB) written in {:.1} s",
        path.display(),
        size >> 20,
        t.elapsed().as_secs_f64()
    ));
    Ok(())
}

fn open_rw(path: &Path) -> Res<Arc<RawFile>> {
    Ok(Arc::new(RawFile::open(
        path,
        OpenOptions {
            writable: true,
            lock: true,
        },
    )?))
}

/// A userspace model of a 1 Gbit/s link with per-flow fair queueing (like fq_codel on a
/// shaped NIC): every connection through it is read only as fast as the link drains, so the
/// sender's socket buffer fills up as it would on a real network, and the link takes 16 KiB
/// from each backlogged connection in turn. Returns the address to connect to.
fn shaping_proxy(target: String, bytes_per_sec: u64) -> Res<MigrationAddress> {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::mpsc::{sync_channel, Receiver, TryRecvError};
    use std::sync::Mutex;
    const PACKET: usize = 16 << 10;
    type Flow = (Receiver<Vec<u8>>, TcpStream);
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let flows: Arc<Mutex<Vec<Flow>>> = Arc::default();
    let accepted = flows.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(&target) else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            // Destination to source (requests, acknowledgements): small, not shaped.
            let (mut back_from, mut back_to) =
                (server.try_clone().unwrap(), client.try_clone().unwrap());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(n) = back_from.read(&mut buf) {
                    if n == 0 || back_to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
            // Source to destination: one small queue per flow; the rest waits in the kernel.
            let (tx, rx) = sync_channel::<Vec<u8>>(2);
            let mut from = client;
            std::thread::spawn(move || loop {
                let mut buf = vec![0u8; PACKET];
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        buf.truncate(n);
                        if tx.send(buf).is_err() {
                            break;
                        }
                    }
                }
            });
            accepted.lock().unwrap().push((rx, server));
        }
    });
    std::thread::spawn(move || {
        let mut free_at = Instant::now();
        let mut next = 0usize;
        loop {
            let packet = {
                let f = flows.lock().unwrap();
                let n = f.len();
                let mut found = None;
                for i in 0..n {
                    let idx = (next + i) % n;
                    match f[idx].0.try_recv() {
                        Ok(p) => {
                            found = Some((idx, p, f[idx].1.try_clone().unwrap()));
                            next = idx + 1;
                            break;
                        }
                        Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => {}
                    }
                }
                found
            };
            let Some((_, packet, mut out)) = packet else {
                std::thread::sleep(Duration::from_micros(20));
                continue;
            };
            let now = Instant::now();
            if free_at > now + Duration::from_micros(100) {
                std::thread::sleep(free_at - now);
            }
            let start = free_at.max(Instant::now());
            free_at = start + Duration::from_secs_f64(packet.len() as f64 / bytes_per_sec as f64);
            let _ = out.write_all(&packet);
        }
    });
    Ok(format!("tcp:{addr}").parse()?)
}

fn localhost() -> MigrationAddress {
    "tcp:127.0.0.1:0".parse().expect("valid address")
}

fn options(chunk: usize, mode: &str, link: &str) -> Res<SourceOptions> {
    let (preempt, break_chunks) = match mode {
        "a" => (false, false),
        "b" => (true, false),
        "c" => (true, true),
        other => return Err(format!("unknown mode {other}").into()),
    };
    Ok(SourceOptions {
        chunk_size: chunk,
        max_bandwidth: (link == "pacer").then_some(LINK),
        postcopy: true,
        preempt,
        break_chunks,
        ..Default::default()
    })
}

/// Child: one latency configuration. Prints `RESULT key=value ...` and exits without tearing
/// the migration down (postcopy cannot be cancelled; the process exit ends its threads).
fn child_latency(a: &Args) -> Res<()> {
    let src_path = a.source.as_ref().ok_or("--source missing")?;
    let workdir = a.workdir.as_ref().ok_or("--workdir missing")?;
    let src = open_rw(src_path)?;
    let tracker = Arc::new(DirtyTracker::new(src.clone(), 0, BLOCK)?);
    let dst_path = workdir.join(format!("dst-{}.raw", std::process::id()));
    let incoming = IncomingMigration::listen(&localhost(), &dst_path, None)?;
    let to = if a.link == "proxy" {
        let MigrationAddress::Tcp(target) = incoming.address() else {
            return Err("the proxy needs a TCP destination".into());
        };
        shaping_proxy(target.clone(), LINK)?
    } else {
        incoming.address().clone()
    };
    let mig = SourceMigration::start(
        src.clone(),
        tracker,
        &to,
        options(a.chunk, &a.mode, &a.link)?,
    )?;
    let ready = incoming.wait_header(Duration::from_secs(30))?;
    let disk = incoming.disk(ready.file.clone())?;
    mig.switchover(true)?;
    let phase = incoming.wait_for(Phase::Postcopy, Duration::from_secs(60));
    if phase != Phase::Postcopy {
        return Err(format!("destination did not go live: {:?}", incoming.status()).into());
    }
    let before = incoming.status();
    let missing_at_start = before.missing_blocks;

    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let blocks = disk.size() / BLOCK;
    let mut buf = vec![0u8; BLOCK as usize];
    let mut reads = 0u64;
    let mut client_waited_us: Vec<u64> = Vec::new();
    let start = Instant::now();
    while start.elapsed() < a.duration {
        let off = rng.gen_range(0..blocks) * BLOCK;
        let waited_before = incoming.status().urgent_requests;
        let t = Instant::now();
        disk.read_at(&mut buf, off)?;
        let us = t.elapsed().as_micros() as u64;
        let tag = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
        if tag != (off / BLOCK) | (1 << 63) {
            return Err(format!("read at {off} returned wrong data").into());
        }
        if incoming.status().urgent_requests > waited_before {
            client_waited_us.push(us);
        }
        reads += 1;
        std::thread::sleep(a.interval);
    }
    let st = incoming.status();
    let sst = mig.status();
    let measured = start.elapsed().as_secs_f64();
    client_waited_us.sort_unstable();
    let client_p99 = client_waited_us
        .get(((client_waited_us.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
        .copied()
        .unwrap_or(0);
    let l = st.latency;
    println!(
        "RESULT count={} avg_us={:.1} p50_us={} p99_us={} max_us={} reads={} \
         client_p99_us={} missing_start={} missing_end={} phase={} urgent_served={} \
         bytes_sent={} measured_s={:.2} throughput_mbps={:.1}",
        l.count,
        l.avg_us,
        l.p50_us,
        l.p99_us,
        l.max_us,
        reads,
        client_p99,
        missing_at_start,
        st.missing_blocks,
        st.phase,
        sst.urgent_served,
        sst.bytes_sent,
        measured,
        sst.throughput_bytes_per_sec * 8.0 / 1e6,
    );
    let _ = std::fs::remove_file(&dst_path);
    Ok(())
}

/// Child: the precopy migration of a big disk with a light writer.
fn child_big(a: &Args) -> Res<()> {
    let workdir = a.workdir.as_ref().ok_or("--workdir missing")?;
    let src_path = workdir.join("big-src.raw");
    let dst_path = workdir.join("big-dst.raw");
    let _ = std::fs::remove_file(&src_path);
    make_source(&src_path, a.big_size)?;
    let result = (|| -> Res<()> {
        let src = open_rw(&src_path)?;
        let tracker = Arc::new(DirtyTracker::new(src.clone(), 0, BLOCK)?);
        let incoming = IncomingMigration::listen(&localhost(), &dst_path, None)?;
        let stop = Arc::new(AtomicBool::new(false));
        let writes = Arc::new(AtomicU64::new(0));
        let writer = {
            let (dev, stop, writes) = (tracker.clone(), stop.clone(), writes.clone());
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(5);
                let blocks = dev.size() / BLOCK;
                let mut buf = vec![0u8; BLOCK as usize];
                while !stop.load(Ordering::SeqCst) {
                    let b = rng.gen_range(0..blocks);
                    rng.fill(&mut buf[8..]);
                    buf[..8].copy_from_slice(&(b | (1 << 63)).to_le_bytes());
                    if dev.write_at(&buf, b * BLOCK).is_err() {
                        break;
                    }
                    writes.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        let t0 = Instant::now();
        let mig = SourceMigration::start(
            src.clone(),
            tracker.clone(),
            incoming.address(),
            SourceOptions {
                chunk_size: 2 << 20,
                max_bandwidth: a.big_bandwidth,
                ..Default::default()
            },
        )?;
        // Converge: first sweep done and little left dirty (or give up waiting after 10 min).
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let st = mig.status();
            if st.phase != Phase::Precopy {
                return Err(format!("precopy ended early: {st:?}").into());
            }
            if (st.passes >= 1 && st.dirty_bytes < (8 << 20)) || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::SeqCst);
        writer.join().map_err(|_| "writer panicked")?;
        let dirty_at_switchover = mig.status().dirty_bytes;
        mig.switchover(false)?;
        let phase = mig.wait(Duration::from_secs(600));
        let total = t0.elapsed();
        let st = mig.status();
        if phase != Phase::Completed {
            return Err(format!("migration did not complete: {st:?}").into());
        }
        incoming.wait_for(Phase::Completed, Duration::from_secs(60));
        println!(
            "RESULT total_s={:.3} elapsed_s={:.3} downtime_ms={:.2} bytes_sent={} passes={} \
             writes={} dirty_at_switchover={} throughput_mbps={:.1}",
            total.as_secs_f64(),
            st.elapsed.as_secs_f64(),
            st.downtime.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
            st.bytes_sent,
            st.passes,
            writes.load(Ordering::Relaxed),
            dirty_at_switchover,
            st.throughput_bytes_per_sec * 8.0 / 1e6,
        );
        drop(mig);
        drop(incoming);
        Ok(())
    })();
    let _ = std::fs::remove_file(&src_path);
    let _ = std::fs::remove_file(&dst_path);
    result
}

/// Runs this example again as a child; returns the `key=value` pairs of its RESULT line.
fn main() {
    let res = parse_args().and_then(|a| match std::env::var(CHILD_ENV).as_deref() {
        Ok("latency") => child_latency(&a),
        Ok("big") => child_big(&a),
        Ok("source") => make_source(a.source.as_ref().ok_or("--source missing")?, a.size),
        _ => Err(format!(
            "this is the child of `cryptblk-bench migrate` (set {CHILD_ENV} to source, latency \
             or big); run the benchmark with `cargo run --release -p cryptblk-bench -- migrate`"
        )
        .into()),
    });
    match res {
        Ok(()) => {
            // A latency child leaves the postcopy threads running: exit now.
            std::process::exit(0)
        }
        Err(e) => {
            eprintln!("postcopy_latency: {e}");
            std::process::exit(1)
        }
    }
}
