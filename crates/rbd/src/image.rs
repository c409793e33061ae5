//! A connected, opened RBD image: cluster handle, pool context and image handle, closed in
//! reverse order on drop.

use crate::ffi::{self, Api, IoCtx, Rados, RbdImage};
use crate::{RbdError, RbdSpec, CLUSTER_TIMEOUT_SECS};
use libc::{c_char, c_int, c_void, size_t};
use std::ffi::{CStr, CString};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};

/// Whether the image is opened for writing (taking its exclusive lock) or read-only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    ReadWrite,
    ReadOnly,
    /// Writable, but the exclusive lock is left to its current owner until
    /// [`Image::acquire_lock`]: the destination of a hand-off between two daemons, which must
    /// not write before the source let go.
    ReadWriteUnlocked,
}

/// One allocated run of the image, as librbd's diff iteration reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    pub offset: u64,
    pub len: u64,
}

/// The cluster connection and pool context, shared by opening and creating.
struct Pool {
    api: &'static Api,
    rados: Rados,
    ioctx: IoCtx,
}

impl Pool {
    fn connect(spec: &RbdSpec) -> Result<Pool, RbdError> {
        let api = ffi::api()?;
        let name = spec.display_name();
        let call = |op, rc: c_int| {
            if rc < 0 {
                Err(RbdError::Call {
                    op,
                    image: name.clone(),
                    errno: -rc,
                })
            } else {
                Ok(())
            }
        };
        let id = spec.id.as_deref().map(cstring).transpose()?;
        let mut rados: Rados = ptr::null_mut();
        // SAFETY: `rados` is a valid out-pointer; a null id means librados' default user.
        call("connect to the cluster of", unsafe {
            (api.rados_create)(&mut rados, id.as_ref().map_or(ptr::null(), |s| s.as_ptr()))
        })?;
        let mut pool = Pool {
            api,
            rados,
            ioctx: ptr::null_mut(),
        };
        let conf = spec.conf.as_ref().map(|p| path_cstring(p)).transpose()?;
        // SAFETY: `rados` is the handle just created; a null path means the default search.
        call("read the ceph.conf for", unsafe {
            (api.rados_conf_read_file)(rados, conf.as_ref().map_or(ptr::null(), |s| s.as_ptr()))
        })?;
        let timeout = CString::new(CLUSTER_TIMEOUT_SECS.to_string()).expect("digits");
        let mut options = vec![
            (c"client_mount_timeout", timeout.clone()),
            (c"rados_mon_op_timeout", timeout.clone()),
            (c"rados_osd_op_timeout", timeout),
        ];
        if let Some(keyring) = &spec.keyring {
            options.push((c"keyring", path_cstring(keyring)?));
        }
        for (option, value) in &options {
            // SAFETY: both strings are NUL-terminated and outlive the call.
            call("configure the client of", unsafe {
                (api.rados_conf_set)(rados, option.as_ptr(), value.as_ptr())
            })?;
        }
        // SAFETY: a configured handle; connecting is bounded by client_mount_timeout.
        call("connect to the cluster of", unsafe {
            (api.rados_connect)(rados)
        })?;
        let pool_name = cstring(&spec.pool)?;
        // SAFETY: a connected handle, a NUL-terminated pool name and a valid out-pointer.
        call("open the pool of", unsafe {
            (api.rados_ioctx_create)(rados, pool_name.as_ptr(), &mut pool.ioctx)
        })?;
        Ok(pool)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: the handles were created by this Pool and are destroyed once, context first.
        unsafe {
            if !self.ioctx.is_null() {
                (self.api.rados_ioctx_destroy)(self.ioctx);
            }
            (self.api.rados_shutdown)(self.rados);
        }
    }
}

/// An open RBD image.
pub struct Image {
    api: &'static Api,
    handle: RbdImage,
    name: String,
    // Changes only through `resize` (formatting a new image to its size).
    size: AtomicU64,
    read_only: bool,
    // Dropped after `handle` is closed (see Drop).
    pool: Pool,
}

