//! One attached disk: its image open (and unlocked) and its exports running.
use crate::activity::DiskActivity;
use crate::error::{Context, Result};
use cryptblk_block::{BlockDevice, IoStats};
use cryptblk_control::api::DiskConfig;
use cryptblk_vhost_user_blk::{ServeOptions, Served, StopHandle};
use cryptblk_volume::Volume;
use std::path::PathBuf;
use std::sync::Arc;

/// A disk's vhost-user-blk socket, served by the daemon's acceptor.
pub struct VhostExport {
    pub socket: PathBuf,
    pub stop: StopHandle,
    pub served: Served,
}

/// An attached disk.
pub struct AttachedDisk {
    pub config: DiskConfig,
    pub image: Volume,
    pub vhost: Option<VhostExport>,
    /// Counters of the disk's NBD export (all connections).
    pub nbd_stats: Arc<IoStats>,
    pub nbd_exported: bool,
    /// Keyslot changes and the outgoing migration (see `activity` for the locking rules).
    pub(crate) activity: Arc<DiskActivity>,
    /// The online reencryption's progress (`reencrypt-status`).
    pub(crate) reencryption: Arc<crate::reencrypt_job::ReencryptJob>,
    /// Its checkpoints (`checkpoint-*`), opened before it serves.
    pub(crate) checkpoints: crate::disk_checkpoints::DiskCheckpoints,
}

/// The vhost-user options of a disk; `serial` is the image's default GET_ID answer.
pub fn serve_options(config: &DiskConfig, serial: &str) -> ServeOptions {
    ServeOptions {
        num_queues: config.num_queues,
        queue_size: config.queue_size,
        read_only: config.readonly,
        serial: config.serial.clone().unwrap_or_else(|| serial.to_string()),
        discard: config.discard,
        name: config.name.clone(),
        poll: std::time::Duration::from_micros(u64::from(config.poll_us)),
        unsealed_memory: config.unsealed_memory,
        // Owner, mode and allowed peer: `SocketAccess::of`, where a bad name is an error.
        ..ServeOptions::default()
    }
}

impl AttachedDisk {
    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn read_only(&self) -> bool {
        self.config.readonly || self.image.device.read_only()
    }

    /// Stops serving the vhost-user socket: its frontend's requests in flight finish, the
    /// connection closes, the disk is flushed.
    pub fn stop_vhost(&self) -> Result<()> {
        let Some(vhost) = &self.vhost else {
            return Ok(());
        };
        vhost
            .served
            .stop()
            .with_context(|| format!("vhost-user-blk server on {}", vhost.socket.display()))
    }
}

/// The device as NBD clients see it when the disk's discard is off: everything passes
/// through except discard, which is refused, so the export does not offer TRIM. Discards on
/// an encrypted image punch holes that show which blocks are unused; like the vhost-user
/// export (and dm-crypt's allow_discards), NBD only passes them on when asked to.
pub struct WithoutDiscard(pub Arc<dyn BlockDevice>);

impl BlockDevice for WithoutDiscard {
    fn size(&self) -> u64 {
        self.0.size()
    }

    fn logical_block_size(&self) -> u32 {
        self.0.logical_block_size()
    }

    fn read_only(&self) -> bool {
        self.0.read_only()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), cryptblk_block::BlockError> {
        self.0.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), cryptblk_block::BlockError> {
        self.0.write_at(buf, offset)
    }

    fn flush(&self) -> Result<(), cryptblk_block::BlockError> {
        self.0.flush()
    }

    fn block_status(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<cryptblk_block::Extent, cryptblk_block::BlockError> {
        self.0.block_status(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), cryptblk_block::BlockError> {
        self.0.write_zeroes(offset, len)
    }

    /// The wrapped device's queue: NBD sends no TRIM to an export that does not offer it.
    fn pipeline(
        &self,
        opts: &cryptblk_block::aio::QueueOptions,
    ) -> Option<Result<cryptblk_block::aio::Pipeline, cryptblk_block::BlockError>> {
        Some(cryptblk_block::open_pipeline(&self.0, opts))
    }
}
