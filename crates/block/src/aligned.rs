//! Heap buffers aligned for direct I/O. O_DIRECT transfers DMA straight from user memory,
//! which the kernel only accepts at block-aligned addresses; `Vec<u8>` gives no such promise.
//!
//! Buffers of `MAPPED_FROM` bytes and more are anonymous mappings of their own: zero pages
//! until written, and returned to the kernel when freed. From the C allocator they would sit in
//! the arena of the thread that freed them, and a burst of them spread over many threads'
//! arenas stays resident after it ends (an arena gives memory back only from its top).

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

/// Alignment of buffer addresses, file offsets and lengths for direct I/O. 4096 satisfies
/// every logical block size Linux block devices use.
pub const DIRECT_IO_ALIGN: usize = 4096;
/// Buffers at least this large are mappings of their own.
const MAPPED_FROM: usize = 64 << 10;

/// A fixed-capacity byte buffer whose start is aligned to `DIRECT_IO_ALIGN`. Zero-filled when
/// made; derefs to its whole capacity.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>; moving it to another
// thread moves that ownership, and shared references only allow reads.
unsafe impl Send for AlignedBuf {}
// SAFETY: &AlignedBuf only hands out &[u8]; mutation needs &mut, so no data race is possible.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (rounded up to at least one alignment unit).
    pub fn zeroed(len: usize) -> Self {
        let len = len.max(1);
        if len >= MAPPED_FROM {
            return Self::mapped(len);
        }
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (len >= 1) and a valid power-of-two alignment.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            handle_alloc_error(layout)
        };
        AlignedBuf { ptr, len }
    }

    /// A private anonymous mapping (page-aligned, zero-filled by the kernel).
    fn mapped(len: usize) -> Self {
        // SAFETY: a new anonymous private mapping at an address the kernel picks: no existing
        // memory is touched; the result is checked below.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        match NonNull::new(raw.cast::<u8>()).filter(|_| raw != libc::MAP_FAILED) {
            Some(ptr) => AlignedBuf { ptr, len },
            None => handle_alloc_error(Self::layout(len)),
        }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, DIRECT_IO_ALIGN).expect("buffer size overflows a Layout")
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The first byte, for code that reaches the buffer through raw addresses.
    pub(crate) fn base(&self) -> NonNull<u8> {
        self.ptr
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len >= MAPPED_FROM {
            // SAFETY: ptr and len are the mapping made in `mapped`, unmapped once, here; no
            // reference into it outlives self.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
            return;
        }
        // SAFETY: ptr was returned by the global allocator for exactly this layout and is
        // freed once, here.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed at allocation) bytes for as long as
        // self lives, and &self prevents concurrent mutation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// True when a transfer of `len` bytes at file `offset` from/to `buf` meets direct I/O's
/// alignment rules.
pub fn is_direct_aligned(buf: &[u8], offset: u64) -> bool {
    let a = DIRECT_IO_ALIGN;
    (buf.as_ptr() as usize).is_multiple_of(a)
        && buf.len().is_multiple_of(a)
        && offset.is_multiple_of(a as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_writable() {
        for len in [
            1,
            512,
            4096,
            MAPPED_FROM - 1,
            MAPPED_FROM,
            1 << 20,
            (1 << 20) + 3,
        ] {
            let mut b = AlignedBuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % DIRECT_IO_ALIGN, 0);
            assert!(b.iter().all(|&x| x == 0));
            b[len - 1] = 7;
            assert_eq!(b[len - 1], 7);
        }
    }

    #[test]
    fn alignment_check() {
        let b = AlignedBuf::zeroed(8192);
        assert!(is_direct_aligned(&b, 4096));
        assert!(!is_direct_aligned(&b[..4000], 0));
        assert!(!is_direct_aligned(&b[512..4608], 0));
        assert!(!is_direct_aligned(&b, 512));
    }
}
