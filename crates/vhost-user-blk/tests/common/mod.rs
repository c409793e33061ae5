//! What the in-process serve tests (`serve.rs`, `serve_queues.rs`, `serve_discard.rs`) share:
//! the vhost-user frontend (`cryptblk_testutil::vhost_user`, re-exported, which the crate's
//! other tests import as `common` directly), and the disks and options they serve.
#![allow(dead_code)]

pub use cryptblk_testutil::vhost_user::*;

use std::sync::Arc;

use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_vhost_user_blk::ServeOptions;

pub const MIB: u64 = 1 << 20;

pub fn raw_image(dir: &std::path::Path, size: u64) -> std::path::PathBuf {
    let path = dir.join("disk.raw");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(size).unwrap();
    path
}

pub fn open_raw(path: &std::path::Path, writable: bool) -> Arc<dyn BlockDevice> {
    Arc::new(
        RawFile::open(
            path,
            OpenOptions {
                writable,
                lock: true,
            },
        )
        .unwrap(),
    )
}

pub fn opts(num_queues: u16) -> ServeOptions {
    ServeOptions {
        num_queues,
        queue_size: 256,
        read_only: false,
        serial: "cryptblk-test-serial-too-long".into(),
        discard: false,
        ..Default::default()
    }
}

pub const PW: &[u8] = b"vhost passphrase";

/// A 4 MiB LUKS2 image with 4096-byte encryption sectors, passphrase `PW`.
pub fn luks2_image(dir: &std::path::Path) -> std::path::PathBuf {
    let img = dir.join("disk.luks2");
    cryptblk_testutil::luks::cheap_luks2(&img, PW, 4 * MIB, 4096);
    img
}

/// The volume of `luks2_image`'s image at `img`, unlocked with `PW` and writable.
pub fn open_luks2_writable(img: &std::path::Path) -> Arc<dyn BlockDevice> {
    let rw = cryptblk_volume::VolumeOptions {
        writable: true,
        ..Default::default()
    };
    Arc::new(cryptblk_volume::open_luks_volume(img, PW, &rw).unwrap())
}
