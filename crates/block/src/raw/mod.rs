//! A plain file (or block device node) as a `BlockDevice`: positioned I/O, advisory locking,
//! hole detection so copies can skip sparse regions, the host cache modes (`CacheMode`:
//! O_DIRECT, write-through, ignored flushes) and the asynchronous engines (`uring`: io_uring;
//! `threads`: the I/O thread pool).
//!
//! With O_DIRECT, data moves between the device and the caller's memory without a copy when
//! the memory, offset and length meet the file's direct-I/O alignment (`direct::DioAlign`,
//! from statx). Memory that is not aligned goes through an aligned bounce buffer. An offset or
//! length that is not aligned (only a client ignoring the advertised logical block size sends
//! one) goes through the page cache instead, which the kernel keeps coherent with direct I/O.

mod direct;
mod files;
mod threads;
mod uring;

use crate::aio::{Bounds, Pipeline, QueueOptions};
use crate::error::check_range;
use crate::{AioEngine, BlockDevice, BlockError, BlockErrorKind, CacheMode, Extent, ExtentKind};
use direct::DioAlign;
use files::Files;
use rustix::fs::SeekFrom;
use rustix::io::{Errno, ReadWriteFlags};
use std::fs::{File, TryLockError};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// How to open a raw file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenOptions {
    pub writable: bool,
    /// Take an advisory lock: exclusive for writers, shared for readers, so that two writers
    /// (or a writer and a reader) of one image refuse to run at once.
    pub lock: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            writable: false,
            lock: true,
        }
    }
}

/// How a raw file does its I/O once open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoSettings {
    pub cache: CacheMode,
    pub aio: AioEngine,
}

impl Default for IoSettings {
    /// What library callers get from `RawFile::open`: the page cache (`writeback`), io_uring
    /// for asynchronous queues.
    fn default() -> Self {
        IoSettings {
            cache: CacheMode::Writeback,
            aio: AioEngine::IoUring,
        }
    }
}

/// A raw image file. Writes never grow the file; only `set_len` (a resize) changes its size.
#[derive(Debug)]
pub struct RawFile {
    files: Arc<Files>,
    aio: AioEngine,
}

impl RawFile {
    /// Opens through the page cache (`IoSettings::default`).
    pub fn open(path: impl AsRef<Path>, opts: OpenOptions) -> Result<Self, BlockError> {
        Self::open_with(path, opts, IoSettings::default())
    }

    /// Opens with a cache mode and aio engine. Where the filesystem refuses O_DIRECT (tmpfs)
    /// the cache mode falls back to its page-cache twin (`CacheMode::without_direct`) with a
    /// notice in the log; `cache()` tells the mode in effect.
    pub fn open_with(
        path: impl AsRef<Path>,
        opts: OpenOptions,
        settings: IoSettings,
    ) -> Result<Self, BlockError> {
        let path = path.as_ref();
        let file = open_fd(path, opts.writable, false, settings.cache.write_through())
            .map_err(|e| BlockError::io("open", e).with_path(path))?;
        if opts.lock {
            lock_file(&file, opts.writable).map_err(|e| e.with_path(path))?;
        }
        Self::with_file(file, path, opts, settings)
    }

    /// The image a predecessor daemon had open (and locked: the lock belongs to the open file
    /// it handed over, so it never lapses), opened by it with these `opts` and `settings`.
    /// `path` must still name that very file, since a direct-I/O descriptor is opened by it.
    pub fn from_inherited(
        file: File,
        path: impl AsRef<Path>,
        opts: OpenOptions,
        settings: IoSettings,
    ) -> Result<Self, BlockError> {
        use std::os::unix::fs::MetadataExt;
        let path = path.as_ref();
        let held = file
            .metadata()
            .map_err(|e| BlockError::io("stat", e).with_path(path))?;
        let named =
            std::fs::metadata(path).map_err(|e| BlockError::io("stat", e).with_path(path))?;
        if (held.dev(), held.ino()) != (named.dev(), named.ino()) {
            return Err(BlockError::new(
                BlockErrorKind::Io,
                "the path no longer names the image the predecessor daemon had open (moved or replaced)",
            )
            .with_path(path));
        }
        Self::with_file(file, path, opts, settings)
    }

