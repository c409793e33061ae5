//! The control methods `backup-start` and `backup-end`: a disk's key-less backup export.
//!
//! The export serves the image file's own bytes (the LUKS header and the ciphertext, never
//! the decrypted disk) read-only on a listener of its own, so that the backup host reaches
//! this export and nothing else of the daemon. It offers `base:allocation` and, for an
//! incremental, `qemu:dirty-bitmap:FROM` from the disk's checkpoint store. The listener is
//! bound as the daemon's NBD server is: with the daemon's TLS credentials and allow-list when
//! it has them (plain only on a UNIX socket or loopback otherwise), the same connection
//! limits, socket mode 0600.
//!
//! The export is a point in time while the VM writes: the export serves a `BackupView`, and
//! the disk's tracker copies a region's old bytes to a bounded scratch file beside the image
//! before its first change (`cryptblk_volume::CopyBeforeWrite`). A full scratch fails the
//! backup (the export answers EIO, `backup-end` wants `failed`), never the guest. A client's
//! TRIM on the (read-only) export releases what it has stored (`CopyBeforeWrite::release`).
//!
//! The export yields to the VM: while the disk's users are doing I/O, its reads take at most
//! `background-share` of the time (`BackupView::yielding`); an incremental copies before a
//! write only the regions it serves (`CopyBeforeWrite::limit_to`). With `max-bandwidth`, the
//! export's reads are also paced (`cryptblk_nbd::ReadPacer`), all connections together.
use crate::backup_export::{Backup, CheckpointBitmap};
use crate::disk_checkpoints::to_error;
use crate::error::{Error, Result};
use crate::migrate::parse_address;
use crate::registry::Daemon;
use cryptblk_block::{BlockDevice, IoStats};
use cryptblk_control::api::{
    BackupEndParams, BackupEnded, BackupStartParams, BackupStarted, ErrorKind,
    DEFAULT_BACKGROUND_SHARE, DEFAULT_SCRATCH_SIZE,
};
use cryptblk_nbd::protocol::DIRTY_BITMAP_PREFIX;
use cryptblk_nbd::{DirtyBitmaps, Export, ExportRegistry, NbdServer, ReadGate, ReadPacer};
use cryptblk_volume::{BackgroundReads, BackupView, CopyBeforeWrite, COPY_REGION, DRAIN_TIMEOUT};
use std::sync::{Arc, PoisonError};

/// The lowest `max-bandwidth`: one largest NBD read (32 MiB) per 32 s.
const MIN_BANDWIDTH: u64 = 1 << 20;

/// When a backup export's reads may start: within the backup's share of a busy disk's time,
/// and within `max-bandwidth` when one is set.
struct BackupReadGate {
    yielding: Arc<BackgroundReads>,
    ceiling: Option<ReadPacer>,
}

impl ReadGate for BackupReadGate {
    fn admit(
        &self,
        len: u64,
        now: std::time::Instant,
    ) -> std::result::Result<(), std::time::Duration> {
        self.yielding.admit(len, now)?;
        match &self.ceiling {
            Some(ceiling) => ceiling.admit_at(len, now),
            None => Ok(()),
        }
    }

    fn describe(&self) -> String {
        let share = format!(
            "{} % of the time while the VM is busy",
            self.yielding.percent()
        );
        match &self.ceiling {
            Some(ceiling) => format!("{share}, {}", ceiling.describe()),
            None => share,
        }
    }
}

/// A new backup's identity: 128 random bits in hex. Two backups of one disk at one
/// checkpoint (one failed, one started again) hold different bytes; their ids tell a pull so.
fn backup_id() -> Result<String> {
    let mut bits = [0u8; 16];
    openssl::rand::rand_bytes(&mut bits)
        .map_err(|e| Error::caused("choosing the backup's id (the random generator)", e))?;
    Ok(bits.iter().map(|b| format!("{b:02x}")).collect())
}

/// The backup export's NBD description. It starts with `backup ID`: `backup pull` compares
/// descriptions to know it reads the same backup as the pull it continues.
fn export_description(id: &str, disk: &str, checkpoint: &str) -> String {
    format!(
        "backup {id} of disk {disk} at checkpoint {checkpoint}: the image's bytes (LUKS \
         header and ciphertext) as they were when it started"
    )
}

