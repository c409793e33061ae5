//! The copy engine of `convert`: one reader, several writers, a fixed set of buffers.
//!
//! Reading, encryption (inside the target device's `write_at`, spread over the crypto pool) and
//! writing overlap. Memory is bounded by the buffer count times the chunk size, whatever the
//! image size, because a buffer only returns to the reader once a writer has finished with it.
use super::extents::ExtentWalker;
use anyhow::{bail, Context, Result};
use crossbeam_channel::{bounded, Receiver, Sender};
use cryptblk_block::{AlignedBuf, BlockDevice, ExtentKind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
    pub writers: usize,
    pub holes: Holes,
    /// Set (by a signal handler) to stop the copy early with an error.
    pub interrupted: Arc<AtomicBool>,
}

impl PipelineConfig {
    /// Buffers in flight: enough for every writer to have one while the reader fills the next.
    pub fn buffers(&self) -> usize {
        self.writers * 2 + 1
    }
}

/// Progress counters shared with whoever renders progress.
#[derive(Default)]
pub struct Progress {
    pub done: AtomicU64,
}

enum Work {
    Data {
        offset: u64,
        buf: AlignedBuf,
        len: usize,
    },
    Zeros {
        offset: u64,
        len: usize,
    },
}

/// What a copy cost beyond the bytes it moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyStats {
    /// Allocation queries made to the source (`block_status`: one per extent).
    pub extent_queries: u64,
}

/// Copies `len` bytes from `src` to `dst` (same offsets).
pub fn copy(
    src: &dyn BlockDevice,
    dst: &dyn BlockDevice,
    len: u64,
    cfg: &PipelineConfig,
    progress: &Progress,
) -> Result<CopyStats> {
    let chunk = cfg.chunk_size.max(4096);
    // Aligned, so that a target doing direct I/O can DMA straight from them.
    let (free_tx, free_rx) = bounded::<AlignedBuf>(cfg.buffers());
    for _ in 0..cfg.buffers() {
        free_tx
            .send(AlignedBuf::zeroed(chunk))
            .expect("channel has room for every buffer");
    }
    let (work_tx, work_rx) = bounded::<Work>(cfg.buffers());
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let mut stats = CopyStats { extent_queries: 0 };
    let fail = |e: anyhow::Error| {
        failed.store(true, Ordering::SeqCst);
        first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
    };

    std::thread::scope(|s| {
        for _ in 0..cfg.writers.max(1) {
            let work_rx = work_rx.clone();
            let free_tx = free_tx.clone();
            s.spawn(|| {
                if let Err(e) =
                    write_loop(dst, work_rx, free_tx, chunk, cfg.holes, &failed, progress)
                {
                    fail(e);
                }
            });
        }
        drop(work_rx);
        let mut walker = ExtentWalker::new(src);
        let read = read_loop(
            src,
            &mut walker,
            len,
            chunk,
            cfg,
            &free_rx,
            work_tx,
            &failed,
            progress,
        );
        stats.extent_queries = walker.queries();
        if let Err(e) = read {
            fail(e);
        }
    });
    match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(stats),
    }
}

#[allow(clippy::too_many_arguments)]
fn read_loop(
    src: &dyn BlockDevice,
    walker: &mut ExtentWalker<'_>,
    len: u64,
    chunk: usize,
    cfg: &PipelineConfig,
    free_rx: &Receiver<AlignedBuf>,
    work_tx: Sender<Work>,
    failed: &AtomicBool,
    progress: &Progress,
) -> Result<()> {
    let mut offset = 0u64;
    while offset < len && !failed.load(Ordering::Relaxed) {
        if cfg.interrupted.load(Ordering::Relaxed) {
            bail!("interrupted by a signal");
        }
        let want = (len - offset).min(chunk as u64);
        let (kind, run) = walker
            .run_at(offset, want)
            .with_context(|| format!("querying allocation at offset {offset}"))?;
        let run = run as usize;
        let reads_as_zero = matches!(kind, ExtentKind::Zero | ExtentKind::Unallocated);
        let item = if reads_as_zero {
            Work::Zeros { offset, len: run }
        } else {
            let Ok(mut buf) = free_rx.recv() else { break };
            src.read_at(&mut buf[..run], offset)
                .with_context(|| format!("reading the source at offset {offset}"))?;
            Work::Data {
                offset,
                buf,
                len: run,
            }
        };
        match (cfg.holes, item) {
            (Holes::Skip, Work::Zeros { len, .. }) => {
                progress.done.fetch_add(len as u64, Ordering::Relaxed);
            }
            (_, item) => {
                if work_tx.send(item).is_err() {
                    break; // every writer stopped: one of them recorded why
                }
            }
        }
        offset += run as u64;
    }
    Ok(())
}

fn write_loop(
    dst: &dyn BlockDevice,
    work_rx: Receiver<Work>,
    free_tx: Sender<AlignedBuf>,
    chunk: usize,
    holes: Holes,
    failed: &AtomicBool,
    progress: &Progress,
) -> Result<()> {
    let zeros = AlignedBuf::zeroed(chunk);
    for item in work_rx {
        if failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let len = match item {
            Work::Zeros { offset, len } => {
                dst.write_at(&zeros[..len], offset)
                    .with_context(|| format!("writing the target at offset {offset}"))?;
                len
            }
            Work::Data { offset, buf, len } => {
                // Data that happens to be zero stays a hole in a sparse target, as with qemu-img.
                let skip = holes == Holes::Skip && buf[..len].iter().all(|&b| b == 0);
                let result = if skip {
                    Ok(())
                } else {
                    dst.write_at(&buf[..len], offset)
                };
                let _ = free_tx.send(buf);
                result.with_context(|| format!("writing the target at offset {offset}"))?;
                len
            }
        };
        progress.done.fetch_add(len as u64, Ordering::Relaxed);
    }
    Ok(())
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
        let path = std::ffi::CString::new(dir.path().to_str().unwrap()).unwrap();
        // SAFETY: an all-zero `statfs` is a valid value of that plain C struct.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `path` is a valid NUL-terminated string and `fs` a properly sized struct
        // that statfs fills in.
        let rc = unsafe { libc::statfs(path.as_ptr(), &mut fs) };
        assert_eq!(rc, 0, "statfs {}", dir.path().display());
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
        let src = RawFile::open(&src_path, OpenOptions::default()).unwrap();
        let dst = RawFile::create(&dst_path, size).unwrap();
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
        assert_eq!(first_difference(&src, &dst, size).unwrap(), None);
        // The holes stayed holes in the target.
        let blocks = std::fs::metadata(&dst_path).unwrap();
        assert!(
            std::os::unix::fs::MetadataExt::blocks(&blocks) * 512 <= 192 * MIB,
            "the target allocated {} bytes",
            std::os::unix::fs::MetadataExt::blocks(&blocks) * 512
        );
    }
}
