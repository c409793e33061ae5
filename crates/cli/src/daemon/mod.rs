//! The running `cryptblk serve` daemon: its disks, attached and detached at run time while the
//! others keep serving.
//!
//! The registry lock guards only the name -> disk map and is never held across I/O, a key
//! derivation or a drain: `disk-add` reserves the name, unlocks the image without the lock and
//! then publishes the disk; `disk-remove` unpublishes it first and drains it afterwards. So a
//! slow control request (argon2 unlock, draining a busy disk) never blocks another one.

pub mod disk;
pub mod migrate;
pub mod rpc;

use crate::args::{PbkdfArgs, PbkdfChoice};
use crate::options::pbkdf_options;
use crate::secrets::read_passphrase;
use anyhow::{anyhow, bail, Context, Result};
use crossbeam_channel::Sender;
use cryptblk_block::{IoStats, IoStatsSnapshot};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::{HashAlg, LuksImage, UnlockOptions};
use cryptblk_migration::{IncomingMigration, Phase};
use cryptblk_nbd::{Export, ExportRegistry};
use cryptblk_vhost_user_blk::{FrontendEvent, Server};
use disk::{open_image, AttachedDisk, DiskConfig, VhostExport, WithoutDiscard};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

/// Something the main loop must react to.
#[derive(Debug)]
pub enum Event {
    /// SIGTERM or SIGINT.
    Signal(i32),
    /// A disk's server stopped with an error (not by a stop request).
    ServerFailed { disk: String, error: String },
}

enum Slot {
    /// `disk-add` is opening it; the name and socket are taken.
    Adding(DiskConfig),
    Attached(Arc<AttachedDisk>),
}

impl Slot {
    fn config(&self) -> &DiskConfig {
        match self {
            Slot::Adding(c) => c,
            Slot::Attached(d) => &d.config,
        }
    }
}

pub struct Daemon {
    disks: Mutex<BTreeMap<String, Slot>>,
    /// Migrations coming in, by disk name (the disk appears in `disks` once its header is here).
    incoming: Mutex<BTreeMap<String, Arc<IncomingMigration>>>,
    nbd: Option<Arc<ExportRegistry>>,
    pool: Arc<CryptoPool>,
    unlock: UnlockOptions,
    events: Sender<Event>,
    started: Instant,
}

/// A disk whose image is open and unlocked but not exported yet (see `Daemon::prepare`).
pub struct PreparedDisk {
    pub config: DiskConfig,
    image: disk::OpenedImage,
}

/// Error with a JSON-RPC application code (see `rpc`).
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("no disk named \"{0}\"")]
    NoSuchDisk(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Busy(String),
}

impl Daemon {
    pub fn new(
        pool: Arc<CryptoPool>,
        unlock: UnlockOptions,
        nbd: Option<Arc<ExportRegistry>>,
        events: Sender<Event>,
    ) -> Arc<Self> {
        Arc::new(Daemon {
            disks: Mutex::new(BTreeMap::new()),
            incoming: Mutex::new(BTreeMap::new()),
            nbd,
            pool,
            unlock,
            events,
            started: Instant::now(),
        })
    }

