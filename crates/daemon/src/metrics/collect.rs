//! What `/metrics` shows, taken at request time from the counters the daemon keeps anyway:
//! per disk and per vhost-user queue (and per NBD export) the request counters and latency
//! histograms of `cryptblk_block::IoStats`, the crypto pool, each disk's engine and cipher,
//! migrations (the same figures as `migrate-status`) and the build.
use super::exposition::{Exposition, Kind};
use crate::migrate::{destination_status, source_status};
use crate::registry::Daemon;
use cryptblk_block::{IoKind, IoStatsSnapshot};
use cryptblk_control::api::{DestinationStatus, SourceStatus};
use std::sync::PoisonError;

/// One set of request counters: a vhost-user queue or an NBD export of a disk.
struct Series {
    disk: String,
    export: &'static str,
    /// The virtqueue index; NBD connections share one set per export.
    queue: Option<String>,
    stats: IoStatsSnapshot,
}

impl Series {
    fn labels(&self) -> Vec<(&str, &str)> {
        let mut labels = vec![("disk", self.disk.as_str()), ("export", self.export)];
        if let Some(q) = &self.queue {
            labels.push(("queue", q.as_str()));
        }
        labels
    }
}

/// The request kinds with their own counters and histograms.
const TIMED: [IoKind; 4] = [IoKind::Read, IoKind::Write, IoKind::Flush, IoKind::Discard];

impl Daemon {
    /// The metrics page: Prometheus text format 0.0.4.
    pub fn render_metrics(&self) -> String {
        let mut e = Exposition::default();
        let disks = self.attached_disks();

        e.family(
            "cryptblk_build_info",
            Kind::Gauge,
            "Always 1; the version of the cryptblk daemon serving.",
        );
        e.sample(
            "cryptblk_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))],
            1u64,
        );
        e.family(
            "cryptblk_uptime_seconds",
            Kind::Gauge,
            "Time since the daemon started.",
        );
        e.sample(
            "cryptblk_uptime_seconds",
            &[],
            self.started.elapsed().as_secs_f64(),
        );
        self.render_pool(&mut e);
        render_memory(&mut e);

        e.family(
            "cryptblk_disk_info",
            Kind::Gauge,
            "Always 1 for each attached disk, with its image, format, host cache mode and I/O engine.",
        );
        for d in &disks {
            let format = d.image.format().name();
            e.sample(
                "cryptblk_disk_info",
                &[
                    ("disk", d.name()),
                    ("image", &d.config.image.to_string()),
                    ("format", format),
                    ("cache", d.config.cache.name()),
                    ("aio", d.config.aio.name()),
                    ("readonly", if d.read_only() { "true" } else { "false" }),
                ],
                1u64,
            );
        }
        e.family(
            "cryptblk_disk_size_bytes",
            Kind::Gauge,
            "Size of the disk the guest sees.",
        );
        for d in &disks {
            e.sample(
                "cryptblk_disk_size_bytes",
                &[("disk", d.name())],
                d.image.device.size(),
            );
        }
        e.family(
            "cryptblk_crypto_engine_info",
            Kind::Gauge,
            "Always 1 for each LUKS disk: the sector-crypto engine chosen and the cipher.",
        );
        for d in &disks {
            if let Some(luks) = d.image.luks() {
                let (engine, cipher, bits) = (luks.engine, &luks.cipher, luks.key_bits);
                e.sample(
                    "cryptblk_crypto_engine_info",
                    &[
                        ("disk", d.name()),
                        ("engine", engine),
                        ("cipher", cipher),
                        ("key_bits", &bits.to_string()),
                    ],
                    1u64,
                );
            }
        }
        e.family(
            "cryptblk_vhost_user_blk_connected",
            Kind::Gauge,
            "1 while a vhost-user frontend (a VM) is connected to the disk's socket.",
        );
        for d in &disks {
            if let Some(v) = &d.vhost {
                e.sample(
                    "cryptblk_vhost_user_blk_connected",
                    &[("disk", d.name())],
                    u64::from(v.stop.is_connected()),
                );
            }
        }
        e.family(
            "cryptblk_nbd_connections",
            Kind::Gauge,
            "NBD clients connected to the disk's export.",
        );
        for d in disks.iter().filter(|d| d.nbd_exported) {
            let n = self.nbd.as_ref().map_or(0, |r| r.connections(d.name()));
            e.sample("cryptblk_nbd_connections", &[("disk", d.name())], n as u64);
        }

        let mut series = Vec::new();
        for d in &disks {
            if let Some(v) = &d.vhost {
                for (i, stats) in v.stop.queue_stats().into_iter().enumerate() {
                    series.push(Series {
                        disk: d.name().to_string(),
                        export: "vhost-user-blk",
                        queue: Some(i.to_string()),
                        stats,
                    });
                }
            }
            if d.nbd_exported {
                series.push(Series {
                    disk: d.name().to_string(),
                    export: "nbd",
                    queue: None,
                    stats: d.nbd_stats.snapshot(),
                });
            }
        }
        render_io(&mut e, &series);
        self.render_migrations(&mut e, &disks);
        render_reencryption(&mut e, &disks);
        e.finish()
    }

