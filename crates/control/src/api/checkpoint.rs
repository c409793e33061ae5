//! `checkpoint-add`, `checkpoint-list`, `checkpoint-remove`: a disk's checkpoints, the named
//! dirty bitmaps an incremental backup copies by (docs/backup.md).
use serde::{Deserialize, Serialize};

/// `checkpoint-add` and `checkpoint-remove`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointParams {
    /// The disk.
    pub name: String,
    /// The checkpoint: 1 to 64 of `A-Za-z0-9._-`, not starting with `.`.
    pub checkpoint: String,
}

/// `checkpoint-list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointListParams {
    pub name: String,
    /// Also list each checkpoint's changed ranges of the image.
    #[serde(default)]
    pub extents: bool,
}

/// `checkpoint-add`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointAdded {
    pub name: String,
    pub checkpoint: String,
    /// Seconds since 1970 (UTC).
    pub created: u64,
}

/// `checkpoint-remove`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointRemoved {
    pub name: String,
    pub checkpoint: String,
}

/// `checkpoint-list`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct CheckpointList {
    pub name: String,
    /// Where the checkpoints are kept (beside the image); absent while the disk has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<std::path::PathBuf>,
    /// Bytes of image one bit of a bitmap stands for.
    pub granularity: u64,
    /// The image's size, which the ranges lie in.
    pub image_size: u64,
    /// Oldest first.
    pub checkpoints: Vec<CheckpointInfo>,
}

/// One checkpoint of `checkpoint-list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct CheckpointInfo {
    pub name: String,
    /// Seconds since 1970 (UTC).
    pub created: u64,
    /// Bytes of the image changed since it was added (whole regions of `granularity`, the
    /// LUKS header always counted).
    pub dirty_bytes: u64,
    /// With `extents`: the changed ranges of the image, `[offset, length]`, sorted, at most
    /// [`MAX_LISTED_EXTENTS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extents: Option<Vec<[u64; 2]>>,
    /// With `extents`: more ranges than were listed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// Ranges `checkpoint-list --extents` lists per checkpoint at most (the answer stays a few
/// MiB whatever the disk).
pub const MAX_LISTED_EXTENTS: usize = 65_536;
