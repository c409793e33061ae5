//! `rbd:POOL/IMAGE...` names on the command line: opening, creating and removing RBD images
//! with errors that map to the same exit codes as files (a held lock is "in use").
use crate::exit::UsageError;
use anyhow::Result;
use cryptblk_rbd::{Image, RbdDevice, RbdError, RbdSpec};
use std::path::Path;

/// `name` as an `rbd:` image name, if it is one.
pub fn rbd_name(name: &Path) -> Option<&str> {
    cryptblk_control::api::rbd_name(name)
}

fn cli_error(e: RbdError) -> anyhow::Error {
    match e {
        RbdError::BadName { .. } => UsageError(e.to_string()).into(),
        // As a block error, so that a held lock exits as "in use" like a locked file.
        e => cryptblk_rbd::open_error(e).into(),
    }
}

/// Opens an existing image; writable ones under the exclusive lock.
pub fn open(name: &str, writable: bool) -> Result<RbdDevice> {
    RbdDevice::open(name, writable).map_err(cli_error)
}

/// A new, empty image that is removed again unless `keep` is called: a failed or interrupted
/// convert or format leaves nothing that looks like a finished image.
pub struct NewImage {
    spec: RbdSpec,
    kept: bool,
}

impl NewImage {
    /// Creates the image (0 bytes: formatting or the caller sizes it) and opens it, locked.
    pub fn create(name: &str) -> Result<(NewImage, RbdDevice)> {
        let spec = RbdSpec::parse(name).map_err(cli_error)?;
        Image::create(&spec, 0).map_err(|e| match e.errno() {
            Some(libc::EEXIST) => UsageError(format!(
                "{name} already exists: write into it with -n, or choose a new name"
            ))
            .into(),
            _ => cli_error(e),
        })?;
        let created = NewImage { spec, kept: false };
        let device = open(name, true)?;
        Ok((created, device))
    }

    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for NewImage {
    fn drop(&mut self) {
        if !self.kept {
            if let Err(e) = Image::remove(&self.spec) {
                eprintln!(
                    "cryptblk: warning: could not remove the unfinished image rbd:{}: {e}",
                    self.spec.display_name()
                );
            }
        }
    }
}
