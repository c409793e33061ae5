//! Attaching a disk in two halves, so the registry lock is never held across an unlock:
//! `prepare` reserves the name and opens and unlocks the image, `publish` serves it on its
//! frontends (vhost-user, NBD) and makes it visible; `abandon` gives a prepared disk up.

use super::{describe, Daemon, DiskEntry};
use crate::activity::DiskActivity;
use crate::disk::{serve_options, AttachedDisk, VhostExport, WithoutDiscard};
use crate::error::{chain, Context, Error, Result};
use crate::image::{open_image, Secret};
use crate::Event;
use cryptblk_block::IoStats;
use cryptblk_control::api::{DiskConfig, DiskInfo};
use cryptblk_migration::Phase;
use cryptblk_nbd::Export;
use cryptblk_vhost_user_blk::{FrontendEvent, ServeOptions, Server};
use cryptblk_volume::Volume;
use std::sync::Arc;

/// A vhost-user listening socket a predecessor daemon handed over.
pub struct InheritedSocket {
    pub listener: std::os::unix::net::UnixListener,
    pub path: std::path::PathBuf,
    pub file: cryptblk_net::unix_socket::FileId,
}

/// A disk whose image is open and unlocked but not exported yet (see `Daemon::prepare`).
pub struct PreparedDisk {
    pub config: DiskConfig,
    pub(crate) image: Volume,
    /// Received by an incoming migration: the checkpoints it brings (`DiskCheckpoints::receive`).
    pub(crate) migrated_in: Option<crate::disk_checkpoints::DiskCheckpoints>,
}

impl PreparedDisk {
    /// Opened with volume keys known already (handed over or cached): no key derivation.
    pub fn opened_without_kdf(&self) -> bool {
        self.image.without_kdf
    }
}

impl Daemon {
    /// First half of `add_disk`: reserves the name (and socket) and opens and unlocks the
    /// image, exporting nothing yet. `secret` is what opens it: a passphrase asked on a
    /// terminal (else the configured key source), or the volume keys a predecessor daemon
    /// handed over.
    pub fn prepare(&self, config: DiskConfig, secret: Secret) -> Result<PreparedDisk> {
        self.prepare_on(config, None, secret)
    }

    /// As `prepare`, on the image file a predecessor daemon handed over (open and locked).
    pub(crate) fn prepare_on(
        &self,
        config: DiskConfig,
        inherited: Option<std::fs::File>,
        secret: Secret,
    ) -> Result<PreparedDisk> {
        self.reserve(&config)?;
        match open_image(&config, inherited, secret, &self.open_context()) {
            Ok(image) => Ok(PreparedDisk {
                config,
                image,
                migrated_in: None,
            }),
            Err(e) => {
                self.unreserve(&config.name);
                Err(e)
            }
        }
    }

    /// Second half of `add_disk`: binds the disk's exports and makes it visible.
    pub fn publish(&self, prepared: PreparedDisk) -> Result<DiskInfo> {
        self.publish_on(prepared, None)
    }

    /// As `publish`, serving the vhost-user socket a predecessor daemon handed over.
    pub(crate) fn publish_on(
        &self,
        prepared: PreparedDisk,
        inherited: Option<InheritedSocket>,
    ) -> Result<DiskInfo> {
        let name = prepared.config.name.clone();
        match self.attach(prepared, inherited) {
            Ok(disk) => {
                let info = describe(&disk);
                self.disks().insert(name.clone(), DiskEntry::Attached(disk));
                tracing::info!(disk = %name, "attached");
                Ok(info)
            }
            Err(e) => {
                self.unreserve(&name);
                Err(e)
            }
        }
    }

    /// Gives up a prepared disk (its image is closed when `prepared` drops).
    pub fn abandon(&self, prepared: PreparedDisk) {
        self.unreserve(&prepared.config.name);
    }

