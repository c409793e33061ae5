//! Direct-I/O alignment: what O_DIRECT on this file accepts, and how a request is routed.

use crate::DIRECT_IO_ALIGN;
use rustix::fs::{statx, AtFlags, StatxFlags};
use std::fs::File;

/// The alignment O_DIRECT needs on one file (statx `STATX_DIOALIGN`): buffer addresses to
/// `mem` bytes, file offsets and lengths (of every segment) to `offset` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DioAlign {
    pub mem: usize,
    pub offset: usize,
}

impl Default for DioAlign {
    /// The safe guess where the kernel does not tell (before Linux 6.1).
    fn default() -> Self {
        DioAlign {
            mem: DIRECT_IO_ALIGN,
            offset: DIRECT_IO_ALIGN,
        }
    }
}

/// Where one transfer goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Straight between the caller's memory and the device.
    Direct,
    /// Through an aligned bounce buffer, then O_DIRECT: the memory is misaligned.
    Bounce,
    /// Through the page cache: the offset or length is misaligned (or the file is not direct).
    Buffered,
}

impl DioAlign {
    /// The alignment of a file opened with O_DIRECT; `None` when the file does not support
    /// direct I/O after all, or wants an alignment our bounce buffers cannot give.
    pub(crate) fn probe(file: &File) -> Option<DioAlign> {
        // An empty path with AT_EMPTY_PATH: the open descriptor itself.
        let stx = match statx(file, c"", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN) {
            Ok(stx)
                if StatxFlags::from_bits_retain(stx.stx_mask).contains(StatxFlags::DIOALIGN) =>
            {
                stx
            }
            _ => return Some(DioAlign::default()),
        };
        let (mem, offset) = (
            stx.stx_dio_mem_align as usize,
            stx.stx_dio_offset_align as usize,
        );
        if offset == 0 || !offset.is_power_of_two() || !mem.is_power_of_two() {
            // The filesystem said "no direct I/O here" (regular files on some filesystems).
            return None;
        }
        if mem > DIRECT_IO_ALIGN {
            return None;
        }
        Some(DioAlign { mem, offset })
    }

    /// How a transfer of `len` bytes at file `offset` from/to memory at `addr` goes.
    pub(crate) fn route(&self, addr: usize, len: usize, offset: u64) -> Route {
        if !offset.is_multiple_of(self.offset as u64) || !len.is_multiple_of(self.offset) {
            Route::Buffered
        } else if !addr.is_multiple_of(self.mem) {
            Route::Bounce
        } else {
            Route::Direct
        }
    }

    /// The route of a scatter-gather transfer: direct only if every segment is.
    pub(crate) fn route_iov(&self, iov: &[crate::aio::IoVec], offset: u64) -> Route {
        let mut route = Route::Direct;
        if !offset.is_multiple_of(self.offset as u64) {
            return Route::Buffered;
        }
        for v in iov {
            match self.route(v.base() as usize, v.len(), 0) {
                Route::Direct => {}
                // A segment of odd length cannot go direct, but a bounce buffer holding the
                // whole (aligned) transfer can.
                Route::Buffered | Route::Bounce => route = Route::Bounce,
            }
        }
        let total = crate::aio::iov_len(iov);
        if !total.is_multiple_of(self.offset as u64) {
            return Route::Buffered;
        }
        route
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_by_alignment() {
        let a = DioAlign {
            mem: 512,
            offset: 4096,
        };
        assert_eq!(a.route(4096, 8192, 4096), Route::Direct);
        assert_eq!(a.route(512, 4096, 0), Route::Direct);
        assert_eq!(a.route(100, 4096, 0), Route::Bounce);
        assert_eq!(a.route(4096, 512, 0), Route::Buffered);
        assert_eq!(a.route(4096, 4096, 512), Route::Buffered);
        let mut buf = crate::AlignedBuf::zeroed(16384);
        let base = buf.as_mut_ptr();
        let iov = |parts: &[(usize, usize)]| -> Vec<crate::aio::IoVec> {
            parts
                .iter()
                // SAFETY-free: only addresses are computed, nothing is dereferenced.
                .map(|&(at, len)| crate::aio::IoVec::from_raw(base.wrapping_add(at), len))
                .collect()
        };
        assert_eq!(
            a.route_iov(&iov(&[(0, 4096), (8192, 4096)]), 0),
            Route::Direct
        );
        // Two 2 KiB halves: each too short for direct, together a whole block.
        assert_eq!(
            a.route_iov(&iov(&[(0, 2048), (8192, 2048)]), 0),
            Route::Bounce
        );
        assert_eq!(a.route_iov(&iov(&[(1, 4096)]), 0), Route::Bounce);
        assert_eq!(a.route_iov(&iov(&[(0, 2048)]), 0), Route::Buffered);
        assert_eq!(a.route_iov(&iov(&[(0, 4096)]), 512), Route::Buffered);
    }
}