    fn render_pool(&self, e: &mut Exposition) {
        e.family(
            "cryptblk_crypto_pool_threads",
            Kind::Gauge,
            "Worker threads of the shared crypto pool.",
        );
        e.sample(
            "cryptblk_crypto_pool_threads",
            &[],
            self.pool.threads() as u64,
        );
        e.family(
            "cryptblk_crypto_pool_busy_seconds_total",
            Kind::Counter,
            "Time the crypto pool's workers spent encrypting and decrypting, summed over workers.",
        );
        e.sample(
            "cryptblk_crypto_pool_busy_seconds_total",
            &[],
            self.pool.busy_time().as_secs_f64(),
        );
        e.family(
            "cryptblk_crypto_pool_utilisation_ratio",
            Kind::Gauge,
            "Average share of the crypto pool workers' time spent working since the start (0 to 1).",
        );
        e.sample(
            "cryptblk_crypto_pool_utilisation_ratio",
            &[],
            self.pool.utilisation(),
        );
    }

    fn render_migrations(
        &self,
        e: &mut Exposition,
        disks: &[std::sync::Arc<crate::disk::AttachedDisk>],
    ) {
        let outgoing: Vec<(String, SourceStatus)> = disks
            .iter()
            .filter_map(|d| {
                d.activity
                    .migration()
                    .map(|m| (d.name().to_string(), source_status(&m)))
            })
            .collect();
        let incoming: Vec<(String, DestinationStatus)> = self
            .incoming
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(name, m)| (name.clone(), m.clone()))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|(name, m)| (name, destination_status(&m.status())))
            .collect();

        e.family(
            "cryptblk_migration_info",
            Kind::Gauge,
            "Always 1 for each migration of a disk, with its role (source or destination) and phase.",
        );
        let info = |e: &mut Exposition, disk: &str, role: &str, phase: &str| {
            e.sample(
                "cryptblk_migration_info",
                &[("disk", disk), ("role", role), ("phase", phase)],
                1u64,
            );
        };
        for (disk, s) in &outgoing {
            info(e, disk, "source", &s.phase);
        }
        for (disk, s) in &incoming {
            info(e, disk, "destination", &s.phase);
        }
        e.family(
            "cryptblk_migration_transferred_bytes_total",
            Kind::Counter,
            "Image bytes a migration sent (source) or received (destination), data frames only.",
        );
        for (disk, s) in &outgoing {
            e.sample(
                "cryptblk_migration_transferred_bytes_total",
                &[("disk", disk), ("role", "source")],
                s.bytes_sent,
            );
        }
        for (disk, s) in &incoming {
            e.sample(
                "cryptblk_migration_transferred_bytes_total",
                &[("disk", disk), ("role", "destination")],
                s.bytes_received,
            );
        }
        e.family(
            "cryptblk_migration_zero_bytes_total",
            Kind::Counter,
            "Image bytes a migration moved as zero ranges (holes) instead of data.",
        );
        for (disk, s) in &outgoing {
            e.sample(
                "cryptblk_migration_zero_bytes_total",
                &[("disk", disk), ("role", "source")],
                s.zero_bytes,
            );
        }
        for (disk, s) in &incoming {
            e.sample(
                "cryptblk_migration_zero_bytes_total",
                &[("disk", disk), ("role", "destination")],
                s.zero_bytes,
            );
        }
        e.family(
            "cryptblk_migration_remaining_bytes",
            Kind::Gauge,
            "Bytes the destination does not have yet: dirty (precopy) or missing (postcopy) blocks.",
        );
        for (disk, s) in &outgoing {
            e.sample(
                "cryptblk_migration_remaining_bytes",
                &[("disk", disk), ("role", "source")],
                s.dirty_bytes,
            );
        }
        for (disk, s) in &incoming {
            e.sample(
                "cryptblk_migration_remaining_bytes",
                &[("disk", disk), ("role", "destination")],
                s.missing_blocks.saturating_mul(s.granularity),
            );
        }
        e.family(
            "cryptblk_migration_passes_total",
            Kind::Counter,
            "Precopy sweeps over the disk a migration has completed.",
        );
        for (disk, s) in &outgoing {
            e.sample(
                "cryptblk_migration_passes_total",
                &[("disk", disk), ("role", "source")],
                u64::from(s.passes),
            );
        }
        for (disk, s) in &incoming {
            e.sample(
                "cryptblk_migration_passes_total",
                &[("disk", disk), ("role", "destination")],
                u64::from(s.passes),
            );
        }
        e.family(
            "cryptblk_migration_downtime_seconds",
            Kind::Gauge,
            "Source: time the disk was fenced at switchover (once switched over).",
        );
        for (disk, s) in &outgoing {
            if let Some(ms) = s.downtime_ms {
                e.sample(
                    "cryptblk_migration_downtime_seconds",
                    &[("disk", disk)],
                    ms / 1e3,
                );
            }
        }
        e.family(
            "cryptblk_migration_urgent_requests_total",
            Kind::Counter,
            "Postcopy on-demand block requests: answered (source) or sent (destination).",
        );
        for (disk, s) in &outgoing {
            e.sample(
                "cryptblk_migration_urgent_requests_total",
                &[("disk", disk), ("role", "source")],
                s.urgent_requests_served,
            );
        }
        for (disk, s) in &incoming {
            e.sample(
                "cryptblk_migration_urgent_requests_total",
                &[("disk", disk), ("role", "destination")],
                s.on_demand.requests,
            );
        }
        e.family(
            "cryptblk_migration_on_demand_latency_seconds",
            Kind::Summary,
            "Destination: time a guest read waited for missing blocks fetched from the source.",
        );
        for (disk, s) in &incoming {
            let l = &s.on_demand.latency_us;
            for (q, us) in [("0.5", l.p50), ("0.99", l.p99)] {
                e.sample(
                    "cryptblk_migration_on_demand_latency_seconds",
                    &[("disk", disk), ("quantile", q)],
                    us as f64 / 1e6,
                );
            }
            e.sample(
                "cryptblk_migration_on_demand_latency_seconds_sum",
                &[("disk", disk)],
                l.avg * l.count as f64 / 1e6,
            );
            e.sample(
                "cryptblk_migration_on_demand_latency_seconds_count",
                &[("disk", disk)],
                l.count,
            );
        }
    }
}

