//! A backup export while it serves (what `backup-end` closes), the dirty bitmap it offers, and
//! how its listener is bound. The control methods that start and end one are in `backup`.
use crate::activity::BackingUp;
use cryptblk_block::{BlockError, BlockErrorKind};
use cryptblk_nbd::{
    ConnectionLimits, DirtyBitmaps, ExportRegistry, StopHandle, TlsCreds, DEFAULT_CONNECTION_LIMITS,
};
use cryptblk_volume::{CheckpointStore, CopyBeforeWrite, DirtyTracker};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

/// How the daemon binds a backup export's listener: as its own NBD server (`serve --nbd`,
/// `--tls-creds`, `--nbd-insecure`, `--nbd-max-connections`).
#[derive(Clone)]
pub struct BackupListener {
    pub tls: Option<TlsCreds>,
    /// Plain TCP on a non-loopback address was asked for on purpose.
    pub plain_tcp: bool,
    pub limits: ConnectionLimits,
}

impl Default for BackupListener {
    fn default() -> Self {
        BackupListener {
            tls: None,
            plain_tcp: false,
            limits: DEFAULT_CONNECTION_LIMITS,
        }
    }
}

/// A backup export serving.
pub(crate) struct Backup {
    pub(crate) checkpoint: String,
    pub(crate) incremental: Option<String>,
    pub(crate) registry: Arc<ExportRegistry>,
    pub(crate) export: String,
    pub(crate) stop: StopHandle,
    pub(crate) thread: Option<JoinHandle<()>>,
    /// Lifted by `close`, once nothing reads the image any more.
    pub(crate) marked: BackingUp,
    /// What keeps the export a point in time while the disk is written.
    pub(crate) cbw: Arc<CopyBeforeWrite>,
    pub(crate) tracker: Arc<DirtyTracker>,
}

/// Where a disk's copy-before-write scratch lives: beside its image file.
pub(crate) fn scratch_path(image: &Path) -> PathBuf {
    let mut path = image.as_os_str().to_owned();
    path.push(".cryptblk-backup-scratch");
    PathBuf::from(path)
}

/// A scratch left by a daemon that stopped during a backup (a crash, kill -9) holds nothing
/// anyone needs: the backup it served did not end. Removed before the disk serves.
pub(crate) fn remove_leftover_scratch(disk: &str, image: &Path) {
    let path = scratch_path(image);
    match std::fs::remove_file(&path) {
        Ok(()) => tracing::warn!(
            disk = %disk,
            "removed {}, left by a backup that did not end (its checkpoint stays until \
             checkpoint-remove)",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::error!(disk = %disk, "removing {}: {e}", path.display()),
    }
}

impl Backup {
    /// Closes the export (the connections' requests under way are answered first), its
    /// listener (the socket file goes with it) and the copy-before-write scratch.
    pub(crate) fn close(self) {
        let Backup {
            registry,
            export,
            stop,
            thread,
            marked,
            cbw,
            tracker,
            ..
        } = self;
        let _ = registry.remove(&export);
        stop.stop();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
        // Nothing reads the old bytes any more: writes go straight on, the scratch goes.
        tracker.stop_copy_before_write();
        if let Err(e) = std::fs::remove_file(cbw.scratch_path()) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::error!("removing {}: {e}", cbw.scratch_path().display());
            }
        }
        // Only now may the header change: nothing reads the image any more.
        drop(marked);
    }
}

/// What changed since a checkpoint, as the export's one dirty bitmap.
pub(crate) struct CheckpointBitmap {
    pub(crate) store: Arc<CheckpointStore>,
    pub(crate) checkpoint: String,
    /// The LUKS header's length: always reported changed (it changes outside the log).
    pub(crate) header: u64,
    pub(crate) size: u64,
}

impl DirtyBitmaps for CheckpointBitmap {
    fn names(&self) -> Vec<String> {
        vec![self.checkpoint.clone()]
    }

    fn dirty_runs(
        &self,
        name: &str,
        from: u64,
        limit: usize,
    ) -> std::result::Result<Vec<(u64, u64)>, BlockError> {
        if name != self.checkpoint {
            return Err(BlockError::unsupported(format!(
                "the backup export has no dirty bitmap {name}"
            )));
        }
        self.store
            .dirty_runs(&self.checkpoint, from, limit, self.header, self.size)
            .map_err(|e| {
                BlockError::new(
                    BlockErrorKind::Io,
                    format!("reading checkpoint {}: {e}", self.checkpoint),
                )
            })
    }
}
