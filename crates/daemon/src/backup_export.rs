//! A backup export while it serves (what `backup-end` closes), the dirty bitmap it offers, and
//! how its listener is bound. The control methods that start and end one are in `backup`.
use crate::activity::BackingUp;
use cryptblk_block::BlockError;
use cryptblk_nbd::{
    ConnectionLimits, DirtyBitmaps, ExportRegistry, StopHandle, TlsCreds, DEFAULT_CONNECTION_LIMITS,
};
use cryptblk_volume::checkpoint::GRANULARITY;
use cryptblk_volume::{CheckpointStore, CopyBeforeWrite, DirtyBitmap, DirtyTracker};
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

/// What changed since a checkpoint up to the backup's moment, as the export's one dirty
/// bitmap. Taken once the copy-before-write started, as QEMU's exported bitmap is frozen
/// when its backup starts: what the VM writes later is recorded in the backup's own
/// checkpoint, for the next incremental, and is not this backup's business (its old bytes,
/// which this backup serves, were unchanged since FROM). A write racing the start may be
/// counted: a region more, never one less. Memory: one bit per 64 KiB of image.
pub(crate) struct CheckpointBitmap {
    checkpoint: String,
    changed: DirtyBitmap,
}

impl CheckpointBitmap {
    /// The regions changed since `checkpoint` now, of an image of `size` bytes whose first
    /// `header` bytes (the LUKS header, changed outside the log) always count as changed.
    pub(crate) fn snapshot(
        store: &CheckpointStore,
        checkpoint: &str,
        header: u64,
        size: u64,
    ) -> Result<CheckpointBitmap, String> {
        let changed = DirtyBitmap::new(size, u64::from(GRANULARITY)).map_err(|e| e.0)?;
        let mut from = 0;
        loop {
            let runs = store
                .dirty_runs(checkpoint, from, RUNS_PER_CALL, header, size)
                .map_err(|e| format!("reading checkpoint {checkpoint}: {e}"))?;
            for &(offset, len) in &runs {
                changed.set_range(offset, len);
                from = offset + len;
            }
            if runs.len() < RUNS_PER_CALL {
                break;
            }
        }
        Ok(CheckpointBitmap {
            checkpoint: checkpoint.to_string(),
            changed,
        })
    }
}

impl CheckpointBitmap {
    /// The regions changed, one bit per [`GRANULARITY`] bytes of the image.
    pub(crate) fn regions(&self) -> &DirtyBitmap {
        &self.changed
    }
}

/// Runs read from the store per call while a snapshot is taken (the store's lock is held for
/// one call).
const RUNS_PER_CALL: usize = 4096;

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
        let mut runs = Vec::new();
        let mut block = from / self.changed.granularity();
        while runs.len() < limit {
            let Some((first, count)) = self.changed.next_run(block, true) else {
                break;
            };
            runs.push(self.changed.block_range(first, count));
            block = first + count;
        }
        Ok(runs)
    }
}
