//! The open descriptors of a raw file and their synchronous I/O, shared by `RawFile` and its
//! engines.

use super::direct::{DioAlign, Route};
use crate::aio::IoVec;
use crate::error::check_range;
use crate::{BlockError, CacheMode};
use rustix::fs::FallocateFlags;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// The open descriptors, shared with the asynchronous queues of the file.
#[derive(Debug)]
pub(crate) struct Files {
    /// Buffered descriptor: headers, unaligned requests, everything when not direct.
    pub(super) buffered: File,
    /// O_DIRECT descriptor (cache modes `none`, `directsync`).
    pub(super) direct: Option<File>,
    pub(super) dio: DioAlign,
    pub(super) path: PathBuf,
    /// The file's length: read by every request's range check, changed only by `set_len`
    /// (an online resize), after the file itself has its new length.
    pub(super) size: AtomicU64,
    pub(super) writable: bool,
    pub(super) cache: CacheMode,
}

impl Files {
    pub(crate) fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    pub(super) fn route(&self, addr: usize, len: usize, offset: u64) -> Route {
        match &self.direct {
            Some(_) => self.dio.route(addr, len, offset),
            None => Route::Buffered,
        }
    }

    pub(super) fn fd_for(&self, route: Route) -> &File {
        match (route, &self.direct) {
            (Route::Direct | Route::Bounce, Some(direct)) => direct,
            _ => &self.buffered,
        }
    }

    pub(super) fn err(&self, op: &'static str, e: std::io::Error, offset: u64) -> BlockError {
        BlockError::io(op, e).at(offset).with_path(&self.path)
    }
}

impl Files {
    /// The route of a scatter-gather transfer at `offset`.
    pub(super) fn route_iov(&self, iov: &[IoVec], offset: u64) -> Route {
        match &self.direct {
            Some(_) => self.dio.route_iov(iov, offset),
            None => Route::Buffered,
        }
    }
}

/// The synchronous I/O of a raw file, shared by `RawFile` and the threads engine.
impl Files {
    pub(crate) fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        let f = self;
        check_range("read", offset, buf.len() as u64, f.size())
            .map_err(|e| e.with_path(&f.path))?;
        let route = f.route(buf.as_ptr() as usize, buf.len(), offset);
        let fd = f.fd_for(route);
        let result = if route == Route::Bounce {
            let mut bounce = crate::buffers::take(buf.len());
            let bounce = &mut bounce[..buf.len()];
            read_full(fd, bounce, offset).map(|()| buf.copy_from_slice(bounce))
        } else {
            read_full(fd, buf, offset)
        };
        result.map_err(|e| f.err("read", e, offset))
    }

    pub(crate) fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        let f = self;
        if !f.writable {
            return Err(BlockError::read_only("write").at(offset).with_path(&f.path));
        }
        check_range("write", offset, buf.len() as u64, f.size())
            .map_err(|e| e.with_path(&f.path))?;
        let route = f.route(buf.as_ptr() as usize, buf.len(), offset);
        let fd = f.fd_for(route);
        let result = if route == Route::Bounce {
            let mut bounce = crate::buffers::take(buf.len());
            let bounce = &mut bounce[..buf.len()];
            bounce.copy_from_slice(buf);
            fd.write_all_at(bounce, offset)
        } else {
            fd.write_all_at(buf, offset)
        };
        result.map_err(|e| f.err("write", e, offset))
    }

    pub(crate) fn flush(&self) -> Result<(), BlockError> {
        let f = self;
        if !f.writable || f.cache.ignore_flush() {
            return Ok(());
        }
        f.buffered
            .sync_data()
            .map_err(|e| BlockError::io("flush", e).with_path(&f.path))
    }

    pub(crate) fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        let f = self;
        if !f.writable {
            return Err(BlockError::read_only("write zeroes")
                .at(offset)
                .with_path(&f.path));
        }
        check_range("write zeroes", offset, len, f.size()).map_err(|e| e.with_path(&f.path))?;
        match fallocate(
            &f.buffered,
            FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE,
            offset,
            len,
        ) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                static ZEROES: [u8; 256 * 1024] = [0; 256 * 1024];
                let mut done = 0u64;
                while done < len {
                    let n = (len - done).min(ZEROES.len() as u64) as usize;
                    self.write_at(&ZEROES[..n], offset + done)?;
                    done += n as u64;
                }
                Ok(())
            }
            Err(e) => Err(f.err("write zeroes", e, offset)),
        }
    }

    pub(crate) fn punch_hole(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        if !self.writable {
            return Err(BlockError::read_only("punch_hole").with_path(&self.path));
        }
        check_range("punch_hole", offset, len, self.size()).map_err(|e| e.with_path(&self.path))?;
        if len == 0 {
            return Ok(());
        }
        fallocate(
            &self.buffered,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            offset,
            len,
        )
        .map_err(|e| self.err("punch_hole", e, offset))
    }
}

/// `fallocate(2)` with `mode` over `len` bytes at `offset`.
fn fallocate(file: &File, mode: FallocateFlags, offset: u64, len: u64) -> std::io::Result<()> {
    // The kernel takes signed offsets: larger ones are invalid, not wrapped.
    if i64::try_from(offset).is_err() || i64::try_from(len).is_err() {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    Ok(rustix::fs::fallocate(file, mode, offset, len)?)
}

/// Reads all of `buf` at `offset`; the part past the end of the file reads as zeros (the file
/// shrank under us, or a device node is shorter than it said), as it would in QEMU.
fn read_full(fd: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        match fd.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
