//! Live migration verbs of the daemon. The source side copies an attached disk's image file to
//! another daemon while the disk keeps serving; the destination side receives it into a new
//! image and attaches it as soon as its header has arrived (I/O on it waits for switchover).
//! A disk on an RBD image both daemons reach moves without a copy (`--shared`): the
//! destination listens on the same image, and only the image's exclusive lock changes hands.
//! The switchover happens when asked (`migrate-switchover`, `migrate-postcopy`) or when the
//! disk's VM is stopped for migration (vhost-user frontend stops the queues with dirty-page
//! logging on, which QEMU does at the end of a live migration), but never before the
//! destination serves the disk: asked earlier, it waits (the source serving on) until the
//! destination says its exports are up.
use crate::activity::CancelTarget;
use crate::error::{chain, Context, Error, Result};
use crate::image::open_received;
use crate::key_file::Passphrase;
use crate::registry::{Daemon, PreparedDisk};
use cryptblk_control::api::{
    CancelRequested, DestinationStatus, DiskConfig, LatencySummary, Listening,
    MigrateIncomingParams, MigrateStartParams, MigrationStatus, OnDemand, SourceStatus,
    DEFAULT_CONNECT_TIMEOUT_MS,
};
use cryptblk_migration::channel::ListenOptions;
use cryptblk_migration::{
    IncomingMigration, IncomingStatus, IncomingStore, NewFile, Phase, SourceMigration,
    SourceOptions,
};
use cryptblk_net::Address;
use std::path::Path;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

/// How long a destination waits for the source to send the image header.
const HEADER_WAIT: Duration = Duration::from_secs(24 * 3600);

/// An address from a request.
pub(crate) fn parse_address(text: &str) -> Result<Address> {
    text.parse()
        .map_err(|e: cryptblk_net::AddressError| Error::invalid_params(e.to_string()))
}

/// Refuses plain TCP on an address other machines reach unless the request says `insecure`
/// (then it is logged as a warning): without TLS, whoever reaches a listening destination first
/// sends it a disk, and a source's ciphertext crosses the network to whoever answers.
fn check_transport(
    address: &Address,
    tls: bool,
    insecure: bool,
    peer_name: Option<&str>,
    what: &str,
) -> Result<()> {
    if peer_name.is_some() && !tls {
        return Err(Error::invalid_params(
            "peer-name needs tls-creds: only a certificate can prove a peer's name",
        ));
    }
    if tls || address.is_loopback().unwrap_or(false) {
        return Ok(());
    }
    if !insecure {
        return Err(Error::invalid_params(format!(
            "{what} {address} without tls-creds: other machines can reach it; give tls-creds \
             (and peer-name), use a loopback address or a unix: socket, or pass insecure on \
             purpose"
        )));
    }
    tracing::warn!(%address, "{what} {address} over plain TCP (insecure): unauthenticated and unencrypted");
    Ok(())
}

fn client_tls(dir: Option<&Path>) -> Result<Option<Arc<cryptblk_net::tls::rustls::ClientConfig>>> {
    dir.map(|d| {
        cryptblk_net::tls::client_config(d)
            .map(Arc::new)
            .context("loading the migration TLS credentials")
    })
    .transpose()
}

/// The answer of `migrate-cancel`.
pub enum Cancelled {
    /// An incoming migration, or an outgoing one still connecting, was told to stop.
    Requested(CancelRequested),
    Outgoing(SourceStatus),
}

impl Daemon {
    /// The disk's latest outgoing migration that has started.
    fn outgoing(&self, name: &str) -> Result<Arc<SourceMigration>> {
        let disk = self.attached(name)?;
        if let Some(m) = disk.activity.migration() {
            return Ok(m);
        }
        if disk.activity.is_starting() {
            return Err(Error::busy(format!(
                "disk \"{name}\" is still connecting to its destination"
            )));
        }
        Err(Error::conflict(format!(
            "disk \"{name}\" has no outgoing migration"
        )))
    }

