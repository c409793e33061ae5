//! The librados/librbd calls this crate makes, each one safe method of the handle it acts on,
//! so that `image.rs` and `aio.rs` hold no C call of their own.
//!
//! Every call below rests on the same facts, argued here once rather than at each call:
//! - **A handle is live for as long as its wrapper.** It is made by a call that succeeded and
//!   destroyed once, by the wrapper's `Drop`. Each handle owns the one it was made from (an
//!   image its pool, a pool its cluster), so a parent is destroyed after its children: a
//!   `Drop` runs before the fields it owns are dropped.
//! - **Memory is Rust's.** Strings go in as `&CStr` (NUL-terminated, alive for the call),
//!   buffers as slices whose length is the length passed, out-values as references to locals.
//!   The asynchronous reads and writes, whose memory librbd uses after the call returns, are
//!   the exception: they are `unsafe fn`s whose callers keep that memory alive.
//! - **The prototypes are librados.h's and librbd.h's** (`ffi::Api`, whose libraries stay
//!   loaded for the life of the process).
//!
//! Failures come back as `Err(errno)`, the positive errno of librbd's negative return.

use crate::ffi::{AioCallback, AioCompletion, Api};
use cryptblk_block::aio::IoVec;
use libc::{c_char, c_int, c_void, size_t};
use std::ffi::CStr;
use std::ptr;

/// A positive errno from librados or librbd.
pub type Errno = i32;

/// An opaque librados or librbd handle (`rados_t`, `rados_ioctx_t`, `rbd_image_t`).
struct Raw(*mut c_void);

// SAFETY: librados and librbd handles may be used from any thread, and from several at once:
// the libraries lock inside (QEMU and fio call one image from many threads). A handle is only
// ever destroyed by its owner's `Drop`, which has it exclusively.
unsafe impl Send for Raw {}
// SAFETY: as above.
unsafe impl Sync for Raw {}

fn status(rc: c_int) -> Result<(), Errno> {
    if rc < 0 {
        Err(-rc)
    } else {
        Ok(())
    }
}

/// A byte count, or the failure.
fn length(rc: isize) -> Result<usize, Errno> {
    if rc < 0 {
        Err(-(rc as c_int))
    } else {
        Ok(rc as usize)
    }
}

fn or_null(s: Option<&CStr>) -> *const c_char {
    s.map_or(ptr::null(), CStr::as_ptr)
}

/// Reads a string librados wrote into `buf`, up to its NUL.
fn c_string(buf: &[u8]) -> Result<String, Errno> {
    CStr::from_bytes_until_nul(buf)
        .map(|s| s.to_string_lossy().into_owned())
        .map_err(|_| libc::ERANGE)
}

