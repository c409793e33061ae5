//! `backup-start`, `backup-end`: a disk's key-less backup export, the image's own bytes
//! (LUKS header and ciphertext) served read-only over NBD with the dirty bitmap of a
//! checkpoint (docs/backup.md).
use serde::{Deserialize, Serialize};

/// `backup-start`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackupStartParams {
    /// The disk.
    pub name: String,
    /// The checkpoint this backup is taken at: added when the backup starts, kept by a
    /// successful `backup-end`, removed by a failed one.
    pub checkpoint: String,
    /// An existing checkpoint: its dirty bitmap is served as `qemu:dirty-bitmap:NAME`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incremental: Option<String>,
    /// Where the export listens: `unix:PATH` or `tcp:HOST:PORT` (port 0 picks one).
    pub nbd: String,
    /// Bytes of old image data the copy-before-write scratch may hold (default
    /// [`DEFAULT_SCRATCH_SIZE`]); when the disk changes more than that during the backup, the
    /// backup fails (the guest's writes go on).
    #[serde(
        default,
        rename = "scratch-size",
        skip_serializing_if = "Option::is_none"
    )]
    pub scratch_size: Option<u64>,
    /// A ceiling on how fast the export's clients read, in bytes per second (default and 0:
    /// none; else at least 1 MiB/s), so that a backup leaves the disk's speed to the VM.
    #[serde(
        default,
        rename = "max-bandwidth",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_bandwidth: Option<u64>,
    /// The share of the time, in percent (1 to 100), the export's reads may take while the
    /// disk's VM (or its other clients) is doing I/O (default [`DEFAULT_BACKGROUND_SHARE`]);
    /// while it is idle the backup reads at full speed. 100 never yields.
    #[serde(
        default,
        rename = "background-share",
        skip_serializing_if = "Option::is_none"
    )]
    pub background_share: Option<u8>,
}

/// The share of a busy disk's time a backup takes when `backup-start` names none: 5 %. A VM
/// writing a working set kept 0.95 of its IOPS (worst round 0.84) at 5 %, 0.86 (worst 0.60)
/// at 10 % and 0.72 (worst 0.62) at 20 % (`scripts/bench-backup-export.sh`, docs/backup.md);
/// an idle VM's backup reads at full speed whatever the share.
pub const DEFAULT_BACKGROUND_SHARE: u8 = 5;

/// The copy-before-write scratch's bound when `backup-start` names none: 1 GiB.
pub const DEFAULT_SCRATCH_SIZE: u64 = 1 << 30;

/// `backup-start`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct BackupStarted {
    pub name: String,
    pub checkpoint: String,
    /// This backup's identity: 32 random hex digits, new at every `backup-start` (a backup
    /// started again at the same checkpoint gets another). The export's NBD description
    /// carries it, so a pull continues an interrupted copy only from the same backup.
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incremental: Option<String>,
    /// Where the export listens (a port 0 resolved).
    pub nbd: String,
    /// The export's NBD name (the disk's).
    pub export: String,
    /// The metadata context an incremental pull reads: `qemu:dirty-bitmap:FROM`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bitmap: Option<String>,
    /// The image's size: the export's.
    pub size: u64,
    /// The copy-before-write scratch file (removed at `backup-end`).
    pub scratch: String,
    /// Its bound in bytes.
    pub scratch_size: u64,
    /// The export's read rate ceiling in bytes per second, if one was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bandwidth: Option<u64>,
    /// The share of a busy disk's time the export's reads take, in percent.
    pub background_share: u8,
}

/// `backup-end`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackupEndParams {
    pub name: String,
    /// The backup did not complete: its checkpoint is removed and what changed since it stays
    /// recorded for the checkpoint before it.
    #[serde(default)]
    pub failed: bool,
}

/// `backup-end`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackupEnded {
    pub name: String,
    pub checkpoint: String,
    /// Whether the checkpoint was kept (a successful backup) or removed (`failed`).
    pub kept: bool,
}
