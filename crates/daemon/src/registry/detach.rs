//! Detaching a disk: taken out of the registry first (refused while a VM is connected, unless
//! forced), then, without the registry lock, a migration or re-encryption under way stops, a
//! backup ends, the NBD export and the vhost-user server close and the image is flushed; its
//! cached keys go unless a restart or a successor needs them.

use super::{Daemon, DiskEntry};
use crate::error::{Error, Result};
use std::sync::PoisonError;
use std::time::Duration;

/// How long `disk-remove` waits for a migration start under way to give up (the start is
/// bounded by its connect timeout; past this the removal goes on and the start, finding
/// itself cancelled, stops the migration it made).
const START_WAIT: Duration = Duration::from_secs(60);

impl Daemon {
    /// Detaches a disk: no new client can open it, in-flight requests finish, the image is
    /// flushed and closed. Refused while a VM is connected over vhost-user unless `force`.
    pub fn remove_disk(&self, name: &str, force: bool) -> Result<()> {
        self.detach(name, force, false)
    }

    /// Detaches a disk a successor daemon has taken over: its cached keys stay (the socket
    /// file stays too: its vhost-user server was marked handed over).
    pub(crate) fn detach_for_handover(&self, name: &str) -> Result<()> {
        self.detach(name, true, true)
    }

    fn detach(&self, name: &str, force: bool, keep_keys: bool) -> Result<()> {
        let disk = {
            let mut disks = self.disks();
            let disk = match disks.get(name) {
                None => return Err(Error::no_such_disk(name)),
                Some(DiskEntry::Adding(_)) => {
                    return Err(Error::busy(format!(
                        "disk \"{name}\" is still being added; retry when disk-add has returned"
                    )))
                }
                Some(DiskEntry::Attached(d)) => d.clone(),
            };
            if let Some(vhost) = &disk.vhost {
                if vhost.stop.is_connected() && !force {
                    return Err(Error::busy(format!(
                        "disk \"{name}\" has a vhost-user frontend (a VM) connected on {}; \
                         detach it from the VM first, or pass force to cut it off",
                        vhost.socket.display()
                    )));
                }
            }
            disks.remove(name);
            disk
        };
        // A migration that has not handed the disk over yet stops (one still connecting is
        // told to, and waited for); one that has is over for this side anyway.
        if let Some(m) = disk.activity.stop_starting(START_WAIT) {
            if m.cancel().is_ok() {
                m.wait(std::time::Duration::from_secs(30));
            }
        }
        // A reencryption commits its hotzone and stops; `reencrypt-start` continues it once
        // the disk is attached again.
        disk.reencryption.stop();
        self.end_backup_on_detach(&disk);
        let incoming = self
            .incoming
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
        if let Some(m) = incoming {
            let _ = m.cancel();
        }
        let mut first_error = None;
        if disk.nbd_exported {
            if let Some(registry) = &self.nbd {
                if let Err(e) = registry.remove(name) {
                    first_error.get_or_insert(Error::caused("closing the NBD export", e));
                }
            }
        }
        if let Err(e) = disk.stop_vhost() {
            first_error.get_or_insert(e);
        }
        // A disk fenced for a migration hand-over refuses I/O through its tracker, but what was
        // written before the fence must still be durable: flush beneath the fence. An image
        // whose lock went to another daemon (shared storage) was flushed before it went, and
        // is that daemon's to flush now.
        let tracker = &disk.image.tracker;
        let handed_over = disk.activity.migration().is_some_and(|m| m.handed_over());
        let flushed = if handed_over {
            Ok(())
        } else if tracker.is_fenced() {
            tracker.inner().flush()
        } else {
            disk.image.device.flush()
        };
        if let Err(e) = flushed {
            first_error.get_or_insert(Error::caused("flushing the image", e));
        }
        if let (Some(cache), Some(keys)) = (&self.key_cache, disk.image.volume_keys()) {
            if !keep_keys
                && !self
                    .keep_cached_keys
                    .load(std::sync::atomic::Ordering::SeqCst)
            {
                cache.remove(&keys.uuid);
            }
        }
        match first_error {
            Some(e) => Err(e.context(format!("detaching disk \"{name}\""))),
            None => {
                tracing::info!(disk = %name, "detached");
                Ok(())
            }
        }
    }
}
