//! `disk-resize`: grows (or, when allowed, shrinks) an attached disk while it serves, then
//! tells its VM.
//!
//! Every queue reads the disk's size per request (the image's and the LUKS payload's, shared
//! atomics read by each pipeline's range check), so the new size holds for every queue the
//! moment the resize returns, without a message to the queue workers and without draining:
//! requests at the old end go on as before (`cryptblk_volume::Volume::resize` has the order
//! of the steps). The vhost-user config space reads the capacity from the device too;
//! the frontend is then told to read it again (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG). An NBD
//! connection keeps the size it was told at its handshake; new ones see the new size.
use crate::disk::AttachedDisk;
use crate::error::{Error, Result};
use crate::registry::Daemon;
use cryptblk_control::api::{DiskResizeParams, DiskResized};
use cryptblk_volume::ResizeError;

impl Daemon {
    /// Resizes the disk to `p.size` bytes as the guest sees them. Refused as busy while a
    /// migration (either way), a keyslot change or an online reencryption runs on the disk
    /// (`begin_header_change` refuses all of them: a reencryption's last segment ends where
    /// the payload does), and while the disk is being added.
    pub fn resize_disk(&self, p: &DiskResizeParams) -> Result<DiskResized> {
        let disk = self.attached(&p.name)?;
        if disk.read_only() {
            return Err(Error::conflict(format!(
                "disk \"{}\" is read-only: it cannot be resized",
                p.name
            )));
        }
        // A migration copies the disk at the size it had when it started (its dirty bitmap,
        // the destination's image): a resize waits until it is over.
        let change = self.begin_header_change(&disk)?;
        let resized = resize(&disk, p.size, p.allow_shrink)?;
        // The header is written: the VM is told without holding the disk's other changes
        // back (a frontend slow to answer delays only this call).
        drop(change);
        if resized.old != resized.new {
            tracing::info!(
                disk = %p.name,
                old = resized.old,
                new = resized.new,
                header_updated = resized.header_updated,
                "disk resized"
            );
        }
        let guest_notified = match &disk.vhost {
            Some(vhost) if resized.old != resized.new => {
                match vhost.stop.notify_config_change() {
                    Ok(told) => told,
                    // The disk has its new size either way; the guest sees it at its next
                    // config read (a reboot), so the resize itself is not undone.
                    Err(e) => {
                        tracing::warn!(
                            disk = %p.name,
                            "the VM could not be told of the new size: {e}"
                        );
                        false
                    }
                }
            }
            _ => false,
        };
        Ok(DiskResized {
            name: p.name.clone(),
            old_size: resized.old,
            size: disk.image.device.size(),
            guest_notified,
        })
    }
}

fn resize(disk: &AttachedDisk, size: u64, allow_shrink: bool) -> Result<cryptblk_volume::Resized> {
    disk.image.resize(size, allow_shrink).map_err(|e| match e {
        e if e.is_bad_request() => Error::usage(e.to_string()),
        e @ ResizeError::Image { .. } => Error::caused(
            format!("disk \"{}\": the resize was refused", disk.name()),
            e,
        ),
        e => Error::caused(format!("disk \"{}\": resizing", disk.name()), e),
    })
}
