//! One attached disk: its image opened (and unlocked), and its exports running.

use crate::exit::UsageError;
use crate::secrets::read_passphrase;
use anyhow::{Context, Result};
use cryptblk_block::{BlockDevice, Format, IoStats, OpenOptions, RawFile};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::UnlockOptions;
use cryptblk_migration::{DirtyTracker, SourceMigration};
use cryptblk_vhost_user_blk::{ServeOptions, StopHandle};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// What to attach, from the command line, a `--config` entry or a `disk-add` request (paths
/// already resolved).
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// The disk's name: the NBD export name, in logs, stats and control requests.
    pub name: String,
    pub image: PathBuf,
    pub key_file: Option<PathBuf>,
    /// A LUKS image without a key file prompts on the terminal (command line only).
    pub may_prompt: bool,
    /// Serve over vhost-user-blk on this socket.
    pub vhost_user_blk: Option<PathBuf>,
    /// Export over the daemon's NBD server (when it has one).
    pub nbd: bool,
    pub num_queues: u16,
    pub queue_size: u16,
    pub readonly: bool,
    pub discard: bool,
    /// GET_ID answer; `None` = the LUKS UUID or the image file name.
    pub serial: Option<String>,
    /// Host cache mode of the image file (QEMU's `cache=`).
    pub cache: cryptblk_block::CacheMode,
    /// Engine of the asynchronous I/O.
    pub aio: cryptblk_block::AioEngine,
    /// Busy-poll completions this many microseconds before sleeping (0: never).
    pub poll_us: u32,
}

/// Dirty tracking granularity of a raw image (a LUKS image tracks its encryption sectors).
const RAW_TRACKING_GRANULARITY: u64 = 4096;

/// An opened image.
pub struct OpenedImage {
    /// What the exports serve: the disk behind its dirty tracker (idle until a migration).
    pub device: Arc<dyn BlockDevice>,
    pub tracker: Arc<DirtyTracker>,
    /// The image file under the encryption, which a migration copies.
    pub file: Arc<RawFile>,
    pub format: Format,
    /// The LUKS UUID or the image file name.
    pub serial: String,
    /// The sector-crypto engine serving a LUKS image.
    pub engine: Option<&'static str>,
    /// The LUKS image file, for header updates (`key-add`, `key-remove`) while attached.
    pub luks_file: Option<Arc<RawFile>>,
}

/// Opens (and for LUKS, unlocks) the image of `config` with an exclusive lock.
pub fn open_image(
    config: &DiskConfig,
    pool: &Arc<CryptoPool>,
    unlock: &UnlockOptions,
) -> Result<OpenedImage> {
    let path = &config.image;
    let format = cryptblk_block::probe_format(path)
        .with_context(|| format!("probing {}", path.display()))?;
    match format {
        Format::Luks => {
            if config.key_file.is_none() && !config.may_prompt {
                return Err(UsageError("a LUKS image needs a key-file".into()).into());
            }
            let passphrase = read_passphrase(config.key_file.as_deref(), "Enter passphrase: ")?;
            let volume = cryptblk_block::open_luks_volume(
                path,
                &passphrase,
                &cryptblk_block::VolumeOptions {
                    writable: !config.readonly,
                    unlock: unlock.clone(),
                    pool: Some(pool.clone()),
                    io: config.io_settings(),
                },
            )?;
            for warning in volume.warnings() {
                eprintln!("cryptblk: warning: {}: {warning}", path.display());
            }
            Ok(luks_image(volume)?)
        }
        Format::Raw => {
            if config.key_file.is_some() {
                return Err(UsageError(format!(
                    "a key file is given, but {} is raw, not LUKS",
                    path.display()
                ))
                .into());
            }
            let raw = RawFile::open_with(
                path,
                OpenOptions {
                    writable: !config.readonly,
                    lock: true,
                },
                config.io_settings(),
            )?;
            raw_image(Arc::new(raw))
        }
        other => Err(UsageError(format!(
            "{} is {}: serve exports LUKS and raw images (convert it first)",
            path.display(),
            other.name()
        ))
        .into()),
    }
}

fn luks_image(volume: cryptblk_block::LuksVolume) -> Result<OpenedImage> {
    let serial = volume.header().uuid().to_string();
    let engine = volume.device().cipher().engine_name();
    let file = volume.file().clone();
    let payload_offset = volume.header().data_offset();
    let granularity = u64::from(volume.header().sector_size());
    let tracker = Arc::new(DirtyTracker::new(
        Arc::new(volume),
        payload_offset,
        granularity,
    )?);
    Ok(OpenedImage {
        device: tracker.clone(),
        tracker,
        file: file.clone(),
        format: Format::Luks,
        serial,
        engine: Some(engine),
        luks_file: Some(file),
    })
}

