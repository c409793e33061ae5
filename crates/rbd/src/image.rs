//! A connected, opened RBD image: cluster handle, pool context and image handle (`handle`),
//! closed in reverse order on drop.

use crate::ffi;
use crate::handle::{Cluster, Errno, ImageHandle, Pool};
use crate::{RbdError, RbdSpec, CLUSTER_TIMEOUT_SECS};
use std::ffi::CString;
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

/// Connects to the cluster `spec` names and opens its pool.
fn connect(spec: &RbdSpec) -> Result<Pool, RbdError> {
    let api = ffi::api()?;
    let name = spec.display_name();
    let failed = |op| {
        let image = name.clone();
        move |errno| RbdError::Call { op, image, errno }
    };
    let id = spec.id.as_deref().map(cstring).transpose()?;
    let cluster =
        Cluster::create(api, id.as_deref()).map_err(failed("connect to the cluster of"))?;
    let conf = spec.conf.as_ref().map(|p| path_cstring(p)).transpose()?;
    cluster
        .read_conf_file(conf.as_deref())
        .map_err(failed("read the ceph.conf for"))?;
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
        cluster
            .set_conf(option, value)
            .map_err(failed("configure the client of"))?;
    }
    cluster
        .connect()
        .map_err(failed("connect to the cluster of"))?;
    let pool_name = cstring(&spec.pool)?;
    cluster
        .open_pool(&pool_name)
        .map_err(failed("open the pool of"))
}

/// An open RBD image.
pub struct Image {
    handle: ImageHandle,
    name: String,
    // Changes only through `resize` (formatting a new image to its size).
    size: AtomicU64,
    read_only: bool,
}

impl Image {
    /// Opens the image; `ReadWrite` also takes its exclusive lock, failing with
    /// [`RbdError::Locked`] naming the owner when another client holds it. A snapshot is
    /// always opened read-only.
    pub fn open(spec: &RbdSpec, mode: OpenMode) -> Result<Image, RbdError> {
        let pool = connect(spec)?;
        let name = spec.display_name();
        let read_only = mode == OpenMode::ReadOnly || spec.snapshot.is_some();
        let image_name = cstring(&spec.image)?;
        let snap = spec.snapshot.as_deref().map(cstring).transpose()?;
        let handle = pool
            .open_image(&image_name, snap.as_deref(), read_only)
            .map_err(|errno| RbdError::Call {
                op: "open",
                image: name.clone(),
                errno,
            })?;
        let mut image = Image {
            handle,
            name,
            size: AtomicU64::new(0),
            read_only,
        };
        if mode == OpenMode::ReadWrite && !read_only {
            image.acquire_lock()?;
        }
        let size = image.check("get the size of", image.handle.size())?;
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
        let pool = connect(spec)?;
        let image_name = cstring(&spec.image)?;
        pool.create_image(&image_name, size)
            .map_err(|errno| RbdError::Call {
                op: "create",
                image: spec.display_name(),
                errno,
            })
    }

    /// Takes the image's exclusive lock, failing with [`RbdError::Locked`] naming the owner
    /// when another client holds it. Held until [`release_lock`](Self::release_lock) or close;
    /// librbd does not hand a lock taken this way to other clients that ask for it.
    pub fn acquire_lock(&self) -> Result<(), RbdError> {
        let Err(errno) = self.handle.lock_acquire(ffi::LOCK_MODE_EXCLUSIVE) else {
            return Ok(());
        };
        match self.owners() {
            Some(owner) => Err(RbdError::Locked {
                image: self.name.clone(),
                owner,
            }),
            None => Err(RbdError::Call {
                op: "take the exclusive lock of",
                image: self.name.clone(),
                errno,
            }),
        }
    }

    /// Lets go of the exclusive lock (after flushing what librbd still holds), so another
    /// client can take it.
    pub fn release_lock(&self) -> Result<(), RbdError> {
        self.check("release the exclusive lock of", self.handle.lock_release())
    }

    /// Names this image the same way in every client of its cluster: the cluster's fsid, the
    /// pool's id and the image's id (which, unlike its name, a rename does not change).
    pub fn identity(&self) -> Result<String, RbdError> {
        let pool = self.handle.pool();
        let fsid = self.check("read the cluster fsid of", pool.cluster().fsid())?;
        let pool_id = pool.id();
        let id = self.check("read the id of", self.handle.id())?;
        Ok(format!("{fsid}/{pool_id}/{id}"))
    }

    /// The current lock owners, comma-separated, if anyone holds the lock.
    fn owners(&self) -> Option<String> {
        let names = self.handle.lock_owners().ok()?;
        (!names.is_empty()).then(|| names.join(", "))
    }

    fn check<T>(&self, op: &'static str, result: Result<T, Errno>) -> Result<T, RbdError> {
        result.map_err(|errno| RbdError::Call {
            op,
            image: self.name.clone(),
            errno,
        })
    }

    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Grows or shrinks the image to `size` bytes (shrinking discards the data past it).
    pub fn resize(&self, size: u64) -> Result<(), RbdError> {
        self.check("resize", self.handle.resize(size))?;
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    /// Deletes the image (it must not be open anywhere, this process included).
    pub fn remove(spec: &RbdSpec) -> Result<(), RbdError> {
        let pool = connect(spec)?;
        let image_name = cstring(&spec.image)?;
        pool.remove_image(&image_name)
            .map_err(|errno| RbdError::Call {
                op: "remove",
                image: spec.display_name(),
                errno,
            })
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// `POOL/IMAGE[@SNAP]`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The librbd handle, for the asynchronous queue built on it.
    pub(crate) fn handle(&self) -> &ImageHandle {
        &self.handle
    }

    /// Reads all of `buf` at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), RbdError> {
        let want = buf.len();
        self.check_len("read", self.handle.read(buf, offset), want)
    }

    /// Writes all of `buf` at `offset`.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), RbdError> {
        self.check_len("write", self.handle.write(buf, offset), buf.len())
    }

    fn check_len(
        &self,
        op: &'static str,
        done: Result<usize, Errno>,
        want: usize,
    ) -> Result<(), RbdError> {
        if self.check(op, done)? != want {
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
        self.check("flush", self.handle.flush())
    }

    pub fn discard(&self, offset: u64, len: u64) -> Result<(), RbdError> {
        self.check("discard", self.handle.discard(offset, len))
    }

    /// Makes `len` bytes at `offset` read as zeros; librbd deallocates whole objects.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), RbdError> {
        let mut done = 0u64;
        while done < len {
            // One call per 1 GiB keeps the length inside size_t on every platform.
            let n = (len - done).min(1 << 30);
            // No zero or op flags.
            let zeroed = self.handle.write_zeroes(offset + done, n as usize, 0, 0);
            self.check_len("write zeroes", zeroed, n as usize)?;
            done += n;
        }
        Ok(())
    }

    /// The allocated runs within `offset..offset + len`, in order (merged where adjacent).
    /// What is not listed reads as zeros.
    pub fn allocated(&self, offset: u64, len: u64) -> Result<Vec<Allocation>, RbdError> {
        let mut runs: Vec<Allocation> = Vec::new();
        let listed = self.handle.diff(offset, len, |off, len, exists| {
            if exists {
                match runs.last_mut() {
                    Some(last) if last.offset + last.len == off => last.len += len,
                    _ => runs.push(Allocation { offset: off, len }),
                }
            }
        });
        self.check("list the allocation of", listed)?;
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
