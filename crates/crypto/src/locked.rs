//! Pages of their own for key material: locked in RAM (`mlock`: never written to swap) and
//! left out of core dumps (`MADV_DONTDUMP`), wiped before they are unmapped.
//!
//! A key gets whole pages, not a piece of the heap: both calls act on pages, so locking a
//! heap allocation would pin (and exclude from dumps) whatever shares its page, and its
//! `munlock` would unlock a page another key still relies on. Keys are few (one volume key
//! per disk, a keyslot key while unlocking) and small, so a page each is cheap.
//!
//! `MADV_DONTDUMP` costs nothing and always applies. `mlock` counts against
//! `RLIMIT_MEMLOCK` (8 MiB by default, 2048 keys); when the limit (or a missing
//! `CAP_IPC_LOCK`) refuses it, the key still works, unlocked, and one warning says so.
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

static WARNED: AtomicBool = AtomicBool::new(false);

/// `len` bytes in private, page-aligned anonymous memory, zeroed at first.
pub struct LockedBytes {
    ptr: NonNull<u8>,
    len: usize,
    map_len: usize,
    locked: bool,
}

// SAFETY: the mapping is owned by this value alone; `&LockedBytes` only reads it.
unsafe impl Send for LockedBytes {}
// SAFETY: as above: shared references only read.
unsafe impl Sync for LockedBytes {}

impl LockedBytes {
    /// Maps zeroed pages for `len` bytes (at least one page), excludes them from core dumps
    /// and tries to lock them. Panics only if the kernel has no memory to map, as an
    /// allocation would abort.
    pub fn zeroed(len: usize) -> LockedBytes {
        let page = rustix::param::page_size();
        let map_len = len.max(1).div_ceil(page) * page;
        // SAFETY: a new private anonymous mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            panic!(
                "mapping {map_len} bytes for key material: {}",
                std::io::Error::last_os_error()
            );
        }
        // SAFETY: the mapping made above, whole. A kernel without MADV_DONTDUMP (before 3.4)
        // refuses it; the key is still usable, only dumps are not kept from it.
        unsafe { libc::madvise(ptr, map_len, libc::MADV_DONTDUMP) };
        // SAFETY: the mapping made above, whole.
        let locked = unsafe { libc::mlock(ptr, map_len) } == 0;
        if !locked && !WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "key material could not be locked in memory ({}): it may be written to swap; \
                 raise RLIMIT_MEMLOCK (LimitMEMLOCK= in the systemd unit) to lock it",
                std::io::Error::last_os_error()
            );
        }
        LockedBytes {
            ptr: NonNull::new(ptr.cast()).expect("mmap returned a non-null address"),
            len,
            map_len,
            locked,
        }
    }

    /// A locked copy of `bytes`.
    pub fn copy_of(bytes: &[u8]) -> LockedBytes {
        let mut locked = LockedBytes::zeroed(bytes.len());
        locked.as_mut_slice().copy_from_slice(bytes);
        locked
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes of the mapping this value owns, initialised (zeroed at map time).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Whether `mlock` accepted the pages (the limit may refuse it).
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// The start of the pages (for tests that look the mapping up in /proc/self/smaps).
    pub fn address(&self) -> usize {
        self.ptr.as_ptr() as usize
    }
}

impl Drop for LockedBytes {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(self.as_mut_slice());
        // SAFETY: the mapping this value made, whole, and no longer referenced. munmap also
        // drops the lock.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

#[cfg(test)]
mod tests;