    fn incoming_of(&self, name: &str) -> Option<Arc<IncomingMigration>> {
        self.incoming
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    /// Whether a migration is bringing the disk in (its header must not change).
    pub(crate) fn incoming_in_progress(&self, name: &str) -> bool {
        self.incoming_of(name)
            .is_some_and(|m| m.phase() != Phase::Completed)
    }

    /// Source: connects to the destination (each connect, TLS handshake and hello bounded by
    /// the request's connect timeout) and starts sending. No lock is held while connecting:
    /// meanwhile keyslot changes are refused as busy, and `migrate-cancel` or `disk-remove`
    /// make the start stop what it started.
    pub fn migrate_start(&self, p: &MigrateStartParams) -> Result<SourceStatus> {
        let name = p.name.as_str();
        let to = parse_address(&p.to)?;
        if p.connect_timeout == Some(0) {
            return Err(Error::invalid_params(
                "connect-timeout must be at least 1 ms",
            ));
        }
        check_transport(
            &to,
            p.tls_creds.is_some(),
            p.insecure,
            p.peer_name.as_deref(),
            "migrating to",
        )?;
        let disk = self.attached(name)?;
        if self.incoming_in_progress(name) {
            return Err(Error::busy(format!(
                "disk \"{name}\" is still being migrated in"
            )));
        }
        let mut opts = SourceOptions {
            postcopy: p.postcopy,
            preempt: p.preempt,
            max_bandwidth: p.max_bandwidth,
            break_chunks: p.break_chunks.unwrap_or(true),
            tls: client_tls(p.tls_creds.as_deref())?,
            peer_name: p.peer_name.clone(),
            connect_timeout: Duration::from_millis(
                p.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT_MS),
            ),
            ..Default::default()
        };
        if let Some(c) = p.chunk_size {
            opts.chunk_size = usize::try_from(c).unwrap_or(usize::MAX);
        }
        if let Some(n) = p.max_passes {
            opts.max_passes = n;
        }
        // The image file is copied by offset: a disk whose data is moving behind a new
        // header (an encryption in place, paused) has no one offset to copy it by.
        if disk.image.segments().single_data_offset() != Some(disk.image.tracker.payload_offset()) {
            return Err(Error::busy(format!(
                "disk \"{name}\" is in mid-encryption (its data is moving behind its new LUKS2 header): finish it with reencrypt-start before migrating"
            )));
        }
        if !p.shared {
            opts.checkpoints = Some(disk.checkpoints.source(disk.image.container.size()));
        }
        let ticket = disk.activity.begin_start(name)?;
        let started = if p.shared {
            SourceMigration::start_shared(
                disk.image.container.clone(),
                disk.image.tracker.clone(),
                &to,
                opts,
            )
        } else {
            SourceMigration::start(
                disk.image.container.clone(),
                disk.image.tracker.clone(),
                &to,
                opts,
            )
        };
        let cancelled = ticket.finish(started.as_ref().ok().cloned());
        let m = started.with_context(|| format!("starting the migration of disk \"{name}\""))?;
        if cancelled {
            tracing::info!(disk = %name, "migration cancelled while it was connecting");
            if m.cancel().is_ok() {
                m.wait(Duration::from_secs(30));
            }
        }
        Ok(source_status(&m))
    }

    pub fn migrate_switchover(&self, name: &str, postcopy: Option<bool>) -> Result<SourceStatus> {
        let m = self.outgoing(name)?;
        match postcopy {
            Some(p) => m.switchover(p),
            None => m.switchover_default(),
        }
        .with_context(|| format!("switching disk \"{name}\" over"))?;
        Ok(source_status(&m))
    }

    pub fn migrate_cancel(&self, name: &str) -> Result<Cancelled> {
        if let Some(m) = self.incoming_of(name) {
            if !m.phase().is_final() {
                m.cancel().context("cancelling the incoming migration")?;
                return Ok(Cancelled::Requested(CancelRequested {
                    name: name.to_string(),
                    cancelled: "incoming".into(),
                }));
            }
        }
        let disk = self.attached(name)?;
        match disk.activity.cancel_target() {
            CancelTarget::Starting => Ok(Cancelled::Requested(CancelRequested {
                name: name.to_string(),
                cancelled: "starting".into(),
            })),
            CancelTarget::Started(m) => {
                m.cancel().context("cancelling the migration")?;
                m.wait(Duration::from_secs(30));
                Ok(Cancelled::Outgoing(source_status(&m)))
            }
            CancelTarget::Nothing => Err(Error::conflict(format!(
                "disk \"{name}\" has no outgoing migration"
            ))),
        }
    }

