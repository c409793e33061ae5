//! A disk's checkpoint store: the one beside its image file (`cryptblk_volume::checkpoint`),
//! opened before the disk serves so that no write escapes the write-intent log, also after a
//! restart or an upgrade (the successor opens it once the predecessor released the disk, when
//! nothing else writes it), or carried by a live migration (`receive`: writes are recorded
//! from the first one the destination serves). The control methods on it are in
//! `checkpoints`.
use crate::error::{Error, Result};
use cryptblk_control::api::{DiskConfig, ErrorKind};
use cryptblk_migration::{CheckpointSource, IncomingMigration};
use cryptblk_volume::checkpoint::{store_dir, CarriedCheckpoints, CheckpointImport, GRANULARITY};
use cryptblk_volume::{CheckpointError, CheckpointStore, Volume};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// How long `checkpoint-*` wait for the checkpoints a migration carried to be written (a few
/// fsyncs per checkpoint) once the switchover brought them.
const WRITING_WAIT: Duration = Duration::from_secs(60);

/// A disk's checkpoint store, once it has (or had) a checkpoint. Clones share it (a
/// migration's hook fills in the store it carried).
#[derive(Default, Clone)]
pub(crate) struct DiskCheckpoints(Arc<Slot>);

#[derive(Default)]
struct Slot {
    state: Mutex<State>,
    written: Condvar,
}

#[derive(Default)]
struct State {
    store: Option<Arc<CheckpointStore>>,
    coming: Coming,
}

