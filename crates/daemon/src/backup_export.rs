//! A backup export while it serves (what `backup-end` closes), the dirty bitmap it offers, and
//! how its listener is bound. The control methods that start and end one are in `backup`.
use crate::activity::BackingUp;
use cryptblk_block::{BlockError, BlockErrorKind};
use cryptblk_nbd::{
    ConnectionLimits, DirtyBitmaps, ExportRegistry, StopHandle, TlsCreds, DEFAULT_CONNECTION_LIMITS,
};
use cryptblk_volume::CheckpointStore;
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
}

impl Backup {
    /// Closes the export (the connections' requests under way are answered first) and its
    /// listener (the socket file goes with it).
    pub(crate) fn close(self) {
        let Backup {
            registry,
            export,
            stop,
            thread,
            marked,
            ..
        } = self;
        let _ = registry.remove(&export);
        stop.stop();
        if let Some(thread) = thread {
            let _ = thread.join();
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