    pub fn migrate_recover(&self, name: &str, to: &str) -> Result<SourceStatus> {
        let to = parse_address(to)?;
        let m = self.outgoing(name)?;
        m.recover(&to).context("recovering the migration")?;
        Ok(source_status(&m))
    }

    pub fn migrate_status(&self, name: &str) -> Result<MigrationStatus> {
        let incoming = self.incoming_of(name);
        let outgoing = match self.attached(name) {
            Ok(d) if d.activity.is_starting() && d.activity.migration().is_none() => {
                return Err(Error::busy(format!(
                    "disk \"{name}\" is still connecting to its destination"
                )))
            }
            Ok(d) => d.activity.migration(),
            Err(_) if incoming.is_some() => None,
            Err(e) => return Err(e),
        };
        if incoming.is_none() && outgoing.is_none() {
            return Err(Error::conflict(format!("disk \"{name}\" has no migration")));
        }
        let outgoing = outgoing.map(|m| source_status(&m));
        let incoming = incoming.map(|m| destination_status(&m.status()));
        let phase = outgoing
            .as_ref()
            .map(|s| s.phase.clone())
            .or_else(|| incoming.as_ref().map(|s| s.phase.clone()))
            .unwrap_or_default();
        Ok(MigrationStatus {
            name: name.to_string(),
            phase,
            outgoing,
            incoming,
        })
    }

    /// Destination: listens for a migration of the disk `p` describes into the new image
    /// `p.image`; attaches the disk once its header has arrived. `passphrase`, when given
    /// (passed by descriptor), opens it instead of `p.key_file`.
    pub fn migrate_incoming(
        self: &Arc<Self>,
        p: MigrateIncomingParams,
        passphrase: Option<Passphrase>,
    ) -> Result<Listening> {
        let listen = parse_address(&p.listen)?;
        check_transport(
            &listen,
            p.tls_creds.is_some(),
            p.insecure,
            p.peer_name.as_deref(),
            "listening for a migration on",
        )?;
        let peer_names = p
            .peer_name
            .as_deref()
            .map(|name| {
                cryptblk_net::tls::AllowList::new([name])
                    .map_err(|e| Error::invalid_params(format!("peer-name: {e}")))
            })
            .transpose()?;
        let tls = p
            .tls_creds
            .as_deref()
            .map(|d| {
                cryptblk_net::tls::server_config(d)
                    .map(Arc::new)
                    .context("loading the migration TLS credentials")
            })
            .transpose()?;
        let mut config = DiskConfig::new(p.name, p.image);
        config.key_file = p.key_file;
        config.vhost_user_blk = p.vhost_user_blk;
        config.nbd_export = p.nbd_export;
        config.num_queues = p.num_queues.unwrap_or(DiskConfig::DEFAULT_NUM_QUEUES);
        config.queue_size = p.queue_size.unwrap_or(DiskConfig::DEFAULT_QUEUE_SIZE);
        config.discard = p.discard;
        self.reserve(&config)?;
        let store: Arc<dyn IncomingStore> = match config.image.rbd() {
            Some(name) => match crate::rbd::incoming_store(name) {
                Ok(store) => store,
                Err(e) => {
                    self.unreserve(&config.name);
                    return Err(e);
                }
            },
            None => Arc::new(NewFile(config.image.path().to_path_buf())),
        };
        let options = ListenOptions {
            tls,
            peer_names,
            // The disk is published once its header arrived and opened: the source's
            // switchover waits for that, so a VM connected here never misses its export.
            announces_ready: true,
            ..Default::default()
        };
        let incoming = match IncomingMigration::listen_with(&listen, store, options) {
            Ok(m) => m,
            Err(e) => {
                self.unreserve(&config.name);
                return Err(Error::caused("listening for the migration", e));
            }
        };
        let address = incoming.address().to_string();
        self.incoming
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(config.name.clone(), incoming.clone());
        let daemon = self.clone();
        let name = config.name.clone();
        let reported_name = name.clone();
        std::thread::Builder::new()
            .name(format!("incoming-{name}"))
            .spawn(move || {
                if let Err(e) = daemon.attach_incoming(config, passphrase, &incoming) {
                    tracing::error!(disk = %name, "incoming migration: {}", chain(&e));
                    let _ = incoming.cancel();
                }
            })
            .context("starting the incoming migration thread")?;
        Ok(Listening {
            name: reported_name,
            listen: address,
        })
    }