impl Daemon {
    pub(crate) fn backup_start(&self, p: &BackupStartParams) -> Result<BackupStarted> {
        let disk = self.attached(&p.name)?;
        let address = parse_address(&p.nbd)?;
        if let Some(from) = &p.incremental {
            if *from == p.checkpoint {
                return Err(Error::usage(format!(
                    "the backup's checkpoint and the one it is incremental from are both \
                     {from}: name a new checkpoint for this backup"
                )));
            }
        }
        let scratch_size = p.scratch_size.unwrap_or(DEFAULT_SCRATCH_SIZE);
        if scratch_size < COPY_REGION {
            return Err(Error::usage(format!(
                "a scratch-size of {scratch_size} bytes holds no {COPY_REGION}-byte region: \
                 give at least 4K (default 1G)"
            )));
        }
        // 0: no ceiling, as for reencrypt-start.
        let max_bandwidth = p.max_bandwidth.filter(|&rate| rate > 0);
        if let Some(rate) = max_bandwidth {
            if rate < MIN_BANDWIDTH {
                return Err(Error::usage(format!(
                    "a max-bandwidth of {rate} bytes per second is below the least, 1M (or 0: \
                     no ceiling): a 32 MiB read would wait more than half a minute"
                )));
            }
        }
        let background_share = p.background_share.unwrap_or(DEFAULT_BACKGROUND_SHARE);
        if !(1..=100).contains(&background_share) {
            return Err(Error::usage(format!(
                "a background-share of {background_share} is not a percentage from 1 to 100 \
                 (default {DEFAULT_BACKGROUND_SHARE}; 100: the backup never yields to the VM)"
            )));
        }
        let store = self
            .checkpoint_store(&disk, true)?
            .expect("created when missing");
        if let Some(from) = &p.incremental {
            if !store.contains(from) {
                return Err(Error::usage(format!(
                    "disk \"{}\" has no checkpoint {from}: list them with checkpoint-list, or \
                     take a full backup (without incremental)",
                    p.name
                )));
            }
        }
        let id = backup_id()?;
        let marked = disk.activity.begin_backup(&p.name)?;
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        store
            .add(&p.checkpoint, created)
            .map_err(|e| to_error(&format!("adding checkpoint {}", p.checkpoint), e))?;
        let remove_checkpoint = || {
            if let Err(e) = store.remove(&p.checkpoint) {
                tracing::error!(
                    disk = %p.name,
                    "removing checkpoint {} after a failed backup-start: {e}",
                    p.checkpoint
                );
            }
        };

        let container = disk.image.container.clone();
        let source: Arc<dyn BlockDevice> = container;
        let size = source.size();
        let header = disk.image.tracker.payload_offset();
        let scratch = crate::backup_export::scratch_path(disk.config.image.path());
        // After the checkpoint was added: every write after this moment is recorded in it.
        let cbw = match CopyBeforeWrite::create(source.clone(), &scratch, scratch_size) {
            Ok(cbw) => Arc::new(cbw),
            Err(e) => {
                remove_checkpoint();
                return Err(Error::caused(
                    "creating the backup's copy-before-write scratch",
                    e,
                ));
            }
        };
        let tracker = disk.image.tracker.clone();
        if let Err(e) = tracker.start_copy_before_write(cbw.clone(), DRAIN_TIMEOUT) {
            remove_checkpoint();
            return Err(Error::caused("starting the backup's copy-before-write", e));
        }
        let stop_copying = || tracker.stop_copy_before_write();
        // The backup's moment is now: what changed since FROM is fixed here.
        let dirty_bitmaps = match &p.incremental {
            None => None,
            Some(from) => match CheckpointBitmap::snapshot(&store, from, header, size) {
                Ok(bitmap) => {
                    // What did not change since FROM is not served, so not copied either.
                    let why = format!(
                        "this incremental backup serves only what changed since checkpoint \
                         {from} (the extents of {DIRTY_BITMAP_PREFIX}{from}): read those, or \
                         take a full backup"
                    );
                    if let Err(e) = cbw.limit_to(bitmap.regions(), why) {
                        stop_copying();
                        remove_checkpoint();
                        return Err(Error::caused("limiting the backup to its regions", e));
                    }
                    Some(Arc::new(bitmap) as Arc<dyn DirtyBitmaps>)
                }
                Err(why) => {
                    stop_copying();
                    remove_checkpoint();
                    return Err(Error::new(ErrorKind::Io, why));
                }
            },
        };
        let yielding = Arc::new(BackgroundReads::new(tracker.activity(), background_share));
        let device: Arc<dyn BlockDevice> =
            Arc::new(BackupView::new(source, cbw.clone()).yielding(yielding.clone()));
        let read_gate: Option<Arc<dyn ReadGate>> = match (background_share, max_bandwidth) {
            (100, None) => None,
            (100, Some(rate)) => Some(Arc::new(ReadPacer::new(rate))),
            (_, rate) => Some(Arc::new(BackupReadGate {
                yielding,
                ceiling: rate.map(ReadPacer::new),
            })),
        };
        let registry = ExportRegistry::new();
        let export = Export {
            name: p.name.clone(),
            description: export_description(&id, &p.name, &p.checkpoint),
            device,
            read_only: true,
            // The pull's TRIMs release what it stored (CopyBeforeWrite::release).
            trim_releases: true,
            stats: Arc::new(IoStats::default()),
            tls_authz: None,
            dirty_bitmaps,
            read_rate: read_gate,
        };
        if let Err(e) = registry.add(export) {
            stop_copying();
            remove_checkpoint();
            return Err(Error::caused("setting up the backup export", e));
        }
        let settings = &self.backup_listener;
        let bound = match settings.tls.clone() {
            None if settings.plain_tcp => NbdServer::bind_plain_tcp(&address, registry.clone()),
            tls => NbdServer::bind(&address, registry.clone(), tls),
        };
        let server = match bound {
            Ok(server) => server.with_connection_limits(settings.limits),
            Err(e) => {
                stop_copying();
                remove_checkpoint();
                let kind = match e {
                    cryptblk_nbd::Error::PlainTcp { .. } => ErrorKind::Usage,
                    _ => ErrorKind::Conflict,
                };
                return Err(Error::new(
                    kind,
                    format!("listening for the backup export on {}: {e}", p.nbd),
                ));
            }
        };
        let listen = server.local_addr();
        let stop = server.stop_handle();
        let name = p.name.clone();
        let thread = std::thread::Builder::new()
            .name("backup-nbd".into())
            .spawn(move || {
                if let Err(e) = server.run() {
                    tracing::error!(disk = %name, "the backup export's NBD server failed: {e}");
                }
            });
        let thread = match thread {
            Ok(thread) => thread,
            Err(e) => {
                stop_copying();
                remove_checkpoint();
                return Err(Error::caused("starting the backup export's thread", e));
            }
        };
        let backup = Backup {
            checkpoint: p.checkpoint.clone(),
            incremental: p.incremental.clone(),
            registry,
            export: p.name.clone(),
            stop,
            thread: Some(thread),
            marked,
            cbw: cbw.clone(),
            tracker: tracker.clone(),
        };
        self.backups
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(p.name.clone(), backup);
        tracing::info!(
            disk = %p.name,
            checkpoint = %p.checkpoint,
            incremental = ?p.incremental,
            backup = %id,
            "backup export serving on {listen}"
        );
        Ok(BackupStarted {
            name: p.name.clone(),
            checkpoint: p.checkpoint.clone(),
            id,
            incremental: p.incremental.clone(),
            nbd: listen,
            export: p.name.clone(),
            bitmap: p
                .incremental
                .as_ref()
                .map(|from| format!("{DIRTY_BITMAP_PREFIX}{from}")),
            size,
            scratch: scratch.display().to_string(),
            scratch_size: cbw.capacity(),
            max_bandwidth,
            background_share,
        })
    }