    fn with_file(
        file: File,
        path: &Path,
        opts: OpenOptions,
        settings: IoSettings,
    ) -> Result<Self, BlockError> {
        let size = file_size(&file).map_err(|e| e.with_path(path))?;
        let mut raw = RawFile {
            files: Arc::new(Files {
                buffered: file,
                direct: None,
                dio: DioAlign::default(),
                path: path.to_path_buf(),
                size: AtomicU64::new(size),
                writable: opts.writable,
                cache: settings.cache.without_direct(),
            }),
            aio: settings.aio,
        };
        if settings.cache.direct() {
            if is_tmpfs(&raw.files.buffered) {
                // tmpfs takes O_DIRECT since Linux 6.6, but its files live in the page cache:
                // there is nothing to bypass, and the direct path only costs more.
                tracing::warn!(
                    image = %path.display(),
                    "tmpfs keeps files in memory, there is no page cache to bypass: cache={} \
                     instead of cache={}",
                    settings.cache.without_direct(),
                    settings.cache
                );
            } else if !raw.try_direct(settings.cache)? {
                tracing::warn!(
                    image = %path.display(),
                    "the filesystem refuses O_DIRECT: cache={} instead of cache={}",
                    settings.cache.without_direct(),
                    settings.cache
                );
            }
        }
        if raw.aio == AioEngine::IoUring && !supports_nowait(&raw.files.buffered) {
            // io_uring would hand every request to one of its kernel worker threads: the
            // threads engine does the same with less overhead.
            tracing::warn!(
                image = %path.display(),
                "the filesystem cannot do non-blocking I/O (e.g. tmpfs): aio=threads instead \
                 of aio=io_uring"
            );
            raw.aio = AioEngine::Threads;
        }
        Ok(raw)
    }

    /// The open (and locked) image file, to hand over to a successor daemon.
    pub fn locked_file(&self) -> &File {
        &self.files.buffered
    }

