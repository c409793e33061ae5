//! The disk registry: disks attached and detached at run time while the others keep serving.
//!
//! The registry lock guards only the name -> disk map and is never held across I/O, a key
//! derivation or a drain: `disk-add` reserves the name, unlocks the image without the lock and
//! then publishes the disk; `disk-remove` unpublishes it first and drains it afterwards. So a
//! slow control request (argon2 unlock, draining a busy disk) never blocks another one.
use crate::activity::DiskActivity;
use crate::disk::{serve_options, AttachedDisk, VhostExport, WithoutDiscard};
use crate::error::{chain, Context, Error, Result};
use crate::image::{open_image, OpenContext, Secret};
use crate::key_cache::KeyCache;
use crate::secret::MasterKey;
use crate::Event;
use crossbeam_channel::Sender;
use cryptblk_block::IoStats;
use cryptblk_control::api::{AttachedInfo, DiskConfig, DiskInfo, DiskList, DiskState};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::UnlockOptions;
use cryptblk_migration::{IncomingMigration, Phase};
use cryptblk_nbd::{Export, ExportRegistry};
use cryptblk_vhost_user_blk::{Acceptor, FrontendEvent, ServeOptions, Server};
use cryptblk_volume::Volume;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// How long `disk-remove` waits for a migration start under way to give up (the start is
/// bounded by its connect timeout; past this the removal goes on and the start, finding
/// itself cancelled, stops the migration it made).
const START_WAIT: Duration = Duration::from_secs(60);

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
    /// How to start a successor, and the servers to hand it (`handover`).
    pub(crate) process: Mutex<Option<crate::handover::Process>>,
    /// An upgrade is under way: requests that change disks are refused.
    pub(crate) upgrading: std::sync::atomic::AtomicBool,
    /// The backup exports serving, by disk name. A lock of its own, held only to insert,
    /// remove or read an entry (never with another of the daemon's locks).
    pub(crate) backups: Mutex<BTreeMap<String, crate::backup_export::Backup>>,
    pub(crate) backup_listener: crate::backup_export::BackupListener,
}

/// A vhost-user listening socket a predecessor daemon handed over.
pub struct InheritedSocket {
    pub listener: std::os::unix::net::UnixListener,
    pub path: std::path::PathBuf,
    pub file: cryptblk_net::unix_socket::FileId,
}

/// A disk whose image is open and unlocked but not exported yet (see `Daemon::prepare`).
pub struct PreparedDisk {
    pub config: DiskConfig,
    pub(crate) image: Volume,
    /// Received by an incoming migration: the checkpoints it brings (`DiskCheckpoints::receive`).
    pub(crate) migrated_in: Option<crate::disk_checkpoints::DiskCheckpoints>,
}