    fn attach_incoming(
        &self,
        config: DiskConfig,
        passphrase: Option<Passphrase>,
        incoming: &Arc<IncomingMigration>,
    ) -> Result<()> {
        let ready = match incoming.wait_header(HEADER_WAIT) {
            Ok(r) => r,
            Err(e) => {
                self.unreserve(&config.name);
                return Err(Error::caused("waiting for the image header", e));
            }
        };
        let gate = |inner| -> Result<Arc<dyn cryptblk_block::BlockDevice>> {
            let disk: Arc<dyn cryptblk_block::BlockDevice> =
                incoming.disk(inner).context("gating the received disk")?;
            Ok(disk)
        };
        let image = match open_received(&config, passphrase, ready.file, &self.open_context(), gate)
        {
            Ok(i) => i,
            Err(e) => {
                self.unreserve(&config.name);
                return Err(e);
            }
        };
        let name = config.name.clone();
        let image_path = config.image.path().to_path_buf();
        // Before the disk serves: writes are recorded from the first one.
        let checkpoints =
            crate::disk_checkpoints::DiskCheckpoints::receive(&config, &image, incoming);
        if let Err(e) = self.publish(PreparedDisk {
            config,
            image,
            migrated_in: Some(checkpoints.clone()),
        }) {
            checkpoints.discard_arriving(&image_path);
            return Err(e);
        }
        // Its vhost-user socket and NBD export are up: the source may switch over now.
        if let Err(e) = incoming.ready() {
            tracing::warn!(disk = %name, "telling the source the disk serves: {e}");
        }
        // A migration that fails before the destination went live leaves nothing usable:
        // the disk goes away again (its partial image was removed by the migration).
        let phase = loop {
            let phase = incoming.wait_for(Phase::Completed, Duration::from_secs(3600));
            if phase.is_final() {
                break phase;
            }
        };
        if phase != Phase::Completed {
            tracing::warn!(disk = %name, "incoming migration {phase}; detaching the disk");
            let removed = self.remove_disk(&name, true);
            checkpoints.discard_arriving(&image_path);
            removed?;
        }
        Ok(())
    }
}

fn ms(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64() * 1000.0)
}

pub(crate) fn source_status(m: &SourceMigration) -> SourceStatus {
    let s = m.status();
    SourceStatus {
        role: "source".into(),
        phase: s.phase.name().to_string(),
        error: s.error,
        postcopy: s.postcopy,
        preempt: s.preempt,
        shared: s.shared,
        bytes_sent: s.bytes_sent,
        zero_bytes: s.zero_bytes,
        chunks: s.chunks,
        passes: s.passes,
        dirty_blocks: s.dirty_blocks,
        dirty_bytes: s.dirty_bytes,
        granularity: s.granularity,
        elapsed_seconds: s.elapsed.as_secs_f64(),
        throughput_bytes_per_sec: s.throughput_bytes_per_sec,
        urgent_requests_served: s.urgent_served,
        downtime_ms: ms(s.downtime),
        switchover_pending: s.switchover_pending,
    }
}

pub(crate) fn destination_status(s: &IncomingStatus) -> DestinationStatus {
    DestinationStatus {
        role: "destination".into(),
        phase: s.phase.name().to_string(),
        error: s.error.clone(),
        listen: s.address.clone(),
        disk_size: s.disk_size,
        bytes_received: s.bytes_received,
        zero_bytes: s.zero_bytes,
        chunks: s.chunks,
        passes: s.passes,
        missing_blocks: s.missing_blocks,
        granularity: s.granularity,
        elapsed_seconds: s.elapsed.as_secs_f64(),
        on_demand: OnDemand {
            requests: s.urgent_requests,
            latency_us: LatencySummary {
                count: s.latency.count,
                avg: s.latency.avg_us,
                p50: s.latency.p50_us,
                p99: s.latency.p99_us,
                max: s.latency.max_us,
            },
        },
    }
}
