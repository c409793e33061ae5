//! The control methods on a disk's checkpoints (`checkpoint-add`, `checkpoint-list`,
//! `checkpoint-remove`); the store itself, opened with the disk, is `disk_checkpoints`.
use crate::disk::AttachedDisk;
use crate::disk_checkpoints::to_error;
use crate::error::{Error, Result};
use crate::registry::Daemon;
use cryptblk_control::api::{
    CheckpointAdded, CheckpointInfo, CheckpointList, CheckpointListParams, CheckpointParams,
    CheckpointRemoved, ErrorKind, MAX_LISTED_EXTENTS,
};
use cryptblk_volume::checkpoint::GRANULARITY;
use cryptblk_volume::{CheckpointError, CheckpointStore};
use std::sync::Arc;

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Daemon {
    /// The store of an attached file disk (created with `create`), refusing RBD images.
    pub(crate) fn checkpoint_store(
        &self,
        disk: &AttachedDisk,
        create: bool,
    ) -> Result<Option<Arc<CheckpointStore>>> {
        if disk.config.image.rbd().is_some() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "disk \"{}\" is an RBD image: checkpoints are kept in a directory beside an \
                     image file, and keeping them in the cluster is not built yet",
                    disk.name()
                ),
            ));
        }
        disk.checkpoints
            .get_or_open(&disk.config, &disk.image, create)
    }

    pub(crate) fn checkpoint_add(&self, p: &CheckpointParams) -> Result<CheckpointAdded> {
        let disk = self.attached(&p.name)?;
        let store = self
            .checkpoint_store(&disk, true)?
            .expect("created when missing");
        let created = now();
        store
            .add(&p.checkpoint, created)
            .map_err(|e| to_error(&format!("adding checkpoint {}", p.checkpoint), e))?;
        if disk.reencryption.is_running() {
            // Its rewriting bypasses the log: every byte changes after this checkpoint too.
            store
                .log()
                .record_all()
                .map_err(|e| to_error("recording the running reencryption", e))?;
        }
        tracing::info!(disk = %p.name, checkpoint = %p.checkpoint, "checkpoint added");
        Ok(CheckpointAdded {
            name: p.name.clone(),
            checkpoint: p.checkpoint.clone(),
            created,
        })
    }

    pub(crate) fn checkpoint_remove(&self, p: &CheckpointParams) -> Result<CheckpointRemoved> {
        let disk = self.attached(&p.name)?;
        if self.backup_uses(&p.name, &p.checkpoint) {
            return Err(Error::busy(format!(
                "disk \"{}\"'s backup export uses checkpoint {}: remove it after backup-end",
                p.name, p.checkpoint
            )));
        }
        let store = self.checkpoint_store(&disk, false)?.ok_or_else(|| {
            to_error(
                "removing a checkpoint",
                CheckpointError::NotFound(p.checkpoint.clone()),
            )
        })?;
        store
            .remove(&p.checkpoint)
            .map_err(|e| to_error(&format!("removing checkpoint {}", p.checkpoint), e))?;
        tracing::info!(disk = %p.name, checkpoint = %p.checkpoint, "checkpoint removed");
        Ok(CheckpointRemoved {
            name: p.name.clone(),
            checkpoint: p.checkpoint.clone(),
        })
    }

    pub(crate) fn checkpoint_list(&self, p: &CheckpointListParams) -> Result<CheckpointList> {
        let disk = self.attached(&p.name)?;
        let store = self.checkpoint_store(&disk, false)?;
        let image_size = disk.image.container.size();
        let Some(store) = store else {
            return Ok(CheckpointList {
                name: p.name.clone(),
                store: None,
                granularity: u64::from(GRANULARITY),
                image_size,
                checkpoints: Vec::new(),
            });
        };
        // The header changes outside the log (keyslots): always in an incremental.
        let header = disk.image.tracker.payload_offset();
        let mut checkpoints = Vec::new();
        for c in store.list() {
            let context = || format!("listing checkpoint {}", c.name);
            let dirty_bytes = store
                .dirty_bytes(&c.name, header, image_size)
                .map_err(|e| to_error(&context(), e))?;
            let (extents, truncated) = if p.extents {
                let mut runs = store
                    .dirty_runs(&c.name, 0, MAX_LISTED_EXTENTS + 1, header, image_size)
                    .map_err(|e| to_error(&context(), e))?;
                let truncated = runs.len() > MAX_LISTED_EXTENTS;
                runs.truncate(MAX_LISTED_EXTENTS);
                (
                    Some(runs.into_iter().map(|(o, l)| [o, l]).collect()),
                    truncated,
                )
            } else {
                (None, false)
            };
            checkpoints.push(CheckpointInfo {
                name: c.name,
                created: c.created,
                dirty_bytes,
                extents,
                truncated,
            });
        }
        Ok(CheckpointList {
            name: p.name.clone(),
            store: Some(store.dir().to_path_buf()),
            granularity: u64::from(store.granularity()),
            image_size,
            checkpoints,
        })
    }
}
