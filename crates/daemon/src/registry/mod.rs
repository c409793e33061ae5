//! The disk registry: disks attached and detached at run time while the others keep serving.
//!
//! The registry lock guards only the name -> disk map and is never held across I/O, a key
//! derivation or a drain: `disk-add` reserves the name, unlocks the image without the lock and
//! then publishes the disk; `disk-remove` unpublishes it first and drains it afterwards. So a
//! slow control request (argon2 unlock, draining a busy disk) never blocks another one.
//!
//! This file holds the registry and its queries; `attach.rs` adds a disk, `detach.rs`
//! removes one.

mod attach;
mod detach;

pub use attach::{InheritedSocket, PreparedDisk};

use crate::disk::AttachedDisk;
use crate::error::{chain, Context, Error, Result};
use crate::image::{OpenContext, Secret};
use crate::key_cache::KeyCache;
use crate::secret::MasterKey;
use crate::Event;
use crossbeam_channel::Sender;
use cryptblk_control::api::{AttachedInfo, DiskConfig, DiskInfo, DiskList, DiskState};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::UnlockOptions;
use cryptblk_migration::IncomingMigration;
use cryptblk_nbd::ExportRegistry;
use cryptblk_vhost_user_blk::Acceptor;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Instant;

/// A disk name in the registry: a disk being added, or one attached.
enum DiskEntry {
    /// `disk-add` is opening it; the name and socket are taken.
    Adding(Box<DiskConfig>),
    Attached(Arc<AttachedDisk>),
}

impl DiskEntry {
    fn config(&self) -> &DiskConfig {
        match self {
            DiskEntry::Adding(c) => c,
            DiskEntry::Attached(d) => &d.config,
        }
    }
}

/// What the daemon needs from its start: the crypto pool, the unlock limits, the NBD server's
/// export registry (when it has one) and where to report events.
pub struct DaemonOptions {
    pub pool: Arc<CryptoPool>,
    pub unlock: UnlockOptions,
    pub nbd: Option<Arc<ExportRegistry>>,
    /// The NBD server requires TLS (a disk's `tls-authz` means something only then).
    pub nbd_tls: bool,
    pub events: Sender<Event>,
    /// Decrypts the passphrases sent as `key-secret` (`serve --master-key-file`).
    pub master_key: Option<MasterKey>,
    /// Keeps volume keys in the kernel keyring for a restart after a crash (`--key-cache`).
    pub key_cache: Option<KeyCache>,
    /// How `backup-start` binds a backup export's listener (as the NBD server is bound).
    pub backup_listener: crate::backup_export::BackupListener,
}

pub struct Daemon {
    disks: Mutex<BTreeMap<String, DiskEntry>>,
    /// Migrations coming in, by disk name (the disk appears in `disks` once its header is here).
    pub(crate) incoming: Mutex<BTreeMap<String, Arc<IncomingMigration>>>,
    pub(crate) nbd: Option<Arc<ExportRegistry>>,
    nbd_tls: bool,
    pub(crate) pool: Arc<CryptoPool>,
    pub(crate) unlock: UnlockOptions,
    events: Sender<Event>,
    pub(crate) started: Instant,
    pub(crate) master_key: Option<MasterKey>,
    pub(crate) key_cache: Option<Arc<KeyCache>>,
    /// The daemon is stopping for good or handing over: detached disks keep their cached keys
    /// (a restart or the successor needs them).
    keep_cached_keys: std::sync::atomic::AtomicBool,
    /// Accepts frontends on every disk's vhost-user socket (started with the first one).
    acceptor: OnceLock<Acceptor>,
    /// An upgrade is under way: requests that change disks are refused.
    pub(crate) upgrading: std::sync::atomic::AtomicBool,
    /// The backup exports serving, by disk name. A lock of its own, held only to insert,
    /// remove or read an entry (never with another of the daemon's locks).
    pub(crate) backups: Mutex<BTreeMap<String, crate::backup_export::Backup>>,
    pub(crate) backup_listener: crate::backup_export::BackupListener,
}

