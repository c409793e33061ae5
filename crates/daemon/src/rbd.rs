//! Disks whose image is a Ceph RBD image (`rbd:POOL/IMAGE...`).
use crate::error::{Context, Error, Result};
use cryptblk_block::Container;
use cryptblk_migration::IncomingStore;
use cryptblk_rbd::{Image, OpenMode, RbdDevice, RbdError, RbdSpec};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Opens the RBD image `name` names; writable ones under the image's exclusive lock, so two
/// daemons never write one image.
pub fn open(name: &str, writable: bool) -> Result<RbdDevice> {
    match RbdDevice::open(name, writable) {
        Ok(device) => Ok(device),
        Err(e @ RbdError::BadName { .. }) => Err(Error::usage(e.to_string())),
        // As a block error, so that a held lock reads as "in use" like a locked file.
        Err(e) => Err(cryptblk_rbd::open_error(e)).context("opening the image"),
    }
}

/// Where an incoming migration into `name` goes: the image itself when it exists (shared
/// storage: the source serves it and hands its lock over), else a new image.
pub fn incoming_store(name: &str) -> Result<Arc<dyn IncomingStore>> {
    let spec = RbdSpec::parse(name).map_err(|e| Error::usage(e.to_string()))?;
    match Image::open(&spec, OpenMode::ReadOnly) {
        Ok(_) => Ok(Arc::new(SharedRbdImage {
            name: name.to_owned(),
            display: PathBuf::from(format!("rbd:{}", spec.display_name())),
        })),
        Err(e) if e.errno() == Some(libc::ENOENT) => Ok(Arc::new(NewRbdImage::new(name)?)),
        Err(e) => Err(cryptblk_rbd::open_error(e)).context("opening the image"),
    }
}

/// The RBD image the source of a shared-storage migration serves: opened without its lock,
/// which this side takes when the source lets go of it at switchover. Never removed.
pub struct SharedRbdImage {
    name: String,
    display: PathBuf,
}

impl IncomingStore for SharedRbdImage {
    fn name(&self) -> &Path {
        &self.display
    }
    fn exists(&self) -> bool {
        true
    }
    fn create(&self, size: u64) -> std::result::Result<Arc<dyn Container>, String> {
        let device = RbdDevice::open_for_hand_off(&self.name).map_err(|e| e.to_string())?;
        let have = device.image().size();
        if have != size {
            return Err(format!(
                "{} is {have} bytes but the source's disk is {size}: not the same image",
                self.display.display()
            ));
        }
        Ok(Arc::new(device))
    }
    fn remove(&self) -> bool {
        true
    }
    fn is_shared(&self) -> bool {
        true
    }
}

/// A new RBD image an incoming migration writes into (created with the disk's size when the
/// source says it; removed again if the migration fails before this side went live).
pub struct NewRbdImage {
    name: String,
    spec: RbdSpec,
    display: PathBuf,
}

impl NewRbdImage {
    pub fn new(name: &str) -> Result<NewRbdImage> {
        let spec = RbdSpec::parse(name).map_err(|e| Error::usage(e.to_string()))?;
        let display = PathBuf::from(format!("rbd:{}", spec.display_name()));
        Ok(NewRbdImage {
            name: name.to_owned(),
            spec,
            display,
        })
    }
}

impl IncomingStore for NewRbdImage {
    fn name(&self) -> &Path {
        &self.display
    }
    fn exists(&self) -> bool {
        RbdDevice::open(&self.name, false).is_ok()
    }
    fn create(&self, size: u64) -> std::result::Result<Arc<dyn Container>, String> {
        Image::create(&self.spec, size).map_err(|e| e.to_string())?;
        let device = RbdDevice::open(&self.name, true).map_err(|e| e.to_string())?;
        Ok(Arc::new(device))
    }
    fn remove(&self) -> bool {
        match Image::remove(&self.spec) {
            Ok(()) => true,
            Err(e) => e.errno() == Some(libc::ENOENT),
        }
    }
}
