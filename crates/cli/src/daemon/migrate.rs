//! Live migration verbs of the daemon. The source side copies an attached disk's image file to
//! another daemon while the disk keeps serving; the destination side receives it into a new
//! image and attaches it as soon as its header has arrived (I/O on it waits for switchover).
//! The switchover happens when asked (`migrate-switchover`, `migrate-postcopy`) or when the
//! disk's VM is stopped for migration (vhost-user frontend stops the queues with dirty-page
//! logging on, which QEMU does at the end of a live migration).

use super::disk::{open_received, DiskConfig};
use super::{Daemon, DaemonError, PreparedDisk};
use anyhow::{anyhow, bail, Context, Result};
use cryptblk_migration::{
    IncomingMigration, IncomingStatus, MigrationAddress, Phase, SourceMigration, SourceOptions,
    SourceStatus,
};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

/// How long a destination waits for the source to send the image header.
const HEADER_WAIT: Duration = Duration::from_secs(24 * 3600);

/// What `migrate-start` asks for.
#[derive(Debug, Clone)]
pub struct StartRequest {
    pub to: MigrationAddress,
    pub postcopy: bool,
    pub preempt: bool,
    pub chunk_size: Option<usize>,
    pub max_bandwidth: Option<u64>,
    pub break_chunks: bool,
    pub max_passes: Option<u32>,
    pub tls_creds: Option<std::path::PathBuf>,
}

fn client_tls(dir: Option<&Path>) -> Result<Option<Arc<cryptblk_tls::rustls::ClientConfig>>> {
    dir.map(|d| {
        cryptblk_tls::client_config(d)
            .map(Arc::new)
            .context("loading the migration TLS credentials")
    })
    .transpose()
}

impl Daemon {
    fn outgoing(&self, name: &str) -> Result<Arc<SourceMigration>> {
        let disk = self.attached(name)?;
        let m = disk
            .migration
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        m.ok_or_else(|| {
            anyhow!(DaemonError::Conflict(format!(
                "disk \"{name}\" has no outgoing migration"
            )))
        })
    }