impl Daemon {
    pub fn new(options: DaemonOptions) -> Arc<Self> {
        Arc::new(Daemon {
            disks: Mutex::new(BTreeMap::new()),
            incoming: Mutex::new(BTreeMap::new()),
            nbd: options.nbd,
            nbd_tls: options.nbd_tls,
            pool: options.pool,
            unlock: options.unlock,
            events: options.events,
            started: Instant::now(),
            master_key: options.master_key,
            key_cache: options.key_cache.map(Arc::new),
            keep_cached_keys: std::sync::atomic::AtomicBool::new(false),
            acceptor: OnceLock::new(),
            upgrading: std::sync::atomic::AtomicBool::new(false),
            backups: Mutex::new(BTreeMap::new()),
            backup_listener: options.backup_listener,
        })
    }

    /// Where servers report their failure (and an upgrade its end) to the serve loop.
    pub(crate) fn events(&self) -> Sender<Event> {
        self.events.clone()
    }

    /// Refuses a request that would change disks while an upgrade hands them over.
    pub(crate) fn refuse_while_upgrading(&self) -> Result<()> {
        if self.upgrading.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::busy(
                "an upgrade is handing the disks to a new daemon; retry once it has answered",
            ));
        }
        Ok(())
    }

    /// Marks an upgrade as under way (under the registry's lock, so that a `disk-add` either
    /// has reserved its name before, and is seen by `adding`, or is refused); returns whether
    /// one was already.
    pub(crate) fn begin_upgrade(&self) -> bool {
        let _disks = self.disks();
        self.upgrading
            .swap(true, std::sync::atomic::Ordering::SeqCst)
    }

    /// A disk being added, if any.
    pub(crate) fn adding(&self) -> Option<String> {
        self.disks()
            .iter()
            .find(|(_, d)| matches!(d, DiskEntry::Adding(_)))
            .map(|(name, _)| name.clone())
    }

    /// The vhost-user acceptor, started the first time a disk needs it.
    pub(crate) fn acceptor(&self) -> Result<&Acceptor> {
        if let Some(acceptor) = self.acceptor.get() {
            return Ok(acceptor);
        }
        let started = Acceptor::start().context("starting the vhost-user acceptor")?;
        // Two first disks at once: one acceptor wins, the other's thread ends at once.
        if let Err(spare) = self.acceptor.set(started) {
            spare.shutdown();
        }
        Ok(self.acceptor.get().expect("set above"))
    }

    fn disks(&self) -> MutexGuard<'_, BTreeMap<String, DiskEntry>> {
        self.disks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn has_nbd(&self) -> bool {
        self.nbd.is_some()
    }

    pub(crate) fn open_context(&self) -> OpenContext<'_> {
        OpenContext {
            pool: &self.pool,
            unlock: &self.unlock,
            master_key: self.master_key.as_ref(),
            key_cache: self.key_cache.as_deref(),
        }
    }

    /// Opens, unlocks and exports a disk. On any failure nothing of it remains (no socket, no
    /// export, the image closed) and the other disks are untouched.
    pub fn add_disk(&self, config: DiskConfig) -> Result<DiskInfo> {
        let prepared = self.prepare(config, Secret::Passphrase(None))?;
        self.publish(prepared)
    }

    /// Takes the disk's name (and socket) for `config`, checking it will have an export.
    pub(crate) fn reserve(&self, config: &DiskConfig) -> Result<()> {
        crate::config::validate(config).map_err(|e| Error::conflict(e.0))?;
        if config.tls_authz.is_some() && !(self.nbd_tls && self.exports_nbd(config)) {
            return Err(Error::usage(format!(
                "disk \"{}\": tls-authz lists who may use its NBD export over TLS, but it has \
                 none: serve --nbd ADDR --tls-creds DIR, and leave its NBD export on",
                config.name
            )));
        }
        if config.vhost_user_blk.is_none() && !self.exports_nbd(config) {
            let hint = if self.nbd.is_some() {
                "give a vhost-user-blk socket or enable the NBD export"
            } else {
                "give a vhost-user-blk socket (this daemon has no --nbd server)"
            };
            return Err(Error::conflict(format!(
                "disk \"{}\" would have no export: {hint}",
                config.name
            )));
        }
        let mut disks = self.disks();
        // Checked under the registry's lock, which the upgrade holds while it sets the flag
        // and looks for disks being added: a disk is either handed over or refused.
        self.refuse_while_upgrading()?;
        if disks.contains_key(&config.name) {
            return Err(Error::conflict(format!(
                "a disk named \"{}\" is already attached",
                config.name
            )));
        }
        if let Some(socket) = &config.vhost_user_blk {
            if let Some(other) = disks
                .values()
                .find(|s| s.config().vhost_user_blk.as_ref() == Some(socket))
            {
                return Err(Error::conflict(format!(
                    "socket {} is already used by disk \"{}\"",
                    socket.display(),
                    other.config().name
                )));
            }
        }
        disks.insert(
            config.name.clone(),
            DiskEntry::Adding(Box::new(config.clone())),
        );
        Ok(())
    }

    /// Gives the name back after a failed add.
    pub(crate) fn unreserve(&self, name: &str) {
        self.disks().remove(name);
    }

    /// Whether the disk gets an NBD export: asked for (or not refused) and the daemon has an
    /// NBD server.
    pub(crate) fn exports_nbd(&self, config: &DiskConfig) -> bool {
        config.nbd_export.unwrap_or(true) && self.nbd.is_some()
    }

    pub fn list(&self) -> DiskList {
        let disks = self.disks();
        let disks = disks
            .iter()
            .map(|(name, slot)| match slot {
                DiskEntry::Adding(c) => DiskInfo {
                    name: name.clone(),
                    image: c.image.path().to_path_buf(),
                    state: DiskState::Adding,
                    attached: None,
                },
                DiskEntry::Attached(d) => describe(d),
            })
            .collect();
        DiskList { disks }
    }

    /// The attached disk `name` (an error for one being added or absent).
    pub(crate) fn attached(&self, name: &str) -> Result<Arc<AttachedDisk>> {
        match self.disks().get(name) {
            Some(DiskEntry::Attached(d)) => Ok(d.clone()),
            Some(DiskEntry::Adding(_)) => {
                Err(Error::busy(format!("disk \"{name}\" is still being added")))
            }
            None => Err(Error::no_such_disk(name)),
        }
    }

    /// Every attached disk.
    pub(crate) fn attached_disks(&self) -> Vec<Arc<AttachedDisk>> {
        self.disks()
            .values()
            .filter_map(|s| match s {
                DiskEntry::Attached(d) => Some(d.clone()),
                DiskEntry::Adding(_) => None,
            })
            .collect()
    }

    /// Detaches every disk (VMs are cut off); returns the first error. Cached keys stay for
    /// the daemon's next start (they expire unless it comes).
    pub fn shutdown(&self) -> Result<()> {
        self.keep_cached_keys
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let names: Vec<String> = self.disks().keys().cloned().collect();
        let mut first_error = None;
        for name in names {
            if let Err(e) = self.remove_disk(&name, true) {
                tracing::error!(disk = %name, "{}", chain(&e));
                first_error.get_or_insert(e);
            }
        }
        if let Some(acceptor) = self.acceptor.get() {
            acceptor.shutdown();
        }
        first_error.map_or(Ok(()), Err)
    }
}

fn describe(disk: &AttachedDisk) -> DiskInfo {
    let c = &disk.config;
    DiskInfo {
        name: c.name.clone(),
        image: c.image.path().to_path_buf(),
        state: DiskState::Attached,
        attached: Some(AttachedInfo {
            format: disk.image.format().name().to_string(),
            size: disk.image.device.size(),
            block_size: disk.image.device.logical_block_size(),
            readonly: disk.read_only(),
            vhost_user_blk: c.vhost_user_blk.clone(),
            num_queues: c.num_queues,
            nbd_export: disk.nbd_exported,
            discard: c.discard,
            engine: disk.image.luks().map(|l| l.engine.to_string()),
            cache: c.cache,
            aio: c.aio,
        }),
    }
}
