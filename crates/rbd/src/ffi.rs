//! The few librados/librbd C functions this client calls, resolved once at run time.

use crate::RbdError;
use libc::{c_char, c_int, c_void, size_t, ssize_t};
use std::sync::OnceLock;

pub type Rados = *mut c_void;
pub type IoCtx = *mut c_void;
pub type RbdImage = *mut c_void;
pub type DiffCallback = extern "C" fn(u64, size_t, c_int, *mut c_void) -> c_int;
pub type AioCompletion = *mut c_void;
/// `rbd_callback_t`: runs on one of librbd's own threads when a request completes.
pub type AioCallback = extern "C" fn(AioCompletion, *mut c_void);

/// `RBD_LOCK_MODE_EXCLUSIVE` from librbd.h.
pub const LOCK_MODE_EXCLUSIVE: c_int = 0;

/// Function pointers into librados.so.2 and librbd.so.1; the libraries stay loaded for the
/// life of the process (they are kept in `Api`).
pub struct Api {
    pub rados_create: unsafe extern "C" fn(*mut Rados, *const c_char) -> c_int,
    pub rados_conf_read_file: unsafe extern "C" fn(Rados, *const c_char) -> c_int,
    pub rados_conf_set: unsafe extern "C" fn(Rados, *const c_char, *const c_char) -> c_int,
    pub rados_connect: unsafe extern "C" fn(Rados) -> c_int,
    pub rados_shutdown: unsafe extern "C" fn(Rados),
    pub rados_ioctx_create: unsafe extern "C" fn(Rados, *const c_char, *mut IoCtx) -> c_int,
    pub rados_ioctx_destroy: unsafe extern "C" fn(IoCtx),
    pub rados_cluster_fsid: unsafe extern "C" fn(Rados, *mut c_char, size_t) -> c_int,
    pub rados_ioctx_get_id: unsafe extern "C" fn(IoCtx) -> i64,
    pub rbd_open: unsafe extern "C" fn(IoCtx, *const c_char, *mut RbdImage, *const c_char) -> c_int,
    pub rbd_open_read_only:
        unsafe extern "C" fn(IoCtx, *const c_char, *mut RbdImage, *const c_char) -> c_int,
    pub rbd_close: unsafe extern "C" fn(RbdImage) -> c_int,
    pub rbd_create: unsafe extern "C" fn(IoCtx, *const c_char, u64, *mut c_int) -> c_int,
    pub rbd_get_size: unsafe extern "C" fn(RbdImage, *mut u64) -> c_int,
    pub rbd_resize: unsafe extern "C" fn(RbdImage, u64) -> c_int,
    pub rbd_remove: unsafe extern "C" fn(IoCtx, *const c_char) -> c_int,
    pub rbd_lock_acquire: unsafe extern "C" fn(RbdImage, c_int) -> c_int,
    pub rbd_lock_release: unsafe extern "C" fn(RbdImage) -> c_int,
    pub rbd_get_id: unsafe extern "C" fn(RbdImage, *mut c_char, size_t) -> c_int,
    pub rbd_lock_get_owners:
        unsafe extern "C" fn(RbdImage, *mut c_int, *mut *mut c_char, *mut size_t) -> c_int,
    pub rbd_lock_get_owners_cleanup: unsafe extern "C" fn(*mut *mut c_char, size_t),
    pub rbd_read: unsafe extern "C" fn(RbdImage, u64, size_t, *mut c_char) -> ssize_t,
    pub rbd_write: unsafe extern "C" fn(RbdImage, u64, size_t, *const c_char) -> ssize_t,
    pub rbd_flush: unsafe extern "C" fn(RbdImage) -> c_int,
    pub rbd_discard: unsafe extern "C" fn(RbdImage, u64, u64) -> c_int,
    pub rbd_write_zeroes: unsafe extern "C" fn(RbdImage, u64, size_t, c_int, c_int) -> ssize_t,
    pub rbd_diff_iterate2: unsafe extern "C" fn(
        RbdImage,
        *const c_char,
        u64,
        u64,
        u8,
        u8,
        DiffCallback,
        *mut c_void,
    ) -> c_int,
    pub rbd_aio_create_completion:
        unsafe extern "C" fn(*mut c_void, AioCallback, *mut AioCompletion) -> c_int,
    pub rbd_aio_get_return_value: unsafe extern "C" fn(AioCompletion) -> ssize_t,
    pub rbd_aio_release: unsafe extern "C" fn(AioCompletion),
    pub rbd_aio_readv:
        unsafe extern "C" fn(RbdImage, *const libc::iovec, c_int, u64, AioCompletion) -> c_int,
    pub rbd_aio_writev:
        unsafe extern "C" fn(RbdImage, *const libc::iovec, c_int, u64, AioCompletion) -> c_int,
    pub rbd_aio_flush: unsafe extern "C" fn(RbdImage, AioCompletion) -> c_int,
    pub rbd_aio_discard: unsafe extern "C" fn(RbdImage, u64, u64, AioCompletion) -> c_int,
    pub rbd_aio_write_zeroes:
        unsafe extern "C" fn(RbdImage, u64, size_t, AioCompletion, c_int, c_int) -> c_int,
    _rados: libloading::Library,
    _rbd: libloading::Library,
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

/// The loaded API, or why librbd could not be loaded.
pub fn api() -> Result<&'static Api, RbdError> {
    API.get_or_init(|| load("librados.so.2", "librbd.so.1"))
        .as_ref()
        .map_err(|why| RbdError::LibraryMissing(why.clone()))
}