/// A series' labels and `op`.
fn kind_labels(s: &Series, kind: IoKind) -> Vec<(&str, &str)> {
    let mut labels = s.labels();
    labels.push(("op", kind.name()));
    labels
}

/// The memory budget every queue reserves from, and the buffer cache.
fn render_memory(e: &mut Exposition) {
    let usage = cryptblk_block::MemoryBudget::process().usage();
    let gauges: [(&str, &str, u64); 5] = [
        (
            "cryptblk_memory_budget_bytes",
            "The memory budget for request data (--memory-budget).",
            usage.limit,
        ),
        (
            "cryptblk_memory_reserved_bytes",
            "Bytes of the budget reserved by requests under way.",
            usage.reserved,
        ),
        (
            "cryptblk_memory_reserved_peak_bytes",
            "The most bytes of the budget reserved at once since the start.",
            usage.peak,
        ),
        (
            "cryptblk_memory_waiting_queues",
            "Queues (virtqueues, NBD connections) waiting for room in the budget.",
            usage.waiting as u64,
        ),
        (
            "cryptblk_memory_cached_bytes",
            "Free request buffers kept for reuse (given back after a second unused).",
            cryptblk_block::buffers::kept_bytes(),
        ),
    ];
    for (name, help, value) in gauges {
        e.family(name, Kind::Gauge, help);
        e.sample(name, &[], value);
    }
    e.family(
        "cryptblk_memory_waits_total",
        Kind::Counter,
        "Requests that waited for room in the memory budget.",
    );
    e.sample("cryptblk_memory_waits_total", &[], usage.waits);
}