// SAFETY: librbd image handles are thread-safe: the C API may be called on one handle from
// many threads at once (QEMU and fio do).
unsafe impl Send for Image {}
// SAFETY: as above.
unsafe impl Sync for Image {}
// SAFETY: librados handles may be used and destroyed from any thread.
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

impl Image {
    /// Opens the image; `ReadWrite` also takes its exclusive lock, failing with
    /// [`RbdError::Locked`] naming the owner when another client holds it. A snapshot is
    /// always opened read-only.
    pub fn open(spec: &RbdSpec, mode: OpenMode) -> Result<Image, RbdError> {
        let pool = Pool::connect(spec)?;
        let api = pool.api;
        let name = spec.display_name();
        let read_only = mode == OpenMode::ReadOnly || spec.snapshot.is_some();
        let image_name = cstring(&spec.image)?;
        let snap = spec.snapshot.as_deref().map(cstring).transpose()?;
        let open = if read_only {
            api.rbd_open_read_only
        } else {
            api.rbd_open
        };
        let mut handle: RbdImage = ptr::null_mut();
        // SAFETY: a live pool context, NUL-terminated names and a valid out-pointer.
        let rc = unsafe {
            open(
                pool.ioctx,
                image_name.as_ptr(),
                &mut handle,
                snap.as_ref().map_or(ptr::null(), |s| s.as_ptr()),
            )
        };
        if rc < 0 {
            return Err(RbdError::Call {
                op: "open",
                image: name,
                errno: -rc,
            });
        }
        let mut image = Image {
            api,
            handle,
            name,
            size: AtomicU64::new(0),
            read_only,
            pool,
        };
        if mode == OpenMode::ReadWrite && !read_only {
            image.acquire_lock()?;
        }
        let mut size = 0u64;
        // SAFETY: an open image and a valid out-pointer.
        image.check("get the size of", unsafe {
            (api.rbd_get_size)(image.handle, &mut size)
        })?;
        image.size = AtomicU64::new(size);
        Ok(image)
    }

    /// Creates a new image of `size` bytes with librbd's default features (format 2 with
    /// exclusive-lock); an existing image is an error (EEXIST), nothing is overwritten.
    pub fn create(spec: &RbdSpec, size: u64) -> Result<(), RbdError> {
        if spec.snapshot.is_some() {
            return Err(RbdError::BadName {
                name: spec.display_name(),
                reason: "cannot create a snapshot; name the image without @SNAP".into(),
            });
        }
        let pool = Pool::connect(spec)?;
        let image_name = cstring(&spec.image)?;
        let mut order: c_int = 0;
        // SAFETY: a live pool context, a NUL-terminated name; order 0 = librbd's default.
        let rc =
            unsafe { (pool.api.rbd_create)(pool.ioctx, image_name.as_ptr(), size, &mut order) };
        if rc < 0 {
            return Err(RbdError::Call {
                op: "create",
                image: spec.display_name(),
                errno: -rc,
            });
        }
        Ok(())
    }

    /// Takes the image's exclusive lock, failing with [`RbdError::Locked`] naming the owner
    /// when another client holds it. Held until [`release_lock`](Self::release_lock) or close;
    /// librbd does not hand a lock taken this way to other clients that ask for it.
    pub fn acquire_lock(&self) -> Result<(), RbdError> {
        // SAFETY: an open, writable image.
        let rc = unsafe { (self.api.rbd_lock_acquire)(self.handle, ffi::LOCK_MODE_EXCLUSIVE) };
        if rc >= 0 {
            return Ok(());
        }
        match self.owners() {
            Some(owner) => Err(RbdError::Locked {
                image: self.name.clone(),
                owner,
            }),
            None => Err(RbdError::Call {
                op: "take the exclusive lock of",
                image: self.name.clone(),
                errno: -rc,
            }),
        }
    }