impl PreparedDisk {
    /// Opened with volume keys known already (handed over or cached): no key derivation.
    pub fn opened_without_kdf(&self) -> bool {
        self.image.without_kdf
    }
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
            process: Mutex::new(None),
            upgrading: std::sync::atomic::AtomicBool::new(false),
            backups: Mutex::new(BTreeMap::new()),
            backup_listener: options.backup_listener,
        })
    }

    /// Where servers report their failure (and an upgrade its end) to the serve loop.
    pub(crate) fn events(&self) -> Sender<Event> {
        self.events.clone()
    }

    /// Lets `upgrade` start a successor and hand it the servers (the serve loop's part).
    pub fn set_process(&self, process: crate::handover::Process) {
        *self.process.lock().unwrap_or_else(PoisonError::into_inner) = Some(process);
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

    /// First half of `add_disk`: reserves the name (and socket) and opens and unlocks the
    /// image, exporting nothing yet. `secret` is what opens it: a passphrase asked on a
    /// terminal (else the configured key source), or the volume keys a predecessor daemon
    /// handed over.
    pub fn prepare(&self, config: DiskConfig, secret: Secret) -> Result<PreparedDisk> {
        self.prepare_on(config, None, secret)
    }

    /// As `prepare`, on the image file a predecessor daemon handed over (open and locked).
    pub(crate) fn prepare_on(
        &self,
        config: DiskConfig,
        inherited: Option<std::fs::File>,
        secret: Secret,
    ) -> Result<PreparedDisk> {
        self.reserve(&config)?;
        match open_image(&config, inherited, secret, &self.open_context()) {
            Ok(image) => Ok(PreparedDisk {
                config,
                image,
                migrated_in: None,
            }),
            Err(e) => {
                self.unreserve(&config.name);
                Err(e)
            }
        }
    }

    /// Second half of `add_disk`: binds the disk's exports and makes it visible.
    pub fn publish(&self, prepared: PreparedDisk) -> Result<DiskInfo> {
        self.publish_on(prepared, None)
    }

    /// As `publish`, serving the vhost-user socket a predecessor daemon handed over.
    pub(crate) fn publish_on(
        &self,
        prepared: PreparedDisk,
        inherited: Option<InheritedSocket>,
    ) -> Result<DiskInfo> {
        let name = prepared.config.name.clone();
        match self.attach(prepared, inherited) {
            Ok(disk) => {
                let info = describe(&disk);
                self.disks().insert(name.clone(), DiskEntry::Attached(disk));
                tracing::info!(disk = %name, "attached");
                Ok(info)
            }
            Err(e) => {
                self.unreserve(&name);
                Err(e)
            }
        }
    }

    /// Gives up a prepared disk (its image is closed when `prepared` drops).
    pub fn abandon(&self, prepared: PreparedDisk) {
        self.unreserve(&prepared.config.name);
    }

    fn attach(
        &self,
        prepared: PreparedDisk,
        inherited: Option<InheritedSocket>,
    ) -> Result<Arc<AttachedDisk>> {
        let PreparedDisk {
            config,
            image,
            migrated_in,
        } = prepared;
        // Before anything serves: no write may escape the checkpoints' write-intent log.
        let checkpoints = match migrated_in {
            Some(received) => received,
            None => crate::disk_checkpoints::DiskCheckpoints::open(&config, &image),
        };
        let activity = DiskActivity::new();
        let vhost = match &config.vhost_user_blk {
            Some(socket) => {
                let access = crate::socket_access::SocketAccess::of(&config)
                    .map_err(|e| Error::usage(e.0))?;
                let opts = ServeOptions {
                    // Owner and mode are set before the socket appears at its path.
                    socket: access.socket_file(),
                    allowed_peer: access.peer,
                    ..serve_options(&config, &image.serial)
                };
                let mut server = match inherited {
                    Some(s) if &s.path == socket => Server::from_listener(
                        s.listener,
                        s.path,
                        s.file,
                        image.device.clone(),
                        opts,
                    ),
                    _ => Server::bind(socket, image.device.clone(), opts),
                }
                .context("starting the vhost-user-blk server")?;
                server.set_event_listener(switchover_on_vm_stop(
                    config.name.clone(),
                    activity.clone(),
                ));
                let stop = server.stop_handle();
                let events = self.events.clone();
                let name = config.name.clone();
                let served = self
                    .acceptor()?
                    .serve(
                        server,
                        Some(Box::new(move |e| {
                            let _ = events.send(Event::ServerFailed {
                                disk: name.clone(),
                                error: chain(&e),
                            });
                        })),
                    )
                    .context("starting the vhost-user-blk server")?;
                Some(VhostExport {
                    socket: socket.clone(),
                    stop,
                    served,
                })
            }
            None => None,
        };
        let nbd_exported = self.exports_nbd(&config);
        let reencryption = crate::reencrypt::ReencryptJob::new(image.segments());
        let disk = Arc::new(AttachedDisk {
            config,
            image,
            vhost,
            nbd_stats: Arc::new(IoStats::default()),
            nbd_exported,
            activity,
            reencryption,
            checkpoints,
        });
        if let (true, Some(registry)) = (nbd_exported, &self.nbd) {
            let device: Arc<dyn cryptblk_block::BlockDevice> = if disk.config.discard {
                disk.image.device.clone()
            } else {
                Arc::new(WithoutDiscard(disk.image.device.clone()))
            };
            let export = Export {
                name: disk.config.name.clone(),
                description: disk.config.image.to_string(),
                device,
                read_only: disk.read_only(),
                stats: disk.nbd_stats.clone(),
                tls_authz: crate::config::tls_authz(&disk.config)?,
                dirty_bitmaps: None,
            };
            if let Err(e) = registry.add(export) {
                let _ = disk.stop_vhost();
                return Err(Error::caused("adding the NBD export", e));
            }
        }
        Ok(disk)
    }

    /// Detaches a disk: no new client can open it, in-flight requests finish, the image is
    /// flushed and closed. Refused while a VM is connected over vhost-user unless `force`.
    pub fn remove_disk(&self, name: &str, force: bool) -> Result<()> {
        self.detach(name, force, false)
    }

    /// Detaches a disk a successor daemon has taken over: its cached keys stay (the socket
    /// file stays too: its vhost-user server was marked handed over).
    pub(crate) fn detach_for_handover(&self, name: &str) -> Result<()> {
        self.detach(name, true, true)
    }

    fn detach(&self, name: &str, force: bool, keep_keys: bool) -> Result<()> {
        let disk = {
            let mut disks = self.disks();
            let disk = match disks.get(name) {
                None => return Err(Error::no_such_disk(name)),
                Some(DiskEntry::Adding(_)) => {
                    return Err(Error::busy(format!(
                        "disk \"{name}\" is still being added; retry when disk-add has returned"
                    )))
                }
                Some(DiskEntry::Attached(d)) => d.clone(),
            };
            if let Some(vhost) = &disk.vhost {
                if vhost.stop.is_connected() && !force {
                    return Err(Error::busy(format!(
                        "disk \"{name}\" has a vhost-user frontend (a VM) connected on {}; \
                         detach it from the VM first, or pass force to cut it off",
                        vhost.socket.display()
                    )));
                }
            }
            disks.remove(name);
            disk
        };
        // A migration that has not handed the disk over yet stops (one still connecting is
        // told to, and waited for); one that has is over for this side anyway.
        if let Some(m) = disk.activity.stop_starting(START_WAIT) {
            if m.cancel().is_ok() {
                m.wait(std::time::Duration::from_secs(30));
            }
        }
        // A reencryption commits its hotzone and stops; `reencrypt-start` continues it once
        // the disk is attached again.
        disk.reencryption.stop();
        self.end_backup_on_detach(&disk);
        let incoming = self
            .incoming
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
        if let Some(m) = incoming {
            let _ = m.cancel();
        }
        let mut first_error = None;
        if disk.nbd_exported {
            if let Some(registry) = &self.nbd {
                if let Err(e) = registry.remove(name) {
                    first_error.get_or_insert(Error::caused("closing the NBD export", e));
                }
            }
        }
        if let Err(e) = disk.stop_vhost() {
            first_error.get_or_insert(e);
        }
        // A disk fenced for a migration hand-over refuses I/O through its tracker, but what was
        // written before the fence must still be durable: flush beneath the fence. An image
        // whose lock went to another daemon (shared storage) was flushed before it went, and
        // is that daemon's to flush now.
        let tracker = &disk.image.tracker;
        let handed_over = disk.activity.migration().is_some_and(|m| m.handed_over());
        let flushed = if handed_over {
            Ok(())
        } else if tracker.is_fenced() {
            tracker.inner().flush()
        } else {
            disk.image.device.flush()
        };
        if let Err(e) = flushed {
            first_error.get_or_insert(Error::caused("flushing the image", e));
        }
        if let (Some(cache), Some(keys)) = (&self.key_cache, disk.image.volume_keys()) {
            if !keep_keys
                && !self
                    .keep_cached_keys
                    .load(std::sync::atomic::Ordering::SeqCst)
            {
                cache.remove(&keys.uuid);
            }
        }
        match first_error {
            Some(e) => Err(e.context(format!("detaching disk \"{name}\""))),
            None => {
                tracing::info!(disk = %name, "detached");
                Ok(())
            }
        }
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

/// The vhost-user event hook of a disk: when its VM is stopped for a live migration (the
/// frontend stops the queues with dirty-page logging on), a disk migration in precopy
/// switches over, in the mode it was started with.
fn switchover_on_vm_stop(
    name: String,
    activity: Arc<DiskActivity>,
) -> cryptblk_vhost_user_blk::EventListener {
    Arc::new(move |event| {
        tracing::info!(disk = %name, ?event, "vhost-user frontend");
        if event
            != (FrontendEvent::Stopped {
                dirty_logging: true,
            })
        {
            return;
        }
        if let Some(m) = activity.migration() {
            if m.status().phase == Phase::Precopy {
                match m.switchover_default() {
                    Ok(()) => tracing::info!(disk = %name, "VM stopped, switching over"),
                    Err(e) => tracing::error!(disk = %name, "switchover failed: {}", chain(&e)),
                }
            }
        }
    })
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
