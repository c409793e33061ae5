//! What the methods answer. The daemon serialises these types; programs (and tests) may
//! deserialise them. `cryptblk ctl` prints the answer as received, so fields a newer daemon
//! adds are not lost.
use super::{AioEngine, CacheMode};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Whether a disk serves yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskState {
    /// `disk-add` (or an incoming migration) is opening it; the name is taken.
    Adding,
    Attached,
}

/// One disk of `disk-list`, and `disk-add`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct DiskInfo {
    pub name: String,
    pub image: PathBuf,
    pub state: DiskState,
    /// Present once attached.
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub attached: Option<AttachedInfo>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct AttachedInfo {
    /// `luks` or `raw`.
    pub format: String,
    pub size: u64,
    pub block_size: u32,
    pub readonly: bool,
    pub vhost_user_blk: Option<PathBuf>,
    pub num_queues: u16,
    pub nbd_export: bool,
    pub discard: bool,
    /// The sector-crypto engine of a LUKS image.
    pub engine: Option<String>,
    pub cache: CacheMode,
    pub aio: AioEngine,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiskList {
    pub disks: Vec<DiskInfo>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiskRemoved {
    pub removed: String,
}

/// `upgrade`'s answer, sent once the new daemon serves every disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Upgraded {
    /// The new daemon's process id.
    pub pid: u32,
    /// Disks handed over.
    pub disks: usize,
    /// Of them, opened with the volume keys handed over (no key derivation).
    pub without_kdf: usize,
    /// From the request until the new daemon served every disk, in milliseconds.
    pub took_ms: u64,
    /// The longest a disk was served by neither daemon, in milliseconds (from this daemon
    /// closing its connection to the new one accepting; a VM adds its own reconnect delay).
    pub longest_gap_ms: u64,
}

/// Counters of one queue, one export or a whole disk.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct IoCounters {
    pub read_ops: u64,
    pub read_bytes: u64,
    pub write_ops: u64,
    pub write_bytes: u64,
    pub flush_ops: u64,
    pub discard_ops: u64,
    pub errors: u64,
    pub in_flight: u64,
    pub read_latency_us: Latency,
    pub write_latency_us: Latency,
}

/// Microseconds; absent before the first request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub p50: Option<f64>,
    pub p99: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Stats {
    pub uptime_seconds: f64,
    pub crypto_pool: PoolStats,
    pub disks: Vec<DiskStats>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct PoolStats {
    pub threads: usize,
    pub busy_seconds: f64,
    pub utilisation: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct DiskStats {
    pub name: String,
    pub engine: Option<String>,
    pub vhost_user_blk: Option<VhostStats>,
    pub nbd: Option<NbdStats>,
    /// Every export together.
    pub total: IoCounters,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VhostStats {
    pub socket: PathBuf,
    pub connected: bool,
    pub queues: Vec<IoCounters>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NbdStats {
    #[serde(flatten)]
    pub counters: IoCounters,
    /// Clients connected to the export.
    pub connections: usize,
}

/// `disk-resize`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct DiskResized {
    pub name: String,
    /// Bytes the guest saw before.
    pub old_size: u64,
    /// Bytes it sees now.
    pub size: u64,
    /// A vhost-user frontend was told (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG); false when none
    /// is connected or it did not negotiate the backend channel (it sees the size when it
    /// next reads the config space, e.g. at its next boot).
    pub guest_notified: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyAdded {
    pub name: String,
    pub keyslot: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct KeyRemoved {
    pub name: String,
    pub removed_keyslot: usize,
}

/// `migrate-incoming`'s answer: where the source should connect (a port 0 resolved).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Listening {
    pub name: String,
    pub listen: String,
}

/// The source side of a migration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct SourceStatus {
    /// Always `source`.
    pub role: String,
    pub phase: String,
    pub error: Option<String>,
    pub postcopy: bool,
    pub preempt: bool,
    /// Shared storage: nothing is copied, the image's lock is handed over.
    #[serde(default)]
    pub shared: bool,
    pub bytes_sent: u64,
    pub zero_bytes: u64,
    pub chunks: u64,
    pub passes: u32,
    pub dirty_blocks: u64,
    pub dirty_bytes: u64,
    pub granularity: u64,
    pub elapsed_seconds: f64,
    pub throughput_bytes_per_sec: f64,
    pub urgent_requests_served: u64,
    pub downtime_ms: Option<f64>,
    /// A switchover was asked for before the destination served the disk: it happens as soon
    /// as the destination says it does (this side serves the disk meanwhile).
    #[serde(default)]
    pub switchover_pending: bool,
}

/// The destination side of a migration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct DestinationStatus {
    /// Always `destination`.
    pub role: String,
    pub phase: String,
    pub error: Option<String>,
    pub listen: String,
    /// Known once the source's hello has arrived.
    pub disk_size: Option<u64>,
    pub bytes_received: u64,
    pub zero_bytes: u64,
    pub chunks: u64,
    pub passes: u32,
    pub missing_blocks: u64,
    pub granularity: u64,
    pub elapsed_seconds: f64,
    pub on_demand: OnDemand,
}

/// Reads on the destination that had to fetch blocks from the source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct OnDemand {
    pub requests: u64,
    pub latency_us: LatencySummary,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub avg: f64,
    pub p50: u64,
    pub p99: u64,
    pub max: u64,
}

/// `migrate-status`: either side, or both on a disk that came in and is going out again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationStatus {
    pub name: String,
    /// The outgoing migration's phase, else the incoming one's.
    pub phase: String,
    pub outgoing: Option<SourceStatus>,
    pub incoming: Option<DestinationStatus>,
}

/// `migrate-cancel` of an incoming migration, or of an outgoing one still connecting (which
/// then stops as soon as it is connected, or fails to).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelRequested {
    pub name: String,
    /// `incoming` or `starting`.
    pub cancelled: String,
}