    fn attach(
        &self,
        prepared: PreparedDisk,
        inherited: Option<InheritedSocket>,
    ) -> Result<Arc<AttachedDisk>> {
        let PreparedDisk {
            config,
            image,
            migrated_in,
        } = prepared;
        // Before anything serves: no write may escape the checkpoints' write-intent log.
        let checkpoints = match migrated_in {
            Some(received) => received,
            None => crate::disk_checkpoints::DiskCheckpoints::open(&config, &image),
        };
        let activity = DiskActivity::new();
        let vhost = match &config.vhost_user_blk {
            Some(socket) => {
                let access = crate::socket_access::SocketAccess::of(&config)
                    .map_err(|e| Error::usage(e.0))?;
                let opts = ServeOptions {
                    // Owner and mode are set before the socket appears at its path.
                    socket: access.socket_file(),
                    allowed_peer: access.peer,
                    ..serve_options(&config, &image.serial)
                };
                let mut server = match inherited {
                    Some(s) if &s.path == socket => Server::from_listener(
                        s.listener,
                        s.path,
                        s.file,
                        image.device.clone(),
                        opts,
                    ),
                    _ => Server::bind(socket, image.device.clone(), opts),
                }
                .context("starting the vhost-user-blk server")?;
                server.set_event_listener(switchover_on_vm_stop(
                    config.name.clone(),
                    activity.clone(),
                ));
                let stop = server.stop_handle();
                let events = self.events.clone();
                let name = config.name.clone();
                let served = self
                    .acceptor()?
                    .serve(
                        server,
                        Some(Box::new(move |e| {
                            let _ = events.send(Event::ServerFailed {
                                disk: name.clone(),
                                error: chain(&e),
                            });
                        })),
                    )
                    .context("starting the vhost-user-blk server")?;
                Some(VhostExport {
                    socket: socket.clone(),
                    stop,
                    served,
                })
            }
            None => None,
        };
        let nbd_exported = self.exports_nbd(&config);
        let reencryption = crate::reencrypt_job::ReencryptJob::new(image.segments());
        let disk = Arc::new(AttachedDisk {
            config,
            image,
            vhost,
            nbd_stats: Arc::new(IoStats::default()),
            nbd_exported,
            activity,
            reencryption,
            checkpoints,
        });
        if let (true, Some(registry)) = (nbd_exported, &self.nbd) {
            let device: Arc<dyn cryptblk_block::BlockDevice> = if disk.config.discard {
                disk.image.device.clone()
            } else {
                Arc::new(WithoutDiscard(disk.image.device.clone()))
            };
            let export = Export {
                name: disk.config.name.clone(),
                description: disk.config.image.to_string(),
                device,
                read_only: disk.read_only(),
                stats: disk.nbd_stats.clone(),
                tls_authz: crate::config::tls_authz(&disk.config)?,
                dirty_bitmaps: None,
                read_rate: None,
                trim_releases: false,
            };
            if let Err(e) = registry.add(export) {
                let _ = disk.stop_vhost();
                return Err(Error::caused("adding the NBD export", e));
            }
        }
        Ok(disk)
    }
}

/// The vhost-user event hook of a disk: when its VM is stopped for a live migration (the
/// frontend stops the queues with dirty-page logging on), a disk migration in precopy
/// switches over, in the mode it was started with.
fn switchover_on_vm_stop(
    name: String,
    activity: Arc<DiskActivity>,
) -> cryptblk_vhost_user_blk::EventListener {
    Arc::new(move |event| {
        tracing::info!(disk = %name, ?event, "vhost-user frontend");
        if event
            != (FrontendEvent::Stopped {
                dirty_logging: true,
            })
        {
            return;
        }
        if let Some(m) = activity.migration() {
            let status = m.status();
            // A switchover asked for already and waiting for the destination happens anyway.
            if status.phase == Phase::Precopy && !status.switchover_pending {
                match m.switchover_default() {
                    Ok(()) if m.status().switchover_pending => tracing::info!(
                        disk = %name,
                        "VM stopped; the switchover waits for the destination to serve the disk"
                    ),
                    Ok(()) => tracing::info!(disk = %name, "VM stopped, switching over"),
                    Err(e) => tracing::error!(disk = %name, "switchover failed: {}", chain(&e)),
                }
            }
        }
    })
}
