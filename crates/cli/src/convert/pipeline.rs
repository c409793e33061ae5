//! The copy engine of `convert`: one thread driving the source's and the target's
//! asynchronous I/O queues over a fixed set of chunk buffers.
//!
//! Up to `PipelineConfig::depth()` chunks are in flight at once: read ahead from the source,
//! written to the target (O_DIRECT on a new target; an encrypted target encrypts each chunk
//! into its bounce buffer as it is queued, spread over the crypto pool; an encrypted source
//! decrypts each chunk as it completes). The thread sleeps on the two queues' eventfds. Memory
//! is bounded by the buffer count times the chunk size, whatever the image size, because a
//! buffer is only read into again once its write has completed.
use super::extents::ExtentWalker;
use anyhow::{anyhow, bail, Context, Result};
use cryptblk_block::aio::{IoBuffers, IoRequest, MemoryOwner, OwnedBuffer, QueueOptions};
use cryptblk_block::open_queue;
use cryptblk_block::{BlockDevice, ExtentKind};
use rustix::event::{poll, PollFd, PollFlags};
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// How the pipeline treats regions the source reports as zero or unallocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holes {
    /// Leave them unwritten: the target reads zeros there already (a fresh sparse raw file).
    Skip,
    /// Write zeros: a LUKS target's unwritten ciphertext would decrypt to garbage.
    WriteZeros,
}

pub struct PipelineConfig {
    pub chunk_size: usize,
    /// Sizes the pipeline: the crypto threads (at least 2).
    pub writers: usize,
    pub holes: Holes,
    /// Set (by a signal handler) to stop the copy early with an error.
    pub interrupted: Arc<AtomicBool>,
}

impl PipelineConfig {
    /// Chunks in flight: two per crypto thread (one being encrypted or written while the
    /// next is read) and one more.
    pub fn depth(&self) -> usize {
        self.writers * 2 + 1
    }
}

/// Progress counters shared with whoever renders progress.
#[derive(Default)]
pub struct Progress {
    pub done: AtomicU64,
}

/// What a copy cost beyond the bytes it moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyStats {
    /// Allocation queries made to the source (`block_status`: one per extent).
    pub extent_queries: u64,
}

/// A chunk buffer and what it holds.
struct Chunk {
    /// Held by a queue too while a read or write of it runs.
    buf: Arc<OwnedBuffer>,
    offset: u64,
    len: usize,
}

/// Writes of zeros (holes of the source on an encrypted target) carry tags from here up;
/// data chunks are tagged with their buffer's index.
const ZERO_TAG: u64 = 1 << 32;