/// An image's calls that pass the handle and plain integers only (no pointer librbd could
/// follow): sound whenever the handle is live, which the wrapper guarantees (module doc);
/// librbd checks the numbers itself.
macro_rules! image_calls {
    ($(
        $(#[$doc:meta])*
        fn $method:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $map:ident($c:ident);
    )*) => {
        impl ImageHandle {
            $(
                $(#[$doc])*
                pub fn $method(&self, $($arg: $ty),*) -> $ret {
                    // SAFETY: a live handle and integers (the macro's doc).
                    $map(unsafe { (self.api.$c)(self.raw.0, $($arg),*) })
                }
            )*
        }
    };
}

/// A librados cluster handle (`rados_t`), shut down on drop.
pub struct Cluster {
    api: &'static Api,
    raw: Raw,
}

impl Cluster {
    /// A handle for user `id` (librados' default user without), not yet connected.
    pub fn create(api: &'static Api, id: Option<&CStr>) -> Result<Cluster, Errno> {
        let mut raw = ptr::null_mut();
        // SAFETY: an out-pointer to a local and a C string or null (module doc).
        status(unsafe { (api.rados_create)(&mut raw, or_null(id)) })?;
        Ok(Cluster { api, raw: Raw(raw) })
    }

    /// Reads the ceph.conf at `path`, or librados' default search without.
    pub fn read_conf_file(&self, path: Option<&CStr>) -> Result<(), Errno> {
        // SAFETY: a live handle and a C string or null (module doc).
        status(unsafe { (self.api.rados_conf_read_file)(self.raw.0, or_null(path)) })
    }

    pub fn set_conf(&self, option: &CStr, value: &CStr) -> Result<(), Errno> {
        // SAFETY: a live handle and two C strings (module doc).
        status(unsafe { (self.api.rados_conf_set)(self.raw.0, option.as_ptr(), value.as_ptr()) })
    }

    /// Connects a configured handle (bounded by `client_mount_timeout`).
    pub fn connect(&self) -> Result<(), Errno> {
        // SAFETY: a live handle (module doc).
        status(unsafe { (self.api.rados_connect)(self.raw.0) })
    }

    /// The cluster's fsid.
    pub fn fsid(&self) -> Result<String, Errno> {
        let mut buf = [0u8; 64];
        // SAFETY: a live handle and a buffer of the length passed (module doc).
        status(unsafe {
            (self.api.rados_cluster_fsid)(self.raw.0, buf.as_mut_ptr().cast(), buf.len())
        })?;
        c_string(&buf)
    }

    /// Opens the pool named `name`; the pool keeps the cluster (dropped with it on failure).
    pub fn open_pool(self, name: &CStr) -> Result<Pool, Errno> {
        let mut raw = ptr::null_mut();
        // SAFETY: a live handle, a C string and an out-pointer to a local (module doc).
        status(unsafe { (self.api.rados_ioctx_create)(self.raw.0, name.as_ptr(), &mut raw) })?;
        Ok(Pool {
            api: self.api,
            raw: Raw(raw),
            cluster: self,
        })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: the live handle, destroyed once, after every pool made from it (module doc).
        unsafe { (self.api.rados_shutdown)(self.raw.0) }
    }
}

/// A pool context (`rados_ioctx_t`) and the cluster it was opened on, destroyed in that order.
pub struct Pool {
    api: &'static Api,
    raw: Raw,
    cluster: Cluster,
}

impl Pool {
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// The pool's id, the same in every client of the cluster.
    pub fn id(&self) -> i64 {
        // SAFETY: a live handle (module doc).
        unsafe { (self.api.rados_ioctx_get_id)(self.raw.0) }
    }

    /// Creates image `name` of `size` bytes with librbd's default order and features.
    pub fn create_image(&self, name: &CStr, size: u64) -> Result<(), Errno> {
        let mut order: c_int = 0;
        // SAFETY: a live handle, a C string and an out-value; order 0 = the default.
        status(unsafe { (self.api.rbd_create)(self.raw.0, name.as_ptr(), size, &mut order) })
    }

    pub fn remove_image(&self, name: &CStr) -> Result<(), Errno> {
        // SAFETY: a live handle and a C string (module doc).
        status(unsafe { (self.api.rbd_remove)(self.raw.0, name.as_ptr()) })
    }

    /// Opens image `name` (at `snapshot`, if given); the image keeps the pool (dropped with
    /// it on failure).
    pub fn open_image(
        self,
        name: &CStr,
        snapshot: Option<&CStr>,
        read_only: bool,
    ) -> Result<ImageHandle, Errno> {
        let open = if read_only {
            self.api.rbd_open_read_only
        } else {
            self.api.rbd_open
        };
        let mut raw = ptr::null_mut();
        // SAFETY: a live handle, C strings or null and an out-pointer to a local (module doc).
        status(unsafe { open(self.raw.0, name.as_ptr(), &mut raw, or_null(snapshot)) })?;
        Ok(ImageHandle {
            api: self.api,
            raw: Raw(raw),
            pool: self,
        })
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: the live handle, destroyed once, after every image opened on it and before
        // its cluster (module doc).
        unsafe { (self.api.rados_ioctx_destroy)(self.raw.0) }
    }
}

/// An open image (`rbd_image_t`) and the pool it was opened in; closing releases its lock.
pub struct ImageHandle {
    api: &'static Api,
    raw: Raw,
    pool: Pool,
}

image_calls! {
    fn resize(size: u64) -> Result<(), Errno> = status(rbd_resize);
    fn lock_acquire(mode: c_int) -> Result<(), Errno> = status(rbd_lock_acquire);
    /// Lets go of the exclusive lock, after flushing what librbd still holds.
    fn lock_release() -> Result<(), Errno> = status(rbd_lock_release);
    fn flush() -> Result<(), Errno> = status(rbd_flush);
    fn discard(offset: u64, len: u64) -> Result<(), Errno> = status(rbd_discard);
    /// Zeroes `len` bytes at `offset`; the bytes done.
    fn write_zeroes(offset: u64, len: size_t, zero_flags: c_int, op_flags: c_int)
        -> Result<usize, Errno> = length(rbd_write_zeroes);
}

impl ImageHandle {
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn size(&self) -> Result<u64, Errno> {
        let mut size = 0u64;
        // SAFETY: a live handle and an out-value (module doc).
        status(unsafe { (self.api.rbd_get_size)(self.raw.0, &mut size) })?;
        Ok(size)
    }

    /// The image's id, which unlike its name a rename does not change.
    pub fn id(&self) -> Result<String, Errno> {
        let mut buf = [0u8; 128];
        // SAFETY: a live handle and a buffer of the length passed (module doc).
        status(unsafe { (self.api.rbd_get_id)(self.raw.0, buf.as_mut_ptr().cast(), buf.len()) })?;
        c_string(&buf)
    }

    /// Who holds the exclusive lock (up to 8 owners; more is `ERANGE`), empty when no one does.
    pub fn lock_owners(&self) -> Result<Vec<String>, Errno> {
        let mut mode: c_int = 0;
        let mut owners: [*mut c_char; 8] = [ptr::null_mut(); 8];
        let mut count: size_t = owners.len();
        // SAFETY: a live handle, out-values, and room for `count` pointers, which librbd fills
        // with strings that `rbd_lock_get_owners_cleanup` frees.
        status(unsafe {
            (self.api.rbd_lock_get_owners)(self.raw.0, &mut mode, owners.as_mut_ptr(), &mut count)
        })?;
        let names = owners[..count]
            .iter()
            // SAFETY: librbd set the first `count` entries to NUL-terminated strings.
            .map(|&p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .collect();
        if count > 0 {
            // SAFETY: frees exactly what rbd_lock_get_owners returned, once.
            unsafe { (self.api.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), count) };
        }
        Ok(names)
    }

    /// Reads into `buf` at `offset`; the bytes read.
    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize, Errno> {
        // SAFETY: a live handle and a buffer of the length passed (module doc).
        length(unsafe {
            (self.api.rbd_read)(self.raw.0, offset, buf.len(), buf.as_mut_ptr().cast())
        })
    }

    /// Writes `buf` at `offset`; the bytes written.
    pub fn write(&self, buf: &[u8], offset: u64) -> Result<usize, Errno> {
        // SAFETY: a live handle and a buffer of the length passed (module doc).
        length(unsafe { (self.api.rbd_write)(self.raw.0, offset, buf.len(), buf.as_ptr().cast()) })
    }

    /// Calls `extent(offset, len, exists)` for each extent of `offset..offset + len`
    /// (against no snapshot, that is the allocation; byte-exact, not whole objects), on this
    /// thread, before returning.
    pub fn diff(
        &self,
        offset: u64,
        len: u64,
        mut extent: impl FnMut(u64, u64, bool),
    ) -> Result<(), Errno> {
        extern "C" fn trampoline(off: u64, len: size_t, exists: c_int, arg: *mut c_void) -> c_int {
            // SAFETY: `arg` is the `&mut dyn FnMut` passed below, alive for the call, and
            // librbd calls back on the calling thread during rbd_diff_iterate2.
            let extent = unsafe { &mut *arg.cast::<&mut dyn FnMut(u64, u64, bool)>() };
            extent(off, len as u64, exists != 0);
            0
        }
        let mut extent: &mut dyn FnMut(u64, u64, bool) = &mut extent;
        // SAFETY: a live handle; no from-snapshot (null); the callback argument is a local
        // that outlives the call (module doc, and the trampoline's argument).
        status(unsafe {
            (self.api.rbd_diff_iterate2)(
                self.raw.0,
                ptr::null(),
                offset,
                len,
                1,
                0,
                trampoline,
                (&mut extent as *mut &mut dyn FnMut(u64, u64, bool)).cast(),
            )
        })
    }

    /// Starts reading at `offset` into the memory `iov` describes; `completion`'s callback
    /// runs when it is done. On `Err` librbd refused the request and the callback will not run.
    ///
    /// # Safety
    /// The memory `iov` points to (writable) and the `iov` list itself stay valid until the
    /// callback has run.
    pub unsafe fn start_readv(
        &self,
        iov: &[IoVec],
        offset: u64,
        completion: Completion,
    ) -> Result<(), Errno> {
        let (api, raw) = (self.api, completion.0);
        // SAFETY: a live handle; `IoVec` is a transparent `iovec`; the memory is the caller's
        // to keep alive (above); the completion is handed over (`submitted`).
        completion.submitted(unsafe {
            (api.rbd_aio_readv)(
                self.raw.0,
                iov.as_ptr().cast(),
                iov.len() as c_int,
                offset,
                raw,
            )
        })
    }

    /// Starts writing the memory `iov` describes at `offset`; as [`start_readv`](Self::start_readv).
    ///
    /// # Safety
    /// The memory `iov` points to and the `iov` list itself stay valid until the callback has
    /// run.
    pub unsafe fn start_writev(
        &self,
        iov: &[IoVec],
        offset: u64,
        completion: Completion,
    ) -> Result<(), Errno> {
        let (api, raw) = (self.api, completion.0);
        // SAFETY: as in `start_readv`.
        completion.submitted(unsafe {
            (api.rbd_aio_writev)(
                self.raw.0,
                iov.as_ptr().cast(),
                iov.len() as c_int,
                offset,
                raw,
            )
        })
    }

    /// Starts a flush; as [`start_readv`](Self::start_readv), without memory.
    pub fn start_flush(&self, completion: Completion) -> Result<(), Errno> {
        let raw = completion.0;
        // SAFETY: a live handle and a completion handed over (`submitted`).
        completion.submitted(unsafe { (self.api.rbd_aio_flush)(self.raw.0, raw) })
    }

    pub fn start_discard(
        &self,
        offset: u64,
        len: u64,
        completion: Completion,
    ) -> Result<(), Errno> {
        let raw = completion.0;
        // SAFETY: a live handle, integers and a completion handed over (`submitted`).
        completion.submitted(unsafe { (self.api.rbd_aio_discard)(self.raw.0, offset, len, raw) })
    }

    /// Starts zeroing (no zero or op flags).
    pub fn start_write_zeroes(
        &self,
        offset: u64,
        len: size_t,
        completion: Completion,
    ) -> Result<(), Errno> {
        let raw = completion.0;
        // SAFETY: a live handle, integers and a completion handed over (`submitted`).
        completion.submitted(unsafe {
            (self.api.rbd_aio_write_zeroes)(self.raw.0, offset, len, raw, 0, 0)
        })
    }
}

impl Drop for ImageHandle {
    fn drop(&mut self) {
        // SAFETY: the live handle, closed once, before its pool (module doc).
        unsafe { (self.api.rbd_close)(self.raw.0) };
    }
}

/// A completion (`rbd_completion_t`) not yet handed to librbd; released on drop. Once a
/// request took it, the request's callback owns it ([`finish`]).
pub struct Completion(AioCompletion, &'static Api);

impl Completion {
    /// A completion that calls `callback(completion, arg)` on a librbd thread once the request
    /// it is given to is done. `callback` is what dereferences `arg`.
    pub fn new(api: &'static Api, callback: AioCallback, arg: *mut c_void) -> Result<Self, Errno> {
        let mut raw = ptr::null_mut();
        // SAFETY: an out-pointer to a local; librbd only stores `arg` and hands it to
        // `callback`, a safe `extern "C" fn` of the `rbd_callback_t` prototype.
        status(unsafe { (api.rbd_aio_create_completion)(arg, callback, &mut raw) })?;
        Ok(Completion(raw, api))
    }

    /// After a start call returned `rc`: on success the completion is librbd's (its callback
    /// releases it), on a refusal it is released here.
    fn submitted(self, rc: c_int) -> Result<(), Errno> {
        if rc >= 0 {
            std::mem::forget(self);
        }
        status(rc)
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        // SAFETY: a completion no request took, released once.
        unsafe { (self.1.rbd_aio_release)(self.0) }
    }
}

/// In a completion's callback: the request's return value (a byte count, or a negative
/// errno); releases the completion.
///
/// # Safety
/// `completion` is the one librbd passed to the callback, and this is called once for it.
pub unsafe fn finish(api: &'static Api, completion: AioCompletion) -> isize {
    // SAFETY: the caller's: librbd's finished completion, released once, after its value is
    // read.
    unsafe {
        let ret = (api.rbd_aio_get_return_value)(completion);
        (api.rbd_aio_release)(completion);
        ret
    }
}
