//! An in-process vhost-user-blk frontend for tests: memfd-backed guest memory shared with the
//! daemon through SET_MEM_TABLE, split virtqueues in that memory (`ring`), and requests
//! built, kicked and waited for as a guest driver does ([`Guest`]). Chains can be malformed on
//! purpose (any field of a [`Desc`], links that loop) for the fault tests.
//!
//! Request types and status values are virtio-bindings' (`virtio_blk`), not redeclared.

mod guest;
mod requests;
mod ring;

pub use crate::pattern;
pub use guest::Guest;
pub use ring::Desc;
pub use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};

use rustix::fs::{fcntl_add_seals, memfd_create, MemfdFlags, SealFlags};
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use cryptblk_block::BlockDevice;
use cryptblk_vhost_user_blk::{EventListener, ServeOptions, Server, StopHandle};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

/// The status byte values (virtio-bindings has them as `u32`).
pub const S_OK: u8 = VIRTIO_BLK_S_OK as u8;
pub const S_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
pub const S_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

/// Size of the guest memory a [`Guest`] shares.
pub const MEM_SIZE: u64 = 32 << 20;

/// A daemon serving a device in a background thread of this process.
pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    stop: StopHandle,
    thread: Option<JoinHandle<Result<(), cryptblk_vhost_user_blk::Error>>>,
}

impl Daemon {
    pub fn start(device: Arc<dyn BlockDevice>, opts: ServeOptions) -> Daemon {
        Self::start_with(device, opts, None)
    }

    /// Like `start`, with a `FrontendEvent` listener registered before the server runs.
    pub fn start_with(
        device: Arc<dyn BlockDevice>,
        opts: ServeOptions,
        listener: Option<EventListener>,
    ) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("blk.sock");
        let mut server = Server::bind(&socket, device, opts).unwrap();
        if let Some(listener) = listener {
            server.set_event_listener(listener);
        }
        let stop = server.stop_handle();
        let thread = std::thread::spawn(move || server.run());
        Daemon {
            dir,
            socket,
            stop,
            thread: Some(thread),
        }
    }

    pub fn stop_handle(&self) -> &StopHandle {
        &self.stop
    }

    /// Stops the server and waits for it (it flushes the device on the way out).
    pub fn stop(mut self) {
        self.stop.stop();
        self.thread.take().unwrap().join().unwrap().unwrap();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.stop();
            let _ = t.join();
        }
    }
}

/// Guest RAM in a memfd of [`MEM_SIZE`] bytes, sealed (`F_SEAL_SHRINK | F_SEAL_GROW |
/// F_SEAL_SEAL`) as QEMU's `memory-backend-memfd` makes it, or not (`seal=off`): the daemon
/// refuses guest memory that could shrink under it.
pub fn memfd_memory_sealed(sealed: bool) -> GuestMemoryMmap {
    let fd = memfd_create(
        "cryptblk-guest",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .unwrap_or_else(|e| panic!("memfd_create: {}", std::io::Error::from(e)));
    let file = File::from(fd);
    file.set_len(MEM_SIZE).unwrap();
    if sealed {
        let seals = SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
        fcntl_add_seals(&file, seals)
            .unwrap_or_else(|e| panic!("F_ADD_SEALS: {}", std::io::Error::from(e)));
    }
    GuestMemoryMmap::from_ranges_with_files(&[(
        GuestAddress(0),
        MEM_SIZE as usize,
        Some(FileOffset::new(file, 0)),
    )])
    .unwrap()
}