    fn incoming_of(&self, name: &str) -> Option<Arc<IncomingMigration>> {
        self.incoming
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    /// Whether the disk's header must not change now (a migration copies it or brought it).
    pub(super) fn migration_in_progress(&self, name: &str) -> bool {
        let outgoing = self.attached(name).ok().and_then(|d| {
            d.migration
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        });
        let out_busy = outgoing.is_some_and(|m| !m.status().phase.is_final());
        let in_busy = self
            .incoming_of(name)
            .is_some_and(|m| m.phase() != Phase::Completed);
        out_busy || in_busy
    }

    pub fn migrate_start(&self, name: &str, req: StartRequest) -> Result<Value> {
        let disk = self.attached(name)?;
        if self
            .incoming_of(name)
            .is_some_and(|m| m.phase() != Phase::Completed)
        {
            bail!(DaemonError::Busy(format!(
                "disk \"{name}\" is still being migrated in"
            )));
        }
        let mut slot = disk
            .migration
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(m) = slot.as_ref() {
            let phase = m.status().phase;
            if !matches!(phase, Phase::Failed | Phase::Cancelled) {
                bail!(DaemonError::Busy(format!(
                    "disk \"{name}\" already has a migration in phase {phase}"
                )));
            }
        }
        let mut opts = SourceOptions {
            postcopy: req.postcopy,
            preempt: req.preempt,
            max_bandwidth: req.max_bandwidth,
            break_chunks: req.break_chunks,
            tls: client_tls(req.tls_creds.as_deref())?,
            ..Default::default()
        };
        if let Some(c) = req.chunk_size {
            opts.chunk_size = c;
        }
        if let Some(p) = req.max_passes {
            opts.max_passes = p;
        }
        let _header = disk
            .header_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let m = SourceMigration::start(
            disk.image.file.clone(),
            disk.image.tracker.clone(),
            &req.to,
            opts,
        )
        .with_context(|| format!("starting the migration of disk \"{name}\""))?;
        *slot = Some(m.clone());
        Ok(source_json(&m.status()))
    }

    pub fn migrate_switchover(&self, name: &str, postcopy: Option<bool>) -> Result<Value> {
        let m = self.outgoing(name)?;
        match postcopy {
            Some(p) => m.switchover(p),
            None => m.switchover_default(),
        }
        .with_context(|| format!("switching disk \"{name}\" over"))?;
        Ok(source_json(&m.status()))
    }

    pub fn migrate_cancel(&self, name: &str) -> Result<Value> {
        if let Some(m) = self.incoming_of(name) {
            if !m.phase().is_final() {
                m.cancel().context("cancelling the incoming migration")?;
                return Ok(json!({ "name": name, "cancelled": "incoming" }));
            }
        }
        let m = self.outgoing(name)?;
        m.cancel().context("cancelling the migration")?;
        m.wait(Duration::from_secs(30));
        Ok(source_json(&m.status()))
    }

    pub fn migrate_recover(&self, name: &str, to: &MigrationAddress) -> Result<Value> {
        let m = self.outgoing(name)?;
        m.recover(to).context("recovering the migration")?;
        Ok(source_json(&m.status()))
    }

    pub fn migrate_status(&self, name: &str) -> Result<Value> {
        let incoming = self.incoming_of(name);
        let outgoing = match self.attached(name) {
            Ok(d) => d
                .migration
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
            Err(_) if incoming.is_some() => None,
            Err(e) => return Err(e),
        };
        if incoming.is_none() && outgoing.is_none() {
            bail!(DaemonError::Conflict(format!(
                "disk \"{name}\" has no migration"
            )));
        }
        let out = outgoing.map(|m| source_json(&m.status()));
        let inc = incoming.map(|m| destination_json(&m.status()));
        let phase = out
            .as_ref()
            .or(inc.as_ref())
            .map(|v| v["phase"].clone())
            .unwrap_or(Value::Null);
        Ok(json!({ "name": name, "phase": phase, "outgoing": out, "incoming": inc }))
    }

    /// Destination: listens for a migration of the disk `config` describes into the new image
    /// `config.image`; attaches the disk once its header has arrived.
    pub fn migrate_incoming(
        self: &Arc<Self>,
        config: DiskConfig,
        listen: &MigrationAddress,
        tls_creds: Option<&Path>,
    ) -> Result<Value> {
        let tls = tls_creds
            .map(|d| {
                cryptblk_tls::server_config(d, cryptblk_tls::ClientAuth::Required)
                    .map(Arc::new)
                    .context("loading the migration TLS credentials")
            })
            .transpose()?;
        self.reserve(&config)?;
        let incoming = match IncomingMigration::listen(listen, &config.image, tls) {
            Ok(m) => m,
            Err(e) => {
                self.disks().remove(&config.name);
                return Err(anyhow!(e).context("listening for the migration"));
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
                if let Err(e) = daemon.attach_incoming(config, &incoming) {
                    eprintln!("cryptblk: incoming migration of disk \"{name}\": {e:#}");
                    let _ = incoming.cancel();
                }
            })
            .context("starting the incoming migration thread")?;
        Ok(json!({ "name": reported_name, "listen": address }))
    }

    fn attach_incoming(&self, config: DiskConfig, incoming: &Arc<IncomingMigration>) -> Result<()> {
        let ready = match incoming.wait_header(HEADER_WAIT) {
            Ok(r) => r,
            Err(e) => {
                self.disks().remove(&config.name);
                return Err(e.into());
            }
        };
        let gate =
            |inner| -> Result<Arc<dyn cryptblk_block::BlockDevice>> { Ok(incoming.disk(inner)?) };
        let image = match open_received(&config, ready.file, &self.pool, &self.unlock, gate) {
            Ok(i) => i,
            Err(e) => {
                self.disks().remove(&config.name);
                return Err(e);
            }
        };
        let name = config.name.clone();
        self.publish(PreparedDisk { config, image })?;
        // A migration that fails before the destination went live leaves nothing usable:
        // the disk goes away again (its partial image was removed by the migration).
        let phase = loop {
            let phase = incoming.wait_for(Phase::Completed, Duration::from_secs(3600));
            if phase.is_final() {
                break phase;
            }
        };
        if phase != Phase::Completed {
            eprintln!("cryptblk: incoming migration of disk \"{name}\" {phase}; detaching it");
            self.remove_disk(&name, true)?;
        }
        Ok(())
    }
}

fn ms(d: Option<Duration>) -> Value {
    d.map(|d| json!(d.as_secs_f64() * 1000.0))
        .unwrap_or(Value::Null)
}

fn source_json(s: &SourceStatus) -> Value {
    json!({
        "role": "source",
        "phase": s.phase.name(),
        "error": s.error,
        "postcopy": s.postcopy,
        "preempt": s.preempt,
        "bytes-sent": s.bytes_sent,
        "zero-bytes": s.zero_bytes,
        "chunks": s.chunks,
        "passes": s.passes,
        "dirty-blocks": s.dirty_blocks,
        "dirty-bytes": s.dirty_bytes,
        "granularity": s.granularity,
        "elapsed-seconds": s.elapsed.as_secs_f64(),
        "throughput-bytes-per-sec": s.throughput_bytes_per_sec,
        "urgent-requests-served": s.urgent_served,
        "downtime-ms": ms(s.downtime),
    })
}

fn destination_json(s: &IncomingStatus) -> Value {
    json!({
        "role": "destination",
        "phase": s.phase.name(),
        "error": s.error,
        "listen": s.address,
        "disk-size": s.disk_size,
        "bytes-received": s.bytes_received,
        "zero-bytes": s.zero_bytes,
        "chunks": s.chunks,
        "passes": s.passes,
        "missing-blocks": s.missing_blocks,
        "granularity": s.granularity,
        "elapsed-seconds": s.elapsed.as_secs_f64(),
        "on-demand": {
            "requests": s.urgent_requests,
            "latency-us": {
                "count": s.latency.count,
                "avg": s.latency.avg_us,
                "p50": s.latency.p50_us,
                "p99": s.latency.p99_us,
                "max": s.latency.max_us,
            },
        },
    })
}