fn raw_image(raw: Arc<RawFile>) -> Result<OpenedImage> {
    let serial = raw
        .path()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tracker = Arc::new(DirtyTracker::new(raw.clone(), 0, RAW_TRACKING_GRANULARITY)?);
    Ok(OpenedImage {
        device: tracker.clone(),
        tracker,
        file: raw,
        format: Format::Raw,
        serial,
        engine: None,
        luks_file: None,
    })
}

/// Opens an image a migration is bringing in, from the file the migration writes: `gate`
/// turns the opened disk into the one to serve (reads of blocks not here yet fetch them).
pub fn open_received(
    config: &DiskConfig,
    file: Arc<RawFile>,
    pool: &Arc<CryptoPool>,
    unlock: &UnlockOptions,
    gate: impl FnOnce(Arc<dyn BlockDevice>) -> Result<Arc<dyn BlockDevice>>,
) -> Result<OpenedImage> {
    let mut magic = [0u8; 6];
    file.read_at(&mut magic, 0)?;
    let mut image = if magic == *b"LUKS\xba\xbe" {
        let Some(key_file) = config.key_file.as_deref() else {
            return Err(UsageError("the incoming image is LUKS: give a key-file".into()).into());
        };
        let passphrase = read_passphrase(Some(key_file), "")?;
        let volume = cryptblk_block::open_luks_volume_on(
            file,
            &passphrase,
            &cryptblk_block::VolumeOptions {
                writable: true,
                unlock: unlock.clone(),
                pool: Some(pool.clone()),
                ..Default::default()
            },
        )?;
        luks_image(volume)?
    } else {
        if config.key_file.is_some() {
            return Err(
                UsageError("a key file is given, but the incoming image is raw".into()).into(),
            );
        }
        raw_image(file)?
    };
    // Serve through the gate, and keep a tracker on top so the disk can migrate on later.
    let inner = image.tracker.inner().clone();
    let gated = gate(inner)?;
    let tracker = Arc::new(DirtyTracker::new(
        gated,
        image.tracker.payload_offset(),
        image.tracker.granularity(),
    )?);
    image.device = tracker.clone();
    image.tracker = tracker;
    Ok(image)
}

impl DiskConfig {
    pub fn serve_options(&self, serial: &str) -> ServeOptions {
        ServeOptions {
            num_queues: self.num_queues,
            queue_size: self.queue_size,
            read_only: self.readonly,
            serial: self.serial.clone().unwrap_or_else(|| serial.to_string()),
            discard: self.discard,
            name: self.name.clone(),
            poll: std::time::Duration::from_micros(u64::from(self.poll_us)),
        }
    }

    pub fn io_settings(&self) -> cryptblk_block::IoSettings {
        cryptblk_block::IoSettings {
            cache: self.cache,
            aio: self.aio,
        }
    }
}

/// A running vhost-user-blk server of one disk.
pub struct VhostExport {
    pub socket: PathBuf,
    pub stop: StopHandle,
    pub thread: Mutex<Option<JoinHandle<Result<(), cryptblk_vhost_user_blk::Error>>>>,
}

/// An attached disk.
pub struct AttachedDisk {
    pub config: DiskConfig,
    pub image: OpenedImage,
    pub vhost: Option<VhostExport>,
    /// Counters of the disk's NBD export (all connections).
    pub nbd_stats: Arc<IoStats>,
    pub nbd_exported: bool,
    /// Serialises header updates of this disk.
    pub header_lock: Mutex<()>,
    /// The disk's outgoing migration (the latest one).
    pub migration: Arc<Mutex<Option<Arc<SourceMigration>>>>,
}

impl AttachedDisk {
    /// Stops the vhost-user server (its in-flight requests finish, the disk is flushed) and
    /// waits for its thread.
    pub fn stop_vhost(&self) -> Result<()> {
        let Some(vhost) = &self.vhost else {
            return Ok(());
        };
        vhost.stop.stop();
        let thread = vhost
            .thread
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(thread) = thread {
            match thread.join() {
                Ok(result) => result.with_context(|| {
                    format!("vhost-user-blk server on {}", vhost.socket.display())
                })?,
                Err(_) => anyhow::bail!("the vhost-user-blk server thread panicked"),
            }
        }
        Ok(())
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
    fn native_queue(
        &self,
        opts: &cryptblk_block::aio::QueueOptions,
    ) -> Option<Result<Box<dyn cryptblk_block::aio::IoQueue>, cryptblk_block::BlockError>> {
        Some(cryptblk_block::aio::open_queue(&self.0, opts))
    }
}