    fn disks(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Slot>> {
        self.disks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn has_nbd(&self) -> bool {
        self.nbd.is_some()
    }

    /// Opens, unlocks and exports a disk. On any failure nothing of it remains (no socket, no
    /// export, the image closed) and the other disks are untouched.
    pub fn add_disk(&self, config: DiskConfig) -> Result<Value> {
        let prepared = self.prepare(config)?;
        self.publish(prepared)
    }

    /// First half of `add_disk`: reserves the name (and socket) and opens and unlocks the
    /// image, exporting nothing yet. At start-up every disk is prepared before any is
    /// published, so one bad key fails the start before any socket exists.
    /// Takes the disk's name (and socket) for `config`, checking it will have an export.
    fn reserve(&self, config: &DiskConfig) -> Result<()> {
        if config.name.is_empty() || config.name.len() > 4096 {
            return Err(DaemonError::Conflict("a disk name must be 1 to 4096 bytes".into()).into());
        }
        if config.vhost_user_blk.is_none() && !config.nbd {
            let hint = if self.nbd.is_some() {
                "give a vhost-user-blk socket or enable the NBD export"
            } else {
                "give a vhost-user-blk socket (this daemon has no --nbd server)"
            };
            bail!(DaemonError::Conflict(format!(
                "disk \"{}\" would have no export: {hint}",
                config.name
            )));
        }
        {
            let mut disks = self.disks();
            if disks.contains_key(&config.name) {
                bail!(DaemonError::Conflict(format!(
                    "a disk named \"{}\" is already attached",
                    config.name
                )));
            }
            if let Some(socket) = &config.vhost_user_blk {
                if let Some(other) = disks
                    .values()
                    .find(|s| s.config().vhost_user_blk.as_ref() == Some(socket))
                {
                    bail!(DaemonError::Conflict(format!(
                        "socket {} is already used by disk \"{}\"",
                        socket.display(),
                        other.config().name
                    )));
                }
            }
            disks.insert(config.name.clone(), Slot::Adding(config.clone()));
        }
        Ok(())
    }

    pub fn prepare(&self, mut config: DiskConfig) -> Result<PreparedDisk> {
        config.nbd &= self.nbd.is_some();
        self.reserve(&config)?;
        match open_image(&config, &self.pool, &self.unlock) {
            Ok(image) => Ok(PreparedDisk { config, image }),
            Err(e) => {
                self.disks().remove(&config.name);
                Err(e)
            }
        }
    }

    /// Second half of `add_disk`: binds the disk's exports and makes it visible.
    pub fn publish(&self, prepared: PreparedDisk) -> Result<Value> {
        let name = prepared.config.name.clone();
        match self.attach(prepared) {
            Ok(disk) => {
                let info = describe(&disk);
                self.disks().insert(name, Slot::Attached(disk));
                Ok(info)
            }
            Err(e) => {
                self.disks().remove(&name);
                Err(e)
            }
        }
    }

    /// Gives up a prepared disk (its image is closed when `prepared` drops).
    pub fn abandon(&self, prepared: PreparedDisk) {
        self.disks().remove(&prepared.config.name);
    }

    fn attach(&self, prepared: PreparedDisk) -> Result<Arc<AttachedDisk>> {
        let PreparedDisk { config, image } = prepared;
        let config = &config;
        let migration: Arc<Mutex<Option<Arc<cryptblk_migration::SourceMigration>>>> =
            Arc::default();
        let vhost = match &config.vhost_user_blk {
            Some(socket) => {
                let mut server = Server::bind(
                    socket,
                    image.device.clone(),
                    config.serve_options(&image.serial),
                )?;
                server.set_event_listener(switchover_on_vm_stop(
                    config.name.clone(),
                    migration.clone(),
                ));
                let stop = server.stop_handle();
                let events = self.events.clone();
                let name = config.name.clone();
                let thread = std::thread::Builder::new()
                    .name(format!("vhost-{name}"))
                    .spawn(move || {
                        let result = server.run();
                        if let Err(e) = &result {
                            let _ = events.send(Event::ServerFailed {
                                disk: name,
                                error: e.to_string(),
                            });
                        }
                        result
                    })
                    .context("starting the vhost-user-blk server thread")?;
                Some(VhostExport {
                    socket: socket.clone(),
                    stop,
                    thread: Mutex::new(Some(thread)),
                })
            }
            None => None,
        };
        let nbd_stats = Arc::new(IoStats::default());
        let disk = Arc::new(AttachedDisk {
            config: config.clone(),
            image,
            vhost,
            nbd_stats: nbd_stats.clone(),
            nbd_exported: config.nbd,
            header_lock: Mutex::new(()),
            migration,
        });
        if let (true, Some(registry)) = (config.nbd, &self.nbd) {
            let device: Arc<dyn cryptblk_block::BlockDevice> = if config.discard {
                disk.image.device.clone()
            } else {
                Arc::new(WithoutDiscard(disk.image.device.clone()))
            };
            let export = Export {
                name: config.name.clone(),
                description: config.image.display().to_string(),
                device,
                read_only: config.readonly || disk.image.device.read_only(),
                stats: nbd_stats,
            };
            if let Err(e) = registry.add(export) {
                let _ = disk.stop_vhost();
                return Err(e).context("adding the NBD export");
            }
        }
        Ok(disk)
    }

    /// Detaches a disk: no new client can open it, in-flight requests finish, the image is
    /// flushed and closed. Refused while a VM is connected over vhost-user unless `force`.
    pub fn remove_disk(&self, name: &str, force: bool) -> Result<()> {
        let disk = {
            let mut disks = self.disks();
            let disk = match disks.get(name) {
                None => bail!(DaemonError::NoSuchDisk(name.to_string())),
                Some(Slot::Adding(_)) => bail!(DaemonError::Busy(format!(
                    "disk \"{name}\" is still being added; retry when disk-add has returned"
                ))),
                Some(Slot::Attached(d)) => d.clone(),
            };
            if let Some(vhost) = &disk.vhost {
                if vhost.stop.is_connected() && !force {
                    bail!(DaemonError::Busy(format!(
                        "disk \"{name}\" has a vhost-user frontend (a VM) connected on {}; \
                         detach it from the VM first, or pass force to cut it off",
                        vhost.socket.display()
                    )));
                }
            }
            disks.remove(name);
            disk
        };
        // A migration that has not handed the disk over yet stops; one that has is over for
        // this side anyway.
        let outgoing = disk
            .migration
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(m) = outgoing {
            if m.cancel().is_ok() {
                m.wait(std::time::Duration::from_secs(30));
            }
        }
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
                    first_error.get_or_insert(anyhow!(e).context("closing the NBD export"));
                }
            }
        }
        if let Err(e) = disk.stop_vhost() {
            first_error.get_or_insert(e);
        }
        if let Err(e) = disk.image.device.flush() {
            first_error.get_or_insert(anyhow!(e).context("flushing the image"));
        }
        match first_error {
            Some(e) => Err(e.context(format!("detaching disk \"{name}\""))),
            None => Ok(()),
        }
    }

    pub fn list(&self) -> Value {
        let disks = self.disks();
        let list: Vec<Value> = disks
            .iter()
            .map(|(name, slot)| match slot {
                Slot::Adding(c) => json!({
                    "name": name,
                    "image": c.image,
                    "state": "adding",
                }),
                Slot::Attached(d) => describe(d),
            })
            .collect();
        json!({ "disks": list })
    }

    pub fn stats(&self, name: Option<&str>) -> Result<Value> {
        let disks: Vec<Arc<AttachedDisk>> = {
            let map = self.disks();
            if let Some(name) = name {
                match map.get(name) {
                    Some(Slot::Attached(d)) => vec![d.clone()],
                    _ => bail!(DaemonError::NoSuchDisk(name.to_string())),
                }
            } else {
                map.values()
                    .filter_map(|s| match s {
                        Slot::Attached(d) => Some(d.clone()),
                        Slot::Adding(_) => None,
                    })
                    .collect()
            }
        };
        let per_disk: Vec<Value> = disks.iter().map(|d| self.disk_stats(d)).collect();
        Ok(json!({
            "uptime-seconds": self.started.elapsed().as_secs_f64(),
            "crypto-pool": {
                "threads": self.pool.threads(),
                "busy-seconds": self.pool.busy_time().as_secs_f64(),
                "utilisation": self.pool.utilisation(),
            },
            "disks": per_disk,
        }))
    }

    fn disk_stats(&self, disk: &AttachedDisk) -> Value {
        let mut total = IoStatsSnapshot::default();
        let vhost = disk.vhost.as_ref().map(|v| {
            let queues = v.stop.queue_stats();
            for q in &queues {
                total.merge(q);
            }
            json!({
                "socket": v.socket,
                "connected": v.stop.is_connected(),
                "queues": queues.iter().map(snapshot_json).collect::<Vec<_>>(),
            })
        });
        let nbd = disk.nbd_exported.then(|| {
            let snap = disk.nbd_stats.snapshot();
            total.merge(&snap);
            let mut v = snapshot_json(&snap);
            if let Some(registry) = &self.nbd {
                v["connections"] = json!(registry.connections(&disk.config.name));
            }
            v
        });
        json!({
            "name": disk.config.name,
            "engine": disk.image.engine,
            "vhost-user-blk": vhost,
            "nbd": nbd,
            "total": snapshot_json(&total),
        })
    }

    /// Adds a keyslot to an attached LUKS disk; returns the new slot.
    pub fn key_add(
        &self,
        name: &str,
        key_file: &std::path::Path,
        new_key_file: &std::path::Path,
        pbkdf: Option<PbkdfChoice>,
        iter_time_ms: Option<u32>,
    ) -> Result<usize> {
        let disk = self.attached(name)?;
        let file = luks_file(&disk)?;
        let _header = disk
            .header_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Checked under the header lock, which migrate-start holds while it starts sending.
        self.refuse_header_change_while_migrating(name)?;
        let (mut image, _) = LuksImage::read(file.file()).context("reading the LUKS header")?;
        let old = read_passphrase(Some(key_file), "")?;
        let (_, volume_key) = image.unlock(file.file(), &old, &self.unlock)?;
        let new = read_passphrase(Some(new_key_file), "")?;
        let args = PbkdfArgs {
            pbkdf,
            iter_time: iter_time_ms,
            pbkdf_memory: None,
            pbkdf_parallel: None,
            pbkdf_force_iterations: None,
        };
        let pbkdf = pbkdf_options(&args, HashAlg::Sha256, image.version())?;
        Ok(image.add_keyslot(file.file(), &volume_key, &new, None, &pbkdf)?)
    }

    /// Removes the keyslot `key_file` opens; refuses to remove the last one.
    pub fn key_remove(&self, name: &str, key_file: &std::path::Path) -> Result<usize> {
        let disk = self.attached(name)?;
        let file = luks_file(&disk)?;
        let _header = disk
            .header_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Checked under the header lock, which migrate-start holds while it starts sending.
        self.refuse_header_change_while_migrating(name)?;
        let (mut image, _) = LuksImage::read(file.file()).context("reading the LUKS header")?;
        let passphrase = read_passphrase(Some(key_file), "")?;
        let (slot, _) = image.unlock(file.file(), &passphrase, &self.unlock)?;
        if image.active_keyslots().len() == 1 {
            bail!(DaemonError::Conflict(format!(
                "keyslot {slot} is the last one of disk \"{name}\": removing it would make the \
                 data unrecoverable; add another key first"
            )));
        }
        image.remove_keyslot(file.file(), slot)?;
        Ok(slot)
    }

    /// The header travels once, at the start of a migration: a keyslot change after that
    /// would be lost on the destination.
    fn refuse_header_change_while_migrating(&self, name: &str) -> Result<()> {
        if self.migration_in_progress(name) {
            bail!(DaemonError::Busy(format!(
                "disk \"{name}\" is being migrated: change its keyslots before or after"
            )));
        }
        Ok(())
    }

    fn attached(&self, name: &str) -> Result<Arc<AttachedDisk>> {
        match self.disks().get(name) {
            Some(Slot::Attached(d)) => Ok(d.clone()),
            Some(Slot::Adding(_)) => bail!(DaemonError::Busy(format!(
                "disk \"{name}\" is still being added"
            ))),
            None => bail!(DaemonError::NoSuchDisk(name.to_string())),
        }
    }

    /// Detaches every disk (VMs are cut off); returns the first error.
    pub fn shutdown(&self) -> Result<()> {
        let names: Vec<String> = self.disks().keys().cloned().collect();
        let mut first_error = None;
        for name in names {
            if let Err(e) = self.remove_disk(&name, true) {
                eprintln!("cryptblk: {e:#}");
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// The vhost-user event hook of a disk: when its VM is stopped for a live migration (the
/// frontend stops the queues with dirty-page logging on), a disk migration in precopy
/// switches over, in the mode it was started with.
fn switchover_on_vm_stop(
    name: String,
    migration: Arc<Mutex<Option<Arc<cryptblk_migration::SourceMigration>>>>,
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
        let m = migration
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(m) = m {
            if m.status().phase == Phase::Precopy {
                match m.switchover_default() {
                    Ok(()) => eprintln!("cryptblk: disk \"{name}\": VM stopped, switching over"),
                    Err(e) => eprintln!("cryptblk: disk \"{name}\": switchover failed: {e}"),
                }
            }
        }
    })
}

fn luks_file(disk: &AttachedDisk) -> Result<Arc<cryptblk_block::RawFile>> {
    disk.image.luks_file.clone().ok_or_else(|| {
        anyhow!(DaemonError::Conflict(format!(
            "disk \"{}\" is {}, not LUKS: it has no keyslots",
            disk.config.name,
            disk.image.format.name()
        )))
    })
}

fn describe(disk: &AttachedDisk) -> Value {
    let c = &disk.config;
    json!({
        "name": c.name,
        "image": c.image,
        "format": disk.image.format.name(),
        "state": "attached",
        "size": disk.image.device.size(),
        "block-size": disk.image.device.logical_block_size(),
        "readonly": c.readonly || disk.image.device.read_only(),
        "vhost-user-blk": c.vhost_user_blk,
        "num-queues": c.num_queues,
        "nbd-export": disk.nbd_exported,
        "discard": c.discard,
        "engine": disk.image.engine,
    })
}

fn snapshot_json(s: &IoStatsSnapshot) -> Value {
    json!({
        "read-ops": s.reads,
        "read-bytes": s.read_bytes,
        "write-ops": s.writes,
        "write-bytes": s.write_bytes,
        "flush-ops": s.flushes,
        "discard-ops": s.discards,
        "errors": s.errors,
        "in-flight": s.in_flight,
        "read-latency-us": { "p50": s.read_p50_us, "p99": s.read_p99_us },
        "write-latency-us": { "p50": s.write_p50_us, "p99": s.write_p99_us },
    })
}