    pub(crate) fn backup_end(&self, p: &BackupEndParams) -> Result<BackupEnded> {
        let disk = self.attached(&p.name)?;
        let mut backups = self.backups.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(why) = backups.get(&p.name).and_then(|b| b.cbw.failure()) {
            if !p.failed {
                return Err(Error::new(
                    ErrorKind::Conflict,
                    format!(
                        "disk \"{}\": the backup failed, what was pulled is not a point in \
                         time: {why}",
                        p.name
                    ),
                ));
            }
        }
        let backup = backups.remove(&p.name).ok_or_else(|| {
            Error::new(
                ErrorKind::Conflict,
                format!(
                    "disk \"{}\" has no backup export (see backup-start)",
                    p.name
                ),
            )
        })?;
        drop(backups);
        let checkpoint = backup.checkpoint.clone();
        backup.close();
        if p.failed {
            self.drop_backup_checkpoint(&disk, &checkpoint)?;
        }
        tracing::info!(
            disk = %p.name,
            checkpoint = %checkpoint,
            failed = p.failed,
            "backup export closed"
        );
        Ok(BackupEnded {
            name: p.name.clone(),
            checkpoint,
            kept: !p.failed,
        })
    }

    /// A failed backup's checkpoint goes; its bits fold into the checkpoint before it, so the
    /// next incremental from that one copies them again.
    fn drop_backup_checkpoint(
        &self,
        disk: &crate::disk::AttachedDisk,
        checkpoint: &str,
    ) -> Result<()> {
        let store = self
            .checkpoint_store(disk, true)?
            .expect("created when missing");
        store
            .remove(checkpoint)
            .map_err(|e| to_error(&format!("removing checkpoint {checkpoint}"), e))
    }

    /// For `disk-remove` and the daemon's stop: a backup still serving is ended as failed
    /// (nobody said it completed), so no change is lost to the next incremental.
    pub(crate) fn end_backup_on_detach(&self, disk: &crate::disk::AttachedDisk) {
        let backup = self
            .backups
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(disk.name());
        if let Some(backup) = backup {
            let checkpoint = backup.checkpoint.clone();
            backup.close();
            tracing::warn!(
                disk = %disk.name(),
                "the disk's backup export was closed before backup-end: checkpoint \
                 {checkpoint} is removed as after a failed backup"
            );
            if let Err(e) = self.drop_backup_checkpoint(disk, &checkpoint) {
                tracing::error!(disk = %disk.name(), "{}", crate::error::chain(&e));
            }
        }
    }

    /// Whether the disk's backup export uses `checkpoint` (as its own or the one it is
    /// incremental from): it may not be removed meanwhile.
    pub(crate) fn backup_uses(&self, disk: &str, checkpoint: &str) -> bool {
        self.backups
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(disk)
            .is_some_and(|b| {
                b.checkpoint == checkpoint || b.incremental.as_deref() == Some(checkpoint)
            })
    }
}
