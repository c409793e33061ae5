//! A disk's checkpoint store: the one beside its image file (`cryptblk_volume::checkpoint`),
//! opened before the disk serves so that no write escapes the write-intent log, also after a
//! restart or an upgrade (the successor opens it once the predecessor released the disk, when
//! nothing else writes it). The control methods on it are in `checkpoints`.
use crate::error::{Error, Result};
use cryptblk_control::api::{DiskConfig, ErrorKind};
use cryptblk_volume::checkpoint::store_dir;
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
        crate::backup_export::remove_leftover_scratch(&config.name, config.image.path());
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

    /// The store, opened now (made, with `create`) if the disk has none open yet.
    pub(crate) fn get_or_open(
        &self,
        config: &DiskConfig,
        image: &Volume,
        create: bool,
    ) -> Result<Option<Arc<CheckpointStore>>> {
        let mut store = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if store.is_none() {
            *store = open_store(config, image, create)?;
        }
        Ok(store.clone())
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

pub(crate) fn to_error(context: &str, e: CheckpointError) -> Error {
    let kind = match &e {
        CheckpointError::Io { .. } => ErrorKind::Io,
        CheckpointError::Damaged { .. } => ErrorKind::Damaged,
        _ => ErrorKind::Usage,
    };
    Error::new(kind, format!("{context}: {e}"))
}
