//! How a migration is sent ([`SourceOptions`], checked before anything connects) and what the
//! source reports about it ([`SourceStatus`]).

use crate::wire::MAX_CHUNK_LEN;
use crate::{MigrationError, Phase};
use cryptblk_volume::checkpoint::CarriedCheckpoints;
use rustls::ClientConfig;
use std::sync::Arc;
use std::time::Duration;

/// How a migration is sent.
#[derive(Debug, Clone)]
pub struct SourceOptions {
    /// Bulk chunk size (4 KiB ..= 64 MiB): the unit read from the image and checksummed.
    pub chunk_size: usize,
    /// Cap on bytes per second over all channels together (the link); `None`: no cap.
    pub max_bandwidth: Option<u64>,
    /// Allow switching over in postcopy mode (send only what is missing, fetch on demand).
    pub postcopy: bool,
    /// Urgent requests on a connection of their own.
    pub preempt: bool,
    /// With preempt: interrupt a bulk chunk between slices to answer an urgent request
    /// (on by default; off only to measure what it brings).
    pub break_chunks: bool,
    /// Bulk data goes to the socket in slices of this many bytes.
    pub slice_size: usize,
    /// Precopy passes (the first, full one included) before resending stops until the
    /// switchover; 0 for no limit.
    pub max_passes: u32,
    pub tls: Option<Arc<ClientConfig>>,
    /// With `tls`: the name the destination's certificate must carry (a DNS or IP
    /// subjectAltName), instead of the host of the address connected to.
    pub peer_name: Option<String>,
    /// Bound on each connect, TLS handshake and Hello exchange with the destination (a peer
    /// that accepts and never answers fails the start or recovery after this long).
    pub connect_timeout: Duration,
    /// The disk's checkpoints, asked for at switchover (the disk fenced: nothing records any
    /// more) and carried to a destination that takes them. `None`: none are carried.
    pub checkpoints: Option<CheckpointSource>,
}

/// Where a source gets its disk's checkpoints at switchover (the daemon's store); an error
/// says why they cannot be carried (the destination then has none).
#[derive(Clone)]
pub struct CheckpointSource(pub Arc<dyn Fn() -> Result<CarriedCheckpoints, String> + Send + Sync>);

impl std::fmt::Debug for CheckpointSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CheckpointSource")
    }
}

impl Default for SourceOptions {
    fn default() -> Self {
        SourceOptions {
            chunk_size: 2 << 20,
            max_bandwidth: None,
            postcopy: false,
            preempt: false,
            break_chunks: true,
            slice_size: 16 << 10,
            max_passes: 30,
            tls: None,
            peer_name: None,
            connect_timeout: Duration::from_secs(10),
            checkpoints: None,
        }
    }
}

impl SourceOptions {
    pub(super) fn validate(&self) -> Result<(), MigrationError> {
        if self.peer_name.is_some() && self.tls.is_none() {
            return Err(MigrationError::InvalidOptions(
                "a pinned peer name needs TLS: only a certificate can prove it".into(),
            ));
        }
        if !(4096..=MAX_CHUNK_LEN).contains(&self.chunk_size) {
            return Err(MigrationError::InvalidOptions(format!(
                "chunk size {} is not within 4096..={MAX_CHUNK_LEN}",
                self.chunk_size
            )));
        }
        if self.slice_size == 0 {
            return Err(MigrationError::InvalidOptions(
                "slice size must be positive".into(),
            ));
        }
        if self.max_bandwidth == Some(0) {
            return Err(MigrationError::InvalidOptions(
                "max bandwidth must be positive".into(),
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(MigrationError::InvalidOptions(
                "connect timeout must be positive".into(),
            ));
        }
        if self.preempt && !self.postcopy {
            return Err(MigrationError::InvalidOptions(
                "preempt needs postcopy: urgent requests only exist in postcopy".into(),
            ));
        }
        Ok(())
    }
}

/// A snapshot of the source's progress.
#[derive(Debug, Clone)]
pub struct SourceStatus {
    pub phase: Phase,
    /// Why the migration failed or paused.
    pub error: Option<String>,
    pub bytes_sent: u64,
    pub zero_bytes: u64,
    pub chunks: u64,
    /// Sweeps over the disk completed (the first one sends everything).
    pub passes: u32,
    /// Blocks the destination does not have yet (dirty in precopy, missing in postcopy).
    pub dirty_blocks: u64,
    pub dirty_bytes: u64,
    pub granularity: u64,
    pub elapsed: Duration,
    pub throughput_bytes_per_sec: f64,
    /// Urgent requests answered.
    pub urgent_served: u64,
    /// From fencing the disk to the destination being able to serve it.
    pub downtime: Option<Duration>,
    pub postcopy: bool,
    pub preempt: bool,
    /// Shared storage: nothing is copied, the image's lock is handed over.
    pub shared: bool,
    /// A switchover was asked for and waits for the destination to serve the disk (the
    /// source still serves it meanwhile).
    pub switchover_pending: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(opts: SourceOptions, needle: &str) {
        match opts.validate() {
            Err(MigrationError::InvalidOptions(m)) => {
                assert!(m.contains(needle), "{m:?} does not mention {needle:?}")
            }
            other => panic!("expected InvalidOptions about {needle}, got {other:?}"),
        }
    }

    #[test]
    fn the_defaults_are_valid() {
        SourceOptions::default().validate().unwrap();
        SourceOptions {
            postcopy: true,
            preempt: true,
            max_bandwidth: Some(1),
            chunk_size: MAX_CHUNK_LEN,
            ..SourceOptions::default()
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn impossible_options_are_refused_by_name() {
        let d = SourceOptions::default;
        refused(
            SourceOptions {
                chunk_size: 4095,
                ..d()
            },
            "chunk size 4095",
        );
        refused(
            SourceOptions {
                chunk_size: MAX_CHUNK_LEN + 1,
                ..d()
            },
            "chunk size",
        );
        refused(
            SourceOptions {
                slice_size: 0,
                ..d()
            },
            "slice size",
        );
        refused(
            SourceOptions {
                max_bandwidth: Some(0),
                ..d()
            },
            "max bandwidth",
        );
        refused(
            SourceOptions {
                preempt: true,
                ..d()
            },
            "preempt needs postcopy",
        );
    }
}
