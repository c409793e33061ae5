//! `stats`: counters of every queue and export, and of the crypto pool.
use crate::disk::AttachedDisk;
use crate::error::{Error, Result};
use crate::registry::Daemon;
use cryptblk_block::IoStatsSnapshot;
use cryptblk_control::api::{
    DiskStats, IoCounters, Latency, NbdStats, PoolStats, Stats, VhostStats,
};

impl Daemon {
    /// Statistics of the disk `name`, or of every attached disk.
    pub fn stats(&self, name: Option<&str>) -> Result<Stats> {
        let disks = match name {
            Some(name) => vec![self.attached(name).map_err(|_| Error::no_such_disk(name))?],
            None => self.attached_disks(),
        };
        Ok(Stats {
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            crypto_pool: PoolStats {
                threads: self.pool.threads(),
                busy_seconds: self.pool.busy_time().as_secs_f64(),
                utilisation: self.pool.utilisation(),
            },
            disks: disks.iter().map(|d| self.disk_stats(d)).collect(),
        })
    }

    fn disk_stats(&self, disk: &AttachedDisk) -> DiskStats {
        let mut total = IoStatsSnapshot::default();
        let vhost_user_blk = disk.vhost.as_ref().map(|v| {
            let queues = v.stop.queue_stats();
            for q in &queues {
                total.merge(q);
            }
            VhostStats {
                socket: v.socket.clone(),
                connected: v.stop.is_connected(),
                queues: queues.iter().map(counters).collect(),
            }
        });
        let nbd = disk.nbd_exported.then(|| {
            let snap = disk.nbd_stats.snapshot();
            total.merge(&snap);
            NbdStats {
                counters: counters(&snap),
                connections: self.nbd.as_ref().map_or(0, |r| r.connections(disk.name())),
            }
        });
        DiskStats {
            name: disk.name().to_string(),
            engine: disk.image.luks().map(|l| l.engine.to_string()),
            vhost_user_blk,
            nbd,
            total: counters(&total),
        }
    }
}

fn counters(s: &IoStatsSnapshot) -> IoCounters {
    IoCounters {
        read_ops: s.reads,
        read_bytes: s.read_bytes,
        write_ops: s.writes,
        write_bytes: s.write_bytes,
        flush_ops: s.flushes,
        discard_ops: s.discards,
        errors: s.errors,
        in_flight: s.in_flight,
        read_latency_us: Latency {
            p50: s.read_p50_us,
            p99: s.read_p99_us,
        },
        write_latency_us: Latency {
            p50: s.write_p50_us,
            p99: s.write_p99_us,
        },
    }
}
