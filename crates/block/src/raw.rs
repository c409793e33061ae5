//! A plain file (or block device node) as a `BlockDevice`: positioned I/O, advisory locking,
//! and hole detection so copies can skip sparse regions.

use crate::device::check_range;
use crate::{BlockDevice, BlockError, BlockErrorKind, Extent, ExtentKind};
use std::fs::{File, TryLockError};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

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

/// A raw image file. The size is fixed at open time; writes never grow the file.
#[derive(Debug)]
pub struct RawFile {
    file: File,
    /// A second descriptor opened with O_DIRECT, used for aligned writes once
    /// `enable_direct_writes` succeeded; everything else goes through `file`.
    direct: Option<File>,
    path: PathBuf,
    size: u64,
    writable: bool,
}

impl RawFile {
    pub fn open(path: impl AsRef<Path>, opts: OpenOptions) -> Result<Self, BlockError> {
        let path = path.as_ref();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(opts.writable)
            .open(path)
            .map_err(|e| BlockError::io("open", e).with_path(path))?;
        if opts.lock {
            lock_file(&file, opts.writable).map_err(|e| e.with_path(path))?;
        }
        let size = file_size(&file).map_err(|e| e.with_path(path))?;
        Ok(RawFile {
            file,
            direct: None,
            path: path.to_path_buf(),
            size,
            writable: opts.writable,
        })
    }

    /// Creates a new sparse file of `size` bytes (refusing to overwrite an existing one) and
    /// opens it writable and locked.
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
            file,
            direct: None,
            path: path.to_path_buf(),
            size,
            writable: true,
        })
    }

    /// Sends aligned writes (see `is_direct_aligned`) around the page cache with O_DIRECT:
    /// for bulk copies that would otherwise pay a second memory copy and stall on writeback of
    /// gigabytes of dirty pages. Other writes, and all reads, stay buffered; `flush` still
    /// syncs, because O_DIRECT alone does not make data or allocations durable. Returns false,
    /// changing nothing, where the filesystem refuses O_DIRECT (e.g. tmpfs).
    pub fn enable_direct_writes(&mut self) -> Result<bool, BlockError> {
        use std::os::unix::fs::OpenOptionsExt;
        if !self.writable {
            return Err(BlockError::read_only("enable direct I/O").with_path(&self.path));
        }
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&self.path)
        {
            Ok(direct) => {
                self.direct = Some(direct);
                Ok(true)
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
            Err(e) => Err(BlockError::io("open O_DIRECT", e).with_path(&self.path)),
        }
    }

    /// The underlying file, for code (such as the LUKS header reader) that works on `&File`.
    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Deallocates `len` bytes at `offset` (they then read as zeros) without changing the size.
    pub fn punch_hole(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        if !self.writable {
            return Err(BlockError::read_only("punch_hole").with_path(&self.path));
        }
        check_range("punch_hole", offset, len, self.size).map_err(|e| e.with_path(&self.path))?;
        if len == 0 {
            return Ok(());
        }
        let (off, l) = match (i64::try_from(offset), i64::try_from(len)) {
            (Ok(o), Ok(l)) => (o, l),
            _ => {
                return Err(BlockError::out_of_range(
                    "punch_hole",
                    offset,
                    len,
                    self.size,
                ))
            }
        };
        // SAFETY: fallocate only reads its integer arguments; the fd is owned by `self.file`
        // and stays open for the duration of the call.
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                l,
            )
        };
        if rc != 0 {
            return Err(
                BlockError::io("punch_hole", std::io::Error::last_os_error())
                    .at(offset)
                    .with_path(&self.path),
            );
        }
        Ok(())
    }

    /// `lseek` with SEEK_DATA / SEEK_HOLE. `Ok(None)` means ENXIO: no such region at or after
    /// `offset` (for SEEK_DATA: the rest of the file is a hole).
    fn seek(&self, offset: u64, whence: libc::c_int) -> std::io::Result<Option<u64>> {
        let off =
            i64::try_from(offset).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: lseek only reads its integer arguments. Moving the shared file position is
        // harmless because every data access in this type uses pread/pwrite, never the position.
        let rc = unsafe { libc::lseek(self.file.as_raw_fd(), off, whence) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENXIO) {
                return Ok(None);
            }
            return Err(err);
        }
        Ok(Some(rc as u64))
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

impl BlockDevice for RawFile {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_only(&self) -> bool {
        !self.writable
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        check_range("read", offset, buf.len() as u64, self.size)
            .map_err(|e| e.with_path(&self.path))?;
        match self.file.read_exact_at(buf, offset) {
            Ok(()) => Ok(()),
            // The file shrank under us (or a device node is shorter than it said): the part
            // past the end reads as zeros rather than failing, as it would in QEMU.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                let mut done = 0usize;
                while done < buf.len() {
                    let n = self
                        .file
                        .read_at(&mut buf[done..], offset + done as u64)
                        .map_err(|e| BlockError::io("read", e).at(offset).with_path(&self.path))?;
                    if n == 0 {
                        buf[done..].fill(0);
                        break;
                    }
                    done += n;
                }
                Ok(())
            }
            Err(e) => Err(BlockError::io("read", e).at(offset).with_path(&self.path)),
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        if !self.writable {
            return Err(BlockError::read_only("write")
                .at(offset)
                .with_path(&self.path));
        }
        check_range("write", offset, buf.len() as u64, self.size)
            .map_err(|e| e.with_path(&self.path))?;
        let fd = match &self.direct {
            Some(direct) if crate::is_direct_aligned(buf, offset) => direct,
            _ => &self.file,
        };
        fd.write_all_at(buf, offset)
            .map_err(|e| BlockError::io("write", e).at(offset).with_path(&self.path))
    }

    fn flush(&self) -> Result<(), BlockError> {
        if !self.writable {
            return Ok(());
        }
        self.file
            .sync_data()
            .map_err(|e| BlockError::io("flush", e).with_path(&self.path))
    }

    /// Punches a hole: the range reads as zeros afterwards.
    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.punch_hole(offset, len)
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        check_range("block_status", offset, 0, self.size).map_err(|e| e.with_path(&self.path))?;
        let len = len.min(self.size - offset);
        if len == 0 {
            return Ok(Extent {
                len: 0,
                kind: ExtentKind::Data,
            });
        }
        let data = match self.seek(offset, libc::SEEK_DATA) {
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
                let hole = match self.seek(offset, libc::SEEK_HOLE) {
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