/// Copies `len` bytes from `src` to `dst` (same offsets).
pub fn copy(
    src: &Arc<dyn BlockDevice>,
    dst: &Arc<dyn BlockDevice>,
    len: u64,
    cfg: &PipelineConfig,
    progress: &Progress,
) -> Result<CopyStats> {
    let chunk = cfg.chunk_size.max(4096);
    let depth = cfg.depth();
    let mut reads = open_queue(src, &QueueOptions { depth }).context("opening the source")?;
    // Room for every data chunk plus as many zero writes.
    let mut writes =
        open_queue(dst, &QueueOptions { depth: 2 * depth }).context("opening the target")?;
    // Aligned, so that a target doing direct I/O can DMA straight from them.
    let mut chunks: Vec<Chunk> = (0..depth)
        .map(|_| Chunk {
            buf: Arc::new(OwnedBuffer::zeroed(chunk)),
            offset: 0,
            len: 0,
        })
        .collect();
    let mut free: Vec<usize> = (0..depth).rev().collect();
    // Written wherever the source has a hole and the target needs zeros: read-only, so every
    // zero write in flight shares it.
    let zeros: Arc<dyn MemoryOwner> = Arc::new(OwnedBuffer::zeroed(chunk));
    // The buffers of the request being pushed (reused; a queue keeps its own copy).
    let mut io = IoBuffers::with_capacity(1);
    // Zero writes in flight, by slot: (offset, length).
    let mut zero_runs: Vec<Option<(u64, u64)>> = vec![None; depth];
    let mut walker = ExtentWalker::new(src.as_ref());
    let mut offset = 0u64;
    let mut read_done = Vec::new();
    let mut write_done = Vec::new();
    let result = (|| -> Result<()> {
        loop {
            if cfg.interrupted.load(Ordering::Relaxed) {
                bail!("interrupted by a signal");
            }
            // Read ahead into every free buffer; queue zeros for holes.
            while offset < len {
                let want = (len - offset).min(chunk as u64);
                let (kind, run) = walker
                    .run_at(offset, want)
                    .with_context(|| format!("querying allocation at offset {offset}"))?;
                let run_len = run as usize;
                if matches!(kind, ExtentKind::Zero | ExtentKind::Unallocated) {
                    match cfg.holes {
                        Holes::Skip => progress.done.fetch_add(run, Ordering::Relaxed),
                        Holes::WriteZeros => {
                            let Some(z) = zero_runs.iter().position(Option::is_none) else {
                                break;
                            };
                            io.set_owner(zeros.clone());
                            io.add(0, run_len)?;
                            let req = IoRequest::write(offset, &io, false, ZERO_TAG + z as u64);
                            writes.push(&req).map_err(|e| anyhow!(e))?;
                            zero_runs[z] = Some((offset, run));
                            0
                        }
                    };
                    offset += run;
                    continue;
                }
                let Some(i) = free.pop() else { break };
                let c = &mut chunks[i];
                c.offset = offset;
                c.len = run_len;
                io.set_owner(c.buf.clone());
                io.add(0, run_len)?;
                reads
                    .push(&IoRequest::read(offset, &io, i as u64))
                    .map_err(|e| anyhow!(e))?;
                offset += run;
            }
            io.clear();
            reads.submit().context("reading the source")?;
            writes.submit().context("writing the target")?;
            if offset >= len && reads.in_flight() == 0 && writes.in_flight() == 0 {
                return Ok(());
            }
            wait_any([reads.notifier(), writes.notifier()]);
            reads.drain(&mut |c| read_done.push(c));
            for c in read_done.drain(..) {
                let i = c.tag as usize;
                let chunk = &mut chunks[i];
                c.result
                    .with_context(|| format!("reading the source at offset {}", chunk.offset))?;
                // Data that happens to be zero stays a hole in a sparse target, as with
                // qemu-img.
                let data = Arc::get_mut(&mut chunk.buf)
                    .context("a chunk's buffer still held by the source's queue")?
                    .bytes_mut();
                if cfg.holes == Holes::Skip && data[..chunk.len].iter().all(|&b| b == 0) {
                    progress.done.fetch_add(chunk.len as u64, Ordering::Relaxed);
                    free.push(i);
                    continue;
                }
                io.set_owner(chunk.buf.clone());
                io.add(0, chunk.len)?;
                let req = IoRequest::write(chunk.offset, &io, false, c.tag);
                writes.push(&req).map_err(|e| anyhow!(e))?;
            }
            io.clear();
            writes.drain(&mut |c| write_done.push(c));
            for c in write_done.drain(..) {
                let (at, n) = if c.tag >= ZERO_TAG {
                    zero_runs[(c.tag - ZERO_TAG) as usize]
                        .take()
                        .unwrap_or_default()
                } else {
                    let chunk = &chunks[c.tag as usize];
                    free.push(c.tag as usize);
                    (chunk.offset, chunk.len as u64)
                };
                c.result
                    .with_context(|| format!("writing the target at offset {at}"))?;
                progress.done.fetch_add(n, Ordering::Relaxed);
            }
        }
    })();
    // Dropping the queues waits for whatever is still in flight (after an error).
    drop(io);
    drop(reads);
    drop(writes);
    result.map(|()| CopyStats {
        extent_queries: walker.queries(),
    })
}