    /// Creates a new sparse file of `size` bytes (refusing to overwrite an existing one) and
    /// opens it writable and locked, through the page cache.
    pub fn create(path: impl AsRef<Path>, size: u64) -> Result<Self, BlockError> {
        let path = path.as_ref();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| BlockError::io("create", e).with_path(path))?;
        lock_file(&file, true).map_err(|e| e.with_path(path))?;
        file.set_len(size)
            .map_err(|e| BlockError::io("set_len", e).with_path(path))?;
        Ok(RawFile {
            files: Arc::new(Files {
                buffered: file,
                direct: None,
                dio: DioAlign::default(),
                path: path.to_path_buf(),
                size: AtomicU64::new(size),
                writable: true,
                cache: CacheMode::Writeback,
            }),
            aio: AioEngine::IoUring,
        })
    }

    /// Adds an O_DIRECT descriptor and switches to `cache` (a direct mode). False, changing
    /// nothing, where the filesystem refuses O_DIRECT.
    fn try_direct(&mut self, cache: CacheMode) -> Result<bool, BlockError> {
        let files = Arc::get_mut(&mut self.files).ok_or_else(|| {
            BlockError::new(
                BlockErrorKind::Io,
                "cannot change the cache mode while asynchronous queues are open",
            )
        })?;
        let direct = match open_fd(&files.path, files.writable, true, cache.write_through()) {
            Ok(direct) => direct,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(false),
            Err(e) => return Err(BlockError::io("open O_DIRECT", e).with_path(&files.path)),
        };
        let Some(dio) = DioAlign::probe(&direct) else {
            return Ok(false);
        };
        files.direct = Some(direct);
        files.dio = dio;
        files.cache = cache;
        Ok(true)
    }

    /// Bypasses the page cache from now on (`cache=none`): for bulk copies that would
    /// otherwise pay a second memory copy and stall on writeback of gigabytes of dirty pages.
    /// `flush` still syncs, because O_DIRECT alone does not make data or allocations durable.
    /// Returns false, changing nothing, where the filesystem refuses O_DIRECT (e.g. tmpfs).
    pub fn enable_direct_writes(&mut self) -> Result<bool, BlockError> {
        if !self.files.writable {
            return Err(BlockError::read_only("enable direct I/O").with_path(&self.files.path));
        }
        self.try_direct(CacheMode::None)
    }

    /// The cache mode in effect.
    pub fn cache(&self) -> CacheMode {
        self.files.cache
    }

    /// The asynchronous engine asked for (io_uring falls back to threads where refused).
    pub fn aio(&self) -> AioEngine {
        self.aio
    }

    /// The underlying file, for code (such as the LUKS header reader) that works on `&File`.
    /// It is the buffered descriptor, whatever the cache mode.
    pub fn file(&self) -> &File {
        &self.files.buffered
    }

    pub fn path(&self) -> &Path {
        &self.files.path
    }

    /// The direct-I/O alignment in effect: memory address and file offset/length (1 when the
    /// file is not opened with O_DIRECT).
    pub fn direct_alignment(&self) -> (usize, usize) {
        match self.files.direct {
            Some(_) => (self.files.dio.mem, self.files.dio.offset),
            None => (1, 1),
        }
    }

    /// Changes the file's length to `len` bytes (sparse: growing allocates nothing, as
    /// `qemu-img resize` does). The size requests are checked against changes only once the
    /// file has its new length when it grows, and before the file is cut when it shrinks, so
    /// no request is let through to a range the file does not have. A filesystem that refuses
    /// (a file size limit, `EFBIG`; a full filesystem) leaves the file as it was.
    pub fn set_len(&self, len: u64) -> Result<(), BlockError> {
        let f = &self.files;
        if !f.writable {
            return Err(BlockError::read_only("resize").with_path(&f.path));
        }
        let old = f.size();
        if len < old {
            f.size.store(len, Ordering::Release);
        }
        if let Err(e) = f.buffered.set_len(len) {
            f.size.store(old, Ordering::Release);
            return Err(BlockError::io("resize", e).with_path(&f.path));
        }
        f.size.store(len, Ordering::Release);
        Ok(())
    }

    /// A write through the header's descriptor reached `end`: a file grows to hold it.
    pub(crate) fn grew_to(&self, end: u64) {
        self.files.size.fetch_max(end, Ordering::AcqRel);
    }

    /// Deallocates `len` bytes at `offset` (they then read as zeros) without changing the size.
    pub fn punch_hole(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.files.punch_hole(offset, len)
    }

    /// `lseek` with SEEK_DATA / SEEK_HOLE. `Ok(None)` means ENXIO: no such region at or after
    /// `offset` (for SEEK_DATA: the rest of the file is a hole).
    ///
    /// Moving the shared file position is harmless because every data access in this type
    /// uses pread/pwrite, never the position.
    fn seek(&self, to: SeekFrom) -> std::io::Result<Option<u64>> {
        let (SeekFrom::Data(offset) | SeekFrom::Hole(offset)) = to else {
            unreachable!("only SEEK_DATA and SEEK_HOLE walk extents")
        };
        if i64::try_from(offset).is_err() {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        match rustix::fs::seek(&self.files.buffered, to) {
            Ok(at) => Ok(Some(at)),
            Err(Errno::NXIO) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

fn file_size(file: &File) -> Result<u64, BlockError> {
    let meta = file.metadata().map_err(|e| BlockError::io("stat", e))?;
    if meta.file_type().is_file() {
        return Ok(meta.len());
    }
    // Block device nodes report length 0 in metadata; ask the device itself.
    let mut f = file;
    std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0)).map_err(|e| BlockError::io("seek", e))
}

fn lock_file(file: &File, exclusive: bool) -> Result<(), BlockError> {
    let res = if exclusive {
        file.try_lock()
    } else {
        file.try_lock_shared()
    };
    match res {
        Ok(()) => Ok(()),
        Err(TryLockError::WouldBlock) => Err(BlockError::new(
            BlockErrorKind::Locked,
            if exclusive {
                "image is in use by another process (could not get an exclusive lock for writing)"
            } else {
                "image is in use by another process that has it open for writing"
            },
        )),
        Err(TryLockError::Error(e)) => Err(BlockError::io("lock", e)),
    }
}

/// Whether `file` lives on tmpfs.
fn is_tmpfs(file: &File) -> bool {
    rustix::fs::fstatfs(file).is_ok_and(|fs| fs.f_type == libc::TMPFS_MAGIC)
}

/// Whether reads of `file` can be tried without blocking (RWF_NOWAIT): what io_uring needs to
/// complete a request in place instead of in a kernel worker thread. Filesystems without it
/// (tmpfs) answer EOPNOTSUPP; EAGAIN (data not cached) still means yes.
fn supports_nowait(file: &File) -> bool {
    let mut byte = [0u8; 1];
    let read = rustix::io::preadv2(
        file,
        &mut [std::io::IoSliceMut::new(&mut byte)],
        0,
        ReadWriteFlags::NOWAIT,
    );
    read != Err(Errno::OPNOTSUPP)
}

/// Opens `path` for reading (and writing), optionally with O_DIRECT and O_DSYNC.
fn open_fd(path: &Path, writable: bool, direct: bool, dsync: bool) -> std::io::Result<File> {
    let mut flags = 0;
    if direct {
        flags |= libc::O_DIRECT;
    }
    if dsync {
        flags |= libc::O_DSYNC;
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(writable)
        .custom_flags(flags)
        .open(path)
}

/// Whether the once-per-process notice about io_uring being unavailable was logged.
static URING_NOTICE: AtomicBool = AtomicBool::new(false);

impl BlockDevice for RawFile {
    fn size(&self) -> u64 {
        self.files.size()
    }

    /// 512, or the direct-I/O offset alignment when the file bypasses the page cache (a 4 KiB
    /// device), so that clients send only requests the device can take without a copy.
    fn logical_block_size(&self) -> u32 {
        match self.files.direct {
            Some(_) => u32::try_from(self.files.dio.offset.max(512)).unwrap_or(4096),
            None => 512,
        }
    }

    fn read_only(&self) -> bool {
        !self.files.writable
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.files.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        self.files.write_at(buf, offset)
    }

    fn flush(&self) -> Result<(), BlockError> {
        self.files.flush()
    }

    /// Punches a hole: the range reads as zeros afterwards.
    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.punch_hole(offset, len)
    }

    /// `FALLOC_FL_ZERO_RANGE` where the filesystem has it (the range stays allocated), zeros
    /// written otherwise.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.files.write_zeroes(offset, len)
    }

    fn pipeline(&self, opts: &QueueOptions) -> Option<Result<Pipeline, BlockError>> {
        let f = &self.files;
        // Read per request: `set_len` may grow the file while its queues run.
        let files = f.clone();
        let bounds =
            Bounds::live(Arc::new(move || files.size()), !f.writable).with_path(f.path.clone());
        let uring = self.aio == AioEngine::IoUring;
        Some(Pipeline::new(opts, bounds, |notifier, capacity| {
            if uring {
                match uring::UringEngine::new(f.clone(), capacity, notifier.clone()) {
                    Ok(engine) => return Ok(Box::new(engine)),
                    Err(e) => {
                        if !URING_NOTICE.swap(true, Ordering::Relaxed) {
                            tracing::warn!(
                                "io_uring is not available ({e}): using the threads aio engine"
                            );
                        }
                    }
                }
            }
            Ok(threads::engine(f.clone(), capacity, notifier))
        }))
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        let size = self.files.size();
        check_range("block_status", offset, 0, size).map_err(|e| e.with_path(&self.files.path))?;
        let len = len.min(size - offset);
        if len == 0 {
            return Ok(Extent {
                len: 0,
                kind: ExtentKind::Data,
            });
        }
        let data = match self.seek(SeekFrom::Data(offset)) {
            Ok(d) => d,
            // Filesystems or devices without hole support: everything is data.
            Err(_) => {
                return Ok(Extent {
                    len,
                    kind: ExtentKind::Data,
                })
            }
        };
        match data {
            None => Ok(Extent {
                len,
                kind: ExtentKind::Unallocated,
            }),
            Some(d) if d > offset => Ok(Extent {
                len: (d - offset).min(len),
                kind: ExtentKind::Unallocated,
            }),
            Some(_) => {
                let hole = match self.seek(SeekFrom::Hole(offset)) {
                    Ok(Some(h)) if h > offset => h,
                    _ => offset + len,
                };
                Ok(Extent {
                    len: (hole - offset).min(len),
                    kind: ExtentKind::Data,
                })
            }
        }
    }
}
