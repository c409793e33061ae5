//! A disk's checkpoints (`checkpoint-add`, `checkpoint-list`, `checkpoint-remove`): the store
//! beside its image file (`cryptblk_volume::checkpoint`), opened before the disk serves so that
//! no write escapes the write-intent log, also after a restart or an upgrade (the successor
//! opens it once the predecessor released the disk, when nothing else writes it).
use crate::disk::AttachedDisk;
use crate::error::{Error, Result};
use crate::registry::Daemon;
use cryptblk_control::api::{
    CheckpointAdded, CheckpointInfo, CheckpointList, CheckpointListParams, CheckpointParams,
    CheckpointRemoved, DiskConfig, ErrorKind, MAX_LISTED_EXTENTS,
};
use cryptblk_volume::checkpoint::{store_dir, GRANULARITY};
use cryptblk_volume::{CheckpointError, CheckpointStore, Volume};
use std::sync::{Arc, Mutex, PoisonError};

/// A disk's checkpoint store, once it has (or had) a checkpoint.
#[derive(Default)]
pub(crate) struct DiskCheckpoints(Mutex<Option<Arc<CheckpointStore>>>);

impl DiskCheckpoints {
    /// The store of a disk about to serve, if its image has one. A store that cannot be read
    /// leaves the disk serving without it (its checkpoints are unusable either way: the next
    /// backup must be full), said in the log; `checkpoint-*` then report why.
    pub(crate) fn open(config: &DiskConfig, image: &Volume) -> DiskCheckpoints {
        if config.image.rbd().is_some() {
            return DiskCheckpoints::default();
        }
        match open_store(config, image, false) {
            Ok(store) => DiskCheckpoints(Mutex::new(store)),
            Err(e) => {
                tracing::error!(
                    disk = %config.name,
                    "the disk's checkpoints cannot be used: {}",
                    crate::error::chain(&e)
                );
                DiskCheckpoints::default()
            }
        }
    }

    /// A disk received by a live migration: checkpoints do not come along yet, and a store
    /// beside the image (the same file, on shared storage) is the source's, which misses what
    /// this daemon will write. It is moved aside (`<store>.before-migration`), so no backup
    /// trusts it; the next backup must be full. The source's log keeps writing its own open
    /// files, harmlessly.
    pub(crate) fn set_aside(config: &DiskConfig) -> DiskCheckpoints {
        if config.image.rbd().is_some() {
            return DiskCheckpoints::default();
        }
        let dir = store_dir(config.image.path());
        if dir.exists() {
            let mut aside = dir.clone().into_os_string();
            aside.push(".before-migration");
            let _ = std::fs::remove_dir_all(&aside);
            match std::fs::rename(&dir, &aside) {
                Ok(()) => tracing::warn!(
                    disk = %config.name,
                    "checkpoints are not carried by a live migration yet: {} moved to {}; the \
                     next backup must be full",
                    dir.display(),
                    std::path::Path::new(&aside).display()
                ),
                Err(e) => tracing::error!(
                    disk = %config.name,
                    "checkpoints are not carried by a live migration yet, and {} could not be \
                     moved aside ({e}): remove it; the next backup must be full",
                    dir.display()
                ),
            }
        }
        DiskCheckpoints::default()
    }
}

fn open_store(
    config: &DiskConfig,
    image: &Volume,
    create: bool,
) -> Result<Option<Arc<CheckpointStore>>> {
    let dir = store_dir(config.image.path());
    let opened = CheckpointStore::open(
        &dir,
        image.container.size(),
        image.tracker.intent_log().clone(),
        create,
    )
    .map_err(|e| to_error("opening the checkpoint store", e))?;
    Ok(opened.map(|(store, warnings)| {
        for w in warnings {
            tracing::warn!(disk = %config.name, "{w}");
        }
        Arc::new(store)
    }))
}

fn to_error(context: &str, e: CheckpointError) -> Error {
    let kind = match &e {
        CheckpointError::Io { .. } => ErrorKind::Io,
        CheckpointError::Damaged { .. } => ErrorKind::Damaged,
        _ => ErrorKind::Usage,
    };
    Error::new(kind, format!("{context}: {e}"))
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Daemon {
    /// The store of an attached file disk (created with `create`), refusing RBD images.
    fn checkpoint_store(
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
        let mut store = disk
            .checkpoints
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if store.is_none() {
            *store = open_store(&disk.config, &disk.image, create)?;
        }
        Ok(store.clone())
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
