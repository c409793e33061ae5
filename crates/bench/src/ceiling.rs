//! `cryptblk-bench ceiling`: what an encryptor can get out of the device on this machine.
//!
//! fio's figure is the device's ceiling for a reader that never looks at the data. An
//! encryptor must read every byte the device delivered (and write it back decrypted), and on
//! some machines that alone slows the device down: on this project's 2-vCPU PVM guest one read
//! pass over each completed 64 KiB buffer took the same O_DIRECT reads from 22-28k to 16-19k
//! IOPS at depth 16, while the same pass over other, equally cold memory, or a busy loop of
//! the same length, cost nothing. The gap between an encrypted server and its plain twin
//! cannot be smaller than that, whatever the server does, so the benchmark scripts measure it
//! next to the servers.
//!
//! One thread keeps `iodepth` O_DIRECT reads in flight with io_uring, like fio's `io_uring`
//! engine, and on each completion does nothing (`--touch none`: fio's ceiling again), reads
//! the buffer once (`read`), or decrypts it in place with the volume's cipher engine
//! (`decrypt`, AES-XTS-256 with a throwaway key: what the server's queue thread does), then
//! resubmits. Prints one JSON object: `{"iops", "lat_avg_us", "touch"}`.

use anyhow::{bail, Context, Result};
use cryptblk_block::AlignedBuf;
use cryptblk_crypto::{default_engine_for, CipherSpec, Direction, SecretKey, SectorCipher};
use io_uring::{opcode, types, IoUring};
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Touching time after which the reads queued so far are submitted (a 4 KiB buffer takes
/// about a microsecond, a 64 KiB one 10-20).
const SUBMIT_AFTER: Duration = Duration::from_micros(10);

/// What the reader does with each buffer the device filled before it reads into it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Touch {
    None,
    Read,
    Decrypt,
}

#[derive(clap::Args)]
pub struct Args {
    /// The file or device to read.
    file: PathBuf,
    /// Where the reads start (a LUKS image's payload offset), bytes.
    #[arg(long, default_value_t = 0)]
    offset: u64,
    /// Bytes the reads cover from --offset (default: to the end of the file).
    #[arg(long)]
    size: Option<u64>,
    /// read (sequential) or randread.
    #[arg(long, default_value = "read")]
    rw: String,
    #[arg(long, default_value_t = 65536)]
    bs: usize,
    #[arg(long, default_value_t = 16)]
    iodepth: usize,
    /// Seconds.
    #[arg(long, default_value_t = 5.0)]
    runtime: f64,
    #[arg(long, value_enum, default_value = "none")]
    touch: Touch,
}

/// `cryptblk-bench ceiling`: one measurement, its JSON on stdout.
pub fn main(a: &Args) -> Result<()> {
    let random = match a.rw.as_str() {
        "read" => false,
        "randread" => true,
        other => bail!("--rw {other}: the ceiling reads (read or randread)"),
    };
    let size = match a.size {
        Some(size) => size,
        None => std::fs::metadata(&a.file)
            .with_context(|| format!("{}", a.file.display()))?
            .len()
            .saturating_sub(a.offset),
    };
    let result = run(&Ceiling {
        file: &a.file,
        offset: a.offset,
        size,
        random,
        bs: a.bs,
        iodepth: a.iodepth,
        runtime: Duration::from_secs_f64(a.runtime),
        touch: a.touch,
    })?;
    println!("{result}");
    Ok(())
}

/// One measurement's parameters.
pub struct Ceiling<'a> {
    pub file: &'a Path,
    /// Where the reads start (a LUKS image's payload offset) and how many bytes they cover.
    pub offset: u64,
    pub size: u64,
    pub random: bool,
    pub bs: usize,
    pub iodepth: usize,
    pub runtime: Duration,
    pub touch: Touch,
}

/// Offsets of successive reads: sequential, wrapping, or uniformly random (xorshift).
struct Offsets {
    next: u64,
    state: u64,
    blocks: u64,
    bs: u64,
    random: bool,
}

impl Offsets {
    fn next(&mut self) -> u64 {
        let block = if self.random {
            self.state ^= self.state << 13;
            self.state ^= self.state >> 7;
            self.state ^= self.state << 17;
            self.state % self.blocks
        } else {
            let b = self.next;
            self.next = (self.next + 1) % self.blocks;
            b
        };
        block * self.bs
    }
}