fn load(rados: &str, rbd: &str) -> Result<Api, String> {
    // SAFETY: loading librados/librbd runs their static initialisers, which are ordinary C++
    // constructors with no preconditions on the loading process.
    let rados = unsafe { libloading::Library::new(rados) }.map_err(|e| e.to_string())?;
    // SAFETY: as above.
    let rbd = unsafe { libloading::Library::new(rbd) }.map_err(|e| e.to_string())?;
    macro_rules! sym {
        ($lib:expr, $name:ident) => {
            // SAFETY: the symbol's type is the prototype from librados.h/librbd.h; the
            // library it comes from is kept alive in `Api` next to the pointer.
            *unsafe { $lib.get(concat!(stringify!($name), "\0").as_bytes()) }
                .map_err(|e| e.to_string())?
        };
    }
    Ok(Api {
        rados_create: sym!(rados, rados_create),
        rados_conf_read_file: sym!(rados, rados_conf_read_file),
        rados_conf_set: sym!(rados, rados_conf_set),
        rados_connect: sym!(rados, rados_connect),
        rados_shutdown: sym!(rados, rados_shutdown),
        rados_ioctx_create: sym!(rados, rados_ioctx_create),
        rados_ioctx_destroy: sym!(rados, rados_ioctx_destroy),
        rados_cluster_fsid: sym!(rados, rados_cluster_fsid),
        rados_ioctx_get_id: sym!(rados, rados_ioctx_get_id),
        rbd_open: sym!(rbd, rbd_open),
        rbd_open_read_only: sym!(rbd, rbd_open_read_only),
        rbd_close: sym!(rbd, rbd_close),
        rbd_create: sym!(rbd, rbd_create),
        rbd_get_size: sym!(rbd, rbd_get_size),
        rbd_resize: sym!(rbd, rbd_resize),
        rbd_remove: sym!(rbd, rbd_remove),
        rbd_lock_acquire: sym!(rbd, rbd_lock_acquire),
        rbd_lock_release: sym!(rbd, rbd_lock_release),
        rbd_get_id: sym!(rbd, rbd_get_id),
        rbd_lock_get_owners: sym!(rbd, rbd_lock_get_owners),
        rbd_lock_get_owners_cleanup: sym!(rbd, rbd_lock_get_owners_cleanup),
        rbd_read: sym!(rbd, rbd_read),
        rbd_write: sym!(rbd, rbd_write),
        rbd_flush: sym!(rbd, rbd_flush),
        rbd_discard: sym!(rbd, rbd_discard),
        rbd_write_zeroes: sym!(rbd, rbd_write_zeroes),
        rbd_diff_iterate2: sym!(rbd, rbd_diff_iterate2),
        rbd_aio_create_completion: sym!(rbd, rbd_aio_create_completion),
        rbd_aio_get_return_value: sym!(rbd, rbd_aio_get_return_value),
        rbd_aio_release: sym!(rbd, rbd_aio_release),
        rbd_aio_readv: sym!(rbd, rbd_aio_readv),
        rbd_aio_writev: sym!(rbd, rbd_aio_writev),
        rbd_aio_flush: sym!(rbd, rbd_aio_flush),
        rbd_aio_discard: sym!(rbd, rbd_aio_discard),
        rbd_aio_write_zeroes: sym!(rbd, rbd_aio_write_zeroes),
        _rados: rados,
        _rbd: rbd,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_says_what_to_install() {
        let Err(why) = load("libcryptblk-no-such-rados.so.2", "librbd.so.1") else {
            panic!("a library that does not exist loaded");
        };
        let message = RbdError::LibraryMissing(why).to_string();
        assert!(
            message.starts_with("rbd: images need librbd1 (apt install librbd1)"),
            "{message}"
        );
        assert!(
            message.contains("libcryptblk-no-such-rados.so.2"),
            "{message}"
        );
    }
}