fn render_io(e: &mut Exposition, series: &[Series]) {
    e.family(
        "cryptblk_io_requests_total",
        Kind::Counter,
        "Requests completed successfully, by operation (WRITE_ZEROES counts as write).",
    );
    for s in series {
        let counts = [
            s.stats.reads,
            s.stats.writes,
            s.stats.flushes,
            s.stats.discards,
        ];
        for (kind, n) in TIMED.into_iter().zip(counts) {
            e.sample("cryptblk_io_requests_total", &kind_labels(s, kind), n);
        }
    }
    e.family(
        "cryptblk_io_bytes_total",
        Kind::Counter,
        "Payload bytes of successful reads and writes.",
    );
    for s in series {
        for (kind, n) in [
            (IoKind::Read, s.stats.read_bytes),
            (IoKind::Write, s.stats.write_bytes),
        ] {
            e.sample("cryptblk_io_bytes_total", &kind_labels(s, kind), n);
        }
    }
    e.family(
        "cryptblk_io_errors_total",
        Kind::Counter,
        "Requests that failed, by operation (other: requests of any other type, e.g. GET_ID).",
    );
    for s in series {
        for kind in IoKind::ALL {
            e.sample(
                "cryptblk_io_errors_total",
                &kind_labels(s, kind),
                s.stats.errors_by_kind[kind as usize],
            );
        }
    }
    e.family(
        "cryptblk_io_in_flight_requests",
        Kind::Gauge,
        "Requests taken and not yet completed.",
    );
    for s in series {
        e.sample(
            "cryptblk_io_in_flight_requests",
            &s.labels(),
            s.stats.in_flight,
        );
    }
    e.family(
        "cryptblk_io_request_duration_seconds",
        Kind::Histogram,
        "Time from taking a request to completing it, of successful requests.",
    );
    for s in series {
        for kind in TIMED {
            e.histogram(
                "cryptblk_io_request_duration_seconds",
                &kind_labels(s, kind),
                &s.stats.latency[kind as usize],
            );
        }
    }
}

/// The online reencryption's progress of each LUKS disk that has one (paused ones too).
fn render_reencryption(e: &mut Exposition, disks: &[std::sync::Arc<crate::disk::AttachedDisk>]) {
    let progress: Vec<(&str, u64)> = disks
        .iter()
        .filter(|d| d.image.luks().is_some())
        .map(|d| (d.name(), d.reencryption.bytes_done()))
        .collect();
    e.family(
        "cryptblk_reencrypt_done_bytes",
        Kind::Gauge,
        "Bytes of the volume an online reencryption has rewritten with the new key (0 before one starts; the size once finished, until the disk is attached again).",
    );
    for (disk, done) in progress {
        e.sample("cryptblk_reencrypt_done_bytes", &[("disk", disk)], done);
    }
}