    /// Lets go of the exclusive lock (after flushing what librbd still holds), so another
    /// client can take it.
    pub fn release_lock(&self) -> Result<(), RbdError> {
        // SAFETY: an open image.
        self.check("release the exclusive lock of", unsafe {
            (self.api.rbd_lock_release)(self.handle)
        })
    }

    /// Names this image the same way in every client of its cluster: the cluster's fsid, the
    /// pool's id and the image's id (which, unlike its name, a rename does not change).
    pub fn identity(&self) -> Result<String, RbdError> {
        let mut fsid = [0 as c_char; 64];
        // SAFETY: a connected handle and a buffer of the given length.
        let rc = unsafe {
            (self.api.rados_cluster_fsid)(self.pool.rados, fsid.as_mut_ptr(), fsid.len())
        };
        if rc < 0 {
            self.check("read the cluster fsid of", rc)?;
        }
        // SAFETY: a live pool context.
        let pool_id = unsafe { (self.api.rados_ioctx_get_id)(self.pool.ioctx) };
        let mut id = [0 as c_char; 128];
        // SAFETY: an open image and a buffer of the given length.
        self.check("read the id of", unsafe {
            (self.api.rbd_get_id)(self.handle, id.as_mut_ptr(), id.len())
        })?;
        // SAFETY: both calls succeeded, so both buffers hold NUL-terminated strings.
        let (fsid, id) = unsafe { (CStr::from_ptr(fsid.as_ptr()), CStr::from_ptr(id.as_ptr())) };
        Ok(format!(
            "{}/{pool_id}/{}",
            fsid.to_string_lossy(),
            id.to_string_lossy()
        ))
    }

    /// The current lock owners, comma-separated, if anyone holds the lock.
    fn owners(&self) -> Option<String> {
        let mut mode: c_int = 0;
        let mut owners: [*mut c_char; 8] = [ptr::null_mut(); 8];
        let mut count: size_t = owners.len();
        // SAFETY: `owners` has room for `count` pointers, which librbd fills with strings
        // that `rbd_lock_get_owners_cleanup` frees.
        let rc = unsafe {
            (self.api.rbd_lock_get_owners)(self.handle, &mut mode, owners.as_mut_ptr(), &mut count)
        };
        if rc < 0 || count == 0 {
            return None;
        }
        let names: Vec<String> = owners[..count]
            .iter()
            // SAFETY: librbd set the first `count` entries to NUL-terminated strings.
            .map(|&p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .collect();
        // SAFETY: frees exactly what rbd_lock_get_owners returned.
        unsafe { (self.api.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), count) };
        Some(names.join(", "))
    }

    fn check(&self, op: &'static str, rc: c_int) -> Result<(), RbdError> {
        if rc < 0 {
            Err(RbdError::Call {
                op,
                image: self.name.clone(),
                errno: -rc,
            })
        } else {
            Ok(())
        }
    }

    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Grows or shrinks the image to `size` bytes (shrinking discards the data past it).
    pub fn resize(&self, size: u64) -> Result<(), RbdError> {
        // SAFETY: an open image.
        self.check("resize", unsafe {
            (self.api.rbd_resize)(self.handle, size)
        })?;
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    /// Deletes the image (it must not be open anywhere, this process included).
    pub fn remove(spec: &RbdSpec) -> Result<(), RbdError> {
        let pool = Pool::connect(spec)?;
        let image_name = cstring(&spec.image)?;
        // SAFETY: a live pool context and a NUL-terminated name.
        let rc = unsafe { (pool.api.rbd_remove)(pool.ioctx, image_name.as_ptr()) };
        if rc < 0 {
            return Err(RbdError::Call {
                op: "remove",
                image: spec.display_name(),
                errno: -rc,
            });
        }
        Ok(())
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// `POOL/IMAGE[@SNAP]`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The raw librbd handle, for the asynchronous queue built on it.
    pub fn raw_handle(&self) -> *mut c_void {
        self.handle
    }

    /// Reads all of `buf` at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), RbdError> {
        // SAFETY: `buf` is writable for its whole length during the call.
        let n =
            unsafe { (self.api.rbd_read)(self.handle, offset, buf.len(), buf.as_mut_ptr().cast()) };
        self.check_len("read", n, buf.len())
    }

    /// Writes all of `buf` at `offset`.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), RbdError> {
        // SAFETY: `buf` is readable for its whole length during the call.
        let n =
            unsafe { (self.api.rbd_write)(self.handle, offset, buf.len(), buf.as_ptr().cast()) };
        self.check_len("write", n, buf.len())
    }