/// Where checkpoints a live migration carries are.
#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Coming {
    #[default]
    Nothing,
    /// The switchover will bring them.
    AtSwitchover,
    /// The switchover brought them; they are being written (the disk serves meanwhile, its
    /// writes recorded in the interim bitmap).
    Writing,
}

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
            Ok(store) => DiskCheckpoints(Arc::new(Slot {
                state: Mutex::new(State {
                    store,
                    coming: Coming::Nothing,
                }),
                written: Condvar::new(),
            })),
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
        let state = self.lock();
        let (mut state, _) = self
            .0
            .written
            .wait_timeout_while(state, WRITING_WAIT, |s| s.coming == Coming::Writing)
            .unwrap_or_else(PoisonError::into_inner);
        match state.coming {
            Coming::AtSwitchover => {
                return Err(Error::busy(
                    "the disk is being migrated in: its checkpoints come with the switchover",
                ))
            }
            Coming::Writing => {
                return Err(Error::busy(
                    "the checkpoints the migration carried are still being written; try again",
                ))
            }
            Coming::Nothing => {}
        }
        if state.store.is_none() {
            state.store = open_store(config, image, create)?;
        }
        Ok(state.store.clone())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What a migration of the disk carries: the store's checkpoints as they are at the
    /// switchover (the disk fenced), none when the disk has no store.
    pub(crate) fn source(&self, image_size: u64) -> CheckpointSource {
        let this = self.clone();
        CheckpointSource(Arc::new(move || {
            // A disk migrated in moments ago may still be writing what it received.
            let state = this.lock();
            let (state, _) = this
                .0
                .written
                .wait_timeout_while(state, WRITING_WAIT, |s| s.coming == Coming::Writing)
                .unwrap_or_else(PoisonError::into_inner);
            Ok(match &state.store {
                Some(store) => store.export(),
                None => CarriedCheckpoints {
                    granularity: GRANULARITY,
                    covered: image_size,
                    checkpoints: Vec::new(),
                },
            })
        }))
    }

    /// The checkpoints of a disk a live migration brings in, opened before it serves: a store
    /// found beside the new image is not this disk's and is moved aside; then, when the source
    /// carries its checkpoints, every write is recorded from the first one the destination
    /// serves while they arrive, and the store they make is the disk's from the switchover on
    /// (`checkpoint-*` are busy until then). A source that carries none (an older cryptblk),
    /// or checkpoints that cannot be written, leave the disk without: the next backup must be
    /// full.
    pub(crate) fn receive(
        config: &DiskConfig,
        image: &Volume,
        incoming: &IncomingMigration,
    ) -> DiskCheckpoints {
        if config.image.rbd().is_some() {
            return DiskCheckpoints::default();
        }
        let dir = store_dir(config.image.path());
        set_aside(&config.name, &dir);
        if !incoming.carries_checkpoints() {
            tracing::info!(
                disk = %config.name,
                "the migration's source carries no checkpoints (a cryptblk from before they \
                 were carried): the disk has none, the next backup must be full"
            );
            return DiskCheckpoints::default();
        }
        let log = image.tracker.intent_log().clone();
        let import = match CheckpointImport::begin(&dir, image.container.size(), log) {
            Ok(import) => import,
            Err(e) => {
                tracing::error!(
                    disk = %config.name,
                    "cannot receive the disk's checkpoints ({e}): the disk has none, the next \
                     backup must be full"
                );
                return DiskCheckpoints::default();
            }
        };
        let checkpoints = DiskCheckpoints::default();
        checkpoints.lock().coming = Coming::AtSwitchover;
        let (arrived, name) = (checkpoints.clone(), config.name.clone());
        incoming.on_checkpoints(Box::new(move |carried| {
            // Written beside the serving disk, not in the switchover's downtime.
            arrived.lock().coming = Coming::Writing;
            let (this, disk) = (arrived.clone(), name.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("checkpoints-{name}"))
                .spawn(move || this.arrive(&disk, import, carried));
            if let Err(e) = spawned {
                tracing::error!(disk = %name, "cannot start writing the carried checkpoints: {e}");
                arrived.lock().coming = Coming::Nothing;
                arrived.0.written.notify_all();
            }
        }));
        checkpoints
    }

    /// The switchover brought `carried` (`None`: the source sent none).
    fn arrive(&self, disk: &str, import: CheckpointImport, carried: Option<CarriedCheckpoints>) {
        let imported = match &carried {
            Some(c) => import.finish(c),
            None => Ok(None),
        };
        let mut state = self.lock();
        match imported {
            Ok(Some(received)) => {
                tracing::info!(
                    disk,
                    checkpoints = received.list().len(),
                    "the disk's checkpoints came with the migration"
                );
                state.store = Some(Arc::new(received));
            }
            Ok(None) if carried.is_some() => {
                tracing::info!(disk, "the migration's source had no checkpoints")
            }
            Ok(None) => {
                tracing::warn!(
                    disk,
                    "the migration's source sent no checkpoints (they could not be had there): \
                     the disk has none, the next backup must be full"
                );
                abandon(disk, import);
            }
            Err(e) => {
                tracing::error!(
                    disk,
                    "the checkpoints the migration carried cannot be kept ({e}): the disk has \
                     none, the next backup must be full"
                );
                abandon(disk, import);
            }
        }
        state.coming = Coming::Nothing;
        self.0.written.notify_all();
    }

    /// A migration that failed before its switchover: what was made for its checkpoints goes
    /// with its image.
    pub(crate) fn discard_arriving(&self, image: &Path) {
        let mut state = self.lock();
        if std::mem::take(&mut state.coming) != Coming::Nothing {
            let _ = std::fs::remove_dir_all(store_dir(image));
        }
        self.0.written.notify_all();
    }
}

fn abandon(disk: &str, import: CheckpointImport) {
    if let Err(e) = import.abandon() {
        tracing::warn!(disk, "dropping the checkpoints' interim log: {e}");
    }
}

/// A store beside an image a migration brings in belongs to another disk (an image removed
/// by hand, its store left): moved aside (`<store>.before-migration`), so no backup trusts it.
fn set_aside(disk: &str, dir: &Path) {
    if !dir.exists() {
        return;
    }
    let mut aside = dir.to_path_buf().into_os_string();
    aside.push(".before-migration");
    let _ = std::fs::remove_dir_all(&aside);
    match std::fs::rename(dir, &aside) {
        Ok(()) => tracing::warn!(
            disk,
            "a checkpoint store was beside the image a migration brings in: {} moved to {}",
            dir.display(),
            Path::new(&aside).display()
        ),
        Err(e) => tracing::error!(
            disk,
            "a checkpoint store is beside the image a migration brings in, and {} could not be \
             moved aside ({e}): remove it",
            dir.display()
        ),
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
