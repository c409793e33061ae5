//! Daemons, images and key files for the library's tests.
#![allow(dead_code)]

use cryptblk_control::api::{DiskConfig, ImageName};
use cryptblk_crypto::CryptoPool;
use cryptblk_daemon::{Daemon, DaemonOptions};
use cryptblk_luks::UnlockOptions;
use cryptblk_nbd::ExportRegistry;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const PASSPHRASE: &[u8] = b"daemon test passphrase";

/// A daemon with an NBD export registry (no listener: exports are registered, not served).
pub fn daemon() -> Arc<Daemon> {
    let (events, _) = crossbeam_channel::unbounded();
    Daemon::new(DaemonOptions {
        pool: Arc::new(CryptoPool::new(1)),
        unlock: UnlockOptions::default(),
        nbd: Some(ExportRegistry::new()),
        nbd_tls: false,
        events,
        master_key: None,
        key_cache: None,
        backup_listener: Default::default(),
    })
}

pub fn raw_image(dir: &Path, name: &str, size: usize) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, vec![0u8; size]).unwrap();
    path
}

/// A 1 MiB LUKS2 image with one cheap pbkdf2 keyslot for [`PASSPHRASE`].
pub fn luks_image(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    cryptblk_testutil::luks::cheap_luks2(&path, PASSPHRASE, 1 << 20, 4096);
    path
}

pub fn key_file(dir: &Path, name: &str, passphrase: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, passphrase).unwrap();
    path
}

pub fn disk(name: &str, image: &Path) -> DiskConfig {
    DiskConfig::new(name, ImageName::new(image))
}