    fn check_len(&self, op: &'static str, n: isize, want: usize) -> Result<(), RbdError> {
        if n < 0 {
            return self.check(op, n as c_int);
        }
        if n as usize != want {
            return Err(RbdError::Call {
                op,
                image: self.name.clone(),
                errno: libc::EIO,
            });
        }
        Ok(())
    }

    /// Makes completed writes durable in the cluster.
    pub fn flush(&self) -> Result<(), RbdError> {
        // SAFETY: an open image.
        self.check("flush", unsafe { (self.api.rbd_flush)(self.handle) })
    }

    pub fn discard(&self, offset: u64, len: u64) -> Result<(), RbdError> {
        // SAFETY: an open image.
        self.check("discard", unsafe {
            (self.api.rbd_discard)(self.handle, offset, len)
        })
    }

    /// Makes `len` bytes at `offset` read as zeros; librbd deallocates whole objects.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), RbdError> {
        let mut done = 0u64;
        while done < len {
            // One call per 1 GiB keeps the length inside size_t on every platform.
            let n = (len - done).min(1 << 30);
            // SAFETY: an open image; no zero or op flags.
            let rc = unsafe {
                (self.api.rbd_write_zeroes)(self.handle, offset + done, n as size_t, 0, 0)
            };
            self.check_len("write zeroes", rc, n as usize)?;
            done += n;
        }
        Ok(())
    }

    /// The allocated runs within `offset..offset + len`, in order (merged where adjacent).
    /// What is not listed reads as zeros.
    pub fn allocated(&self, offset: u64, len: u64) -> Result<Vec<Allocation>, RbdError> {
        extern "C" fn collect(off: u64, len: size_t, exists: c_int, arg: *mut c_void) -> c_int {
            // SAFETY: `arg` is the `&mut Vec<Allocation>` passed below, alive for the call,
            // and librbd calls back on the calling thread during rbd_diff_iterate2.
            let runs = unsafe { &mut *arg.cast::<Vec<Allocation>>() };
            if exists != 0 {
                match runs.last_mut() {
                    Some(last) if last.offset + last.len == off => last.len += len as u64,
                    _ => runs.push(Allocation {
                        offset: off,
                        len: len as u64,
                    }),
                }
            }
            0
        }
        let mut runs: Vec<Allocation> = Vec::new();
        // SAFETY: an open image; no from-snapshot (diff against nothing = allocation),
        // byte-exact extents (whole_object = 0); the callback only touches `runs`.
        let rc = unsafe {
            (self.api.rbd_diff_iterate2)(
                self.handle,
                ptr::null(),
                offset,
                len,
                1,
                0,
                collect,
                (&mut runs as *mut Vec<Allocation>).cast(),
            )
        };
        self.check("list the allocation of", rc)?;
        Ok(runs)
    }
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("name", &self.name)
            .field("size", &self.size())
            .field("read_only", &self.read_only)
            .finish()
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: the handle is open and closed exactly once; closing releases the lock.
        unsafe { (self.api.rbd_close)(self.handle) };
    }
}

fn cstring(s: &str) -> Result<CString, RbdError> {
    CString::new(s).map_err(|_| RbdError::BadName {
        name: s.to_owned(),
        reason: "contains a NUL byte".into(),
    })
}

fn path_cstring(p: &std::path::Path) -> Result<CString, RbdError> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(p.as_os_str().as_bytes()).map_err(|_| RbdError::BadName {
        name: p.display().to_string(),
        reason: "contains a NUL byte".into(),
    })
}
