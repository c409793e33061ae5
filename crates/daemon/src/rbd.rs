//! Disks whose image is a Ceph RBD image (`rbd:POOL/IMAGE...`).
use crate::error::{Context, Error, Result};
use cryptblk_block::Container;
use cryptblk_rbd::{RbdDevice, RbdError};

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

/// True when the image starts with the LUKS magic (either version).
pub fn starts_with_luks_magic(device: &RbdDevice) -> Result<bool> {
    cryptblk_luks::LuksImage::probe(device.header_io())
        .with_context(|| format!("probing {}", device.name().display()))
}