/// Blocks until one of the eventfds is readable (or a signal interrupts the wait).
fn wait_any(fds: [BorrowedFd<'_>; 2]) {
    let mut pfds = fds.map(|fd| PollFd::from_borrowed_fd(fd, PollFlags::IN));
    let _ = poll(&mut pfds, None);
}

/// Compare two devices over `len` bytes with bounded memory; the first differing offset.
pub fn first_difference(a: &dyn BlockDevice, b: &dyn BlockDevice, len: u64) -> Result<Option<u64>> {
    const STEP: usize = 1 << 20;
    let (mut x, mut y) = (vec![0u8; STEP], vec![0u8; STEP]);
    let mut offset = 0u64;
    while offset < len {
        let n = (len - offset).min(STEP as u64) as usize;
        a.read_at(&mut x[..n], offset)?;
        b.read_at(&mut y[..n], offset)?;
        if let Some(i) = x[..n].iter().zip(&y[..n]).position(|(p, q)| p != q) {
            return Ok(Some(offset + i as u64));
        }
        offset += n as u64;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cryptblk_block::{OpenOptions, RawFile};
    use std::os::unix::fs::FileExt;

    const MIB: u64 = 1 << 20;

    /// A directory on tmpfs, where `SEEK_HOLE` walks a dense file's pages to its end: the
    /// filesystem where asking per chunk cost the most.
    fn tmpfs_dir() -> tempfile::TempDir {
        let dir = tempfile::Builder::new()
            .prefix("cryptblk-extents-")
            .tempdir_in("/dev/shm")
            .expect("/dev/shm must exist and be writable (a tmpfs on Debian)");
        let fs = rustix::fs::statfs(dir.path())
            .unwrap_or_else(|e| panic!("statfs {}: {e}", dir.path().display()));
        assert_eq!(fs.f_type, libc::TMPFS_MAGIC, "/dev/shm is not a tmpfs here");
        dir
    }

    #[test]
    fn a_gibibyte_on_tmpfs_costs_one_allocation_query_per_extent() {
        let dir = tmpfs_dir();
        let (src_path, dst_path) = (dir.path().join("src.raw"), dir.path().join("dst.raw"));
        let size = 1024 * MIB;
        // Data, hole, data, hole, data: five extents, 192 MiB of it data.
        let data = [(0, 64 * MIB), (448 * MIB, 64 * MIB), (960 * MIB, 64 * MIB)];
        {
            let f = std::fs::File::create(&src_path).unwrap();
            f.set_len(size).unwrap();
            let mut piece = vec![0u8; MIB as usize];
            for &(start, len) in &data {
                for off in (start..start + len).step_by(MIB as usize) {
                    piece.fill((off / MIB) as u8 | 1);
                    f.write_all_at(&piece, off).unwrap();
                }
            }
        }
        let src: Arc<dyn BlockDevice> =
            Arc::new(RawFile::open(&src_path, OpenOptions::default()).unwrap());
        let dst: Arc<dyn BlockDevice> = Arc::new(RawFile::create(&dst_path, size).unwrap());
        let cfg = PipelineConfig {
            chunk_size: MIB as usize,
            writers: 2,
            holes: Holes::Skip,
            interrupted: Arc::new(AtomicBool::new(false)),
        };
        let progress = Progress::default();
        let stats = copy(&src, &dst, size, &cfg, &progress).unwrap();
        // One block_status (at most one SEEK_DATA and one SEEK_HOLE) per extent: at most 10
        // lseeks for the gibibyte, where asking per 1 MiB chunk made 1024 queries.
        assert_eq!(stats.extent_queries, 5);
        assert_eq!(progress.done.load(Ordering::Relaxed), size);
        assert_eq!(first_difference(&*src, &*dst, size).unwrap(), None);
        // The holes stayed holes in the target.
        let blocks = std::fs::metadata(&dst_path).unwrap();
        assert!(
            std::os::unix::fs::MetadataExt::blocks(&blocks) * 512 <= 192 * MIB,
            "the target allocated {} bytes",
            std::os::unix::fs::MetadataExt::blocks(&blocks) * 512
        );
    }
}