pub fn run(c: &Ceiling) -> Result<serde_json::Value> {
    if c.bs == 0 || !c.bs.is_multiple_of(4096) || c.iodepth == 0 || c.iodepth > 1024 {
        bail!("--bs must be a non-zero multiple of 4096 and --iodepth 1..=1024");
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(c.file)
        .with_context(|| format!("opening {} with O_DIRECT", c.file.display()))?;
    let blocks = c.size / c.bs as u64;
    if blocks == 0 {
        bail!("--size {} is smaller than one block of {}", c.size, c.bs);
    }
    let cipher: Option<Arc<dyn SectorCipher>> = match c.touch {
        Touch::Decrypt => {
            let spec = CipherSpec::parse("aes", "xts-plain64", 64)?;
            let key = SecretKey::new((0..64u8).collect());
            Some(default_engine_for(&spec)?.new_cipher(&spec, &key, 4096)?)
        }
        _ => None,
    };
    // One buffer per read in flight, aligned for O_DIRECT.
    let mut buffers: Vec<AlignedBuf> = (0..c.iodepth).map(|_| AlignedBuf::zeroed(c.bs)).collect();
    let mut offsets = Offsets {
        next: 0,
        state: 0x9e37_79b9_7f4a_7c15,
        blocks,
        bs: c.bs as u64,
        random: c.random,
    };
    let mut ring = IoUring::new(c.iodepth.next_power_of_two() as u32).context("io_uring")?;
    let mut submitted_at = vec![Instant::now(); c.iodepth];
    let mut offset_of = vec![0u64; c.iodepth];
    let fd = types::Fd(file.as_raw_fd());
    let queue = |ring: &mut IoUring, buffers: &mut [AlignedBuf], index: usize, offset: u64| {
        let read = opcode::Read::new(fd, buffers[index].as_mut_ptr(), c.bs as u32)
            .offset(c.offset + offset)
            .build()
            .user_data(index as u64);
        // SAFETY: the buffer stays allocated and untouched until this read's completion is
        // reaped below (the loop never reads or frees a buffer with a read in flight), and
        // the ring was sized for iodepth entries.
        unsafe { ring.submission().push(&read) }.map_err(|_| anyhow::anyhow!("SQ full"))
    };
    for (index, (at, off)) in submitted_at
        .iter_mut()
        .zip(offset_of.iter_mut())
        .enumerate()
    {
        *off = offsets.next();
        *at = Instant::now();
        queue(&mut ring, &mut buffers, index, *off)?;
    }
    let start = Instant::now();
    let mut done = 0u64;
    let mut latency = Duration::ZERO;
    let mut sink = 0u64;
    let mut finished = Vec::with_capacity(c.iodepth);
    while start.elapsed() < c.runtime {
        ring.submit_and_wait(1).context("io_uring_enter")?;
        let mut last_submit = Instant::now();
        finished.clear();
        finished.extend(
            ring.completion()
                .map(|cqe| (cqe.user_data() as usize, cqe.result())),
        );
        for &(index, result) in &finished {
            if result != c.bs as i32 {
                bail!(
                    "read of {} bytes at {} returned {result}",
                    c.bs,
                    offset_of[index]
                );
            }
            latency += submitted_at[index].elapsed();
            done += 1;
            let data = &mut buffers[index][..];
            match c.touch {
                Touch::None => {}
                Touch::Read => {
                    sink = data.chunks_exact(8).fold(sink, |s, w| {
                        s.wrapping_add(u64::from_ne_bytes(w.try_into().unwrap()))
                    });
                }
                Touch::Decrypt => {
                    let sector = (c.offset + offset_of[index]) / 512;
                    cipher
                        .as_ref()
                        .unwrap()
                        .crypt(Direction::Decrypt, sector, data)?;
                }
            }
            offset_of[index] = offsets.next();
            submitted_at[index] = Instant::now();
            queue(&mut ring, &mut buffers, index, offset_of[index])?;
            // Not only after the whole batch is touched: once SUBMIT_AFTER of touching has
            // passed, the device gets the reads queued so far while the thread works on.
            if last_submit.elapsed() >= SUBMIT_AFTER {
                ring.submit().context("io_uring_enter")?;
                last_submit = Instant::now();
            }
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    std::hint::black_box(sink);
    // The buffers outlive every read into them: collect the ones still in flight.
    let mut in_flight = c.iodepth;
    while in_flight > 0 {
        ring.submit_and_wait(1).context("io_uring_enter")?;
        in_flight -= ring.completion().count();
    }
    Ok(serde_json::json!({
        "iops": done as f64 / elapsed,
        "lat_avg_us": latency.as_secs_f64() * 1e6 / done.max(1) as f64,
        "touch": format!("{:?}", c.touch).to_lowercase(),
    }))
}
