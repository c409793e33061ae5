//! Checkpoints: named, persistent dirty bitmaps of a disk's image, for key-less incremental
//! backups (docs/backup.md). A checkpoint's bitmap says which 64 KiB regions of the image file
//! (header and ciphertext, in image-file offsets) changed since it was added.
//!
//! - [`CheckpointStore`] keeps them in a directory beside the image (`store.rs`, in the format
//!   of `format.rs`);
//! - [`IntentLog`] makes the newest one a write-intent log: a region's bit is on stable
//!   storage before a write to it is submitted, so a crash (kill -9, power loss) can only
//!   leave regions counted changed that were not, never a change uncounted (`intent.rs`);
//! - a live migration carries them (`CarriedCheckpoints`, `CheckpointImport`: `store/carry.rs`);
//! - the checkpoint stage puts the log on every queue of a tracked disk (`stage.rs`).

mod format;
mod generation;
mod intent;
mod store;

pub use format::{parse_any, valid_name, MAX_CHECKPOINTS, MAX_NAME};
pub(crate) use generation::Generation;
pub use intent::IntentLog;
pub use store::{
    store_dir, CarriedCheckpoint, CarriedCheckpoints, CheckpointImport, CheckpointInfo,
    CheckpointStore, GRANULARITY, MAX_CARRIED_RUNS,
};

use std::path::{Path, PathBuf};

/// Why a checkpoint operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {why}; remove the directory {} to drop the disk's checkpoints (the next backup must then be full)",
        path.display(), path.parent().map_or_else(|| path.display().to_string(), |d| d.display().to_string()))]
    Damaged { path: PathBuf, why: String },
    #[error("the disk has no checkpoint {0} (ctl checkpoint-list shows those it has)")]
    NotFound(String),
    #[error("{0}")]
    Refused(String),
}

impl CheckpointError {
    pub(crate) fn io(what: &'static str, path: &Path, source: std::io::Error) -> CheckpointError {
        CheckpointError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}
