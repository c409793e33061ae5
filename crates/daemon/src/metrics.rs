//! The daemon's statistics in Prometheus' text exposition format (version 0.0.4): the same
//! counters as `ctl stats`, per disk and per export (each vhost-user queue, the NBD export),
//! with latency histograms whose buckets add up across queues. Base units: seconds, bytes.
//! Nothing here comes near key material: names, image paths and counters only.
use crate::registry::Daemon;
use cryptblk_block::{exported_bound_ns, ExportedHistogram, IoStatsSnapshot, EXPORTED_BOUNDS};
use std::fmt::Write;

/// A label value with `\`, `"` and newlines escaped as the format requires.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One exported set of counters and its labels (`disk="..",export="vhost-user-blk",queue="0"`).
struct Series {
    labels: String,
    stats: IoStatsSnapshot,
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn histogram(out: &mut String, name: &str, labels: &str, h: &ExportedHistogram) {
    for (i, below) in h.below.iter().enumerate().take(EXPORTED_BOUNDS) {
        let le = exported_bound_ns(i) as f64 / 1e9;
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {below}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum_ns as f64 / 1e9);
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
}

impl Daemon {
    /// Every metric, rendered at the moment of the call.
    pub fn metrics(&self) -> String {
        let mut series = Vec::new();
        let mut disks = Vec::new();
        for disk in self.attached_disks() {
            let name = escape(disk.name());
            disks.push((
                name.clone(),
                escape(&disk.config.image.to_string()),
                disk.image.engine.unwrap_or("none"),
                disk.read_only(),
            ));
            if let Some(v) = &disk.vhost {
                for (q, stats) in v.stop.queue_stats().into_iter().enumerate() {
                    series.push(Series {
                        labels: format!("disk=\"{name}\",export=\"vhost-user-blk\",queue=\"{q}\""),
                        stats,
                    });
                }
            }
            if disk.nbd_exported {
                series.push(Series {
                    labels: format!("disk=\"{name}\",export=\"nbd\",queue=\"0\""),
                    stats: disk.nbd_stats.snapshot(),
                });
            }
        }

        let mut out = String::with_capacity(4096 + series.len() * 4096);
        family(
            &mut out,
            "cryptblk_build_info",
            "gauge",
            "The cryptblk version serving (always 1).",
        );
        let _ = writeln!(
            out,
            "cryptblk_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        family(
            &mut out,
            "cryptblk_uptime_seconds",
            "gauge",
            "Seconds since the daemon started.",
        );
        let _ = writeln!(
            out,
            "cryptblk_uptime_seconds {}",
            self.started.elapsed().as_secs_f64()
        );
        family(
            &mut out,
            "cryptblk_crypto_pool_threads",
            "gauge",
            "Worker threads of the crypto pool.",
        );
        let _ = writeln!(out, "cryptblk_crypto_pool_threads {}", self.pool.threads());
        family(
            &mut out,
            "cryptblk_crypto_pool_busy_seconds_total",
            "counter",
            "Time the crypto pool's workers spent encrypting and decrypting, summed over workers.",
        );
        let _ = writeln!(
            out,
            "cryptblk_crypto_pool_busy_seconds_total {}",
            self.pool.busy_time().as_secs_f64()
        );
        family(&mut out, "cryptblk_disks", "gauge", "Disks being served.");
        let _ = writeln!(out, "cryptblk_disks {}", disks.len());
        family(
            &mut out,
            "cryptblk_disk_info",
            "gauge",
            "A served disk (always 1): its image, I/O engine and whether it is read-only.",
        );
        for (name, image, engine, read_only) in &disks {
            let _ = writeln!(
                out,
                "cryptblk_disk_info{{disk=\"{name}\",image=\"{image}\",engine=\"{engine}\",readonly=\"{read_only}\"}} 1"
            );
        }

        type Counter = fn(&IoStatsSnapshot) -> u64;
        let counters: [(&str, &str, &str, Counter); 8] = [
            (
                "cryptblk_read_requests_total",
                "counter",
                "Read requests completed.",
                |s| s.reads,
            ),
            ("cryptblk_read_bytes_total", "counter", "Bytes read.", |s| {
                s.read_bytes
            }),
            (
                "cryptblk_write_requests_total",
                "counter",
                "Write requests completed (write-zeroes included).",
                |s| s.writes,
            ),
            (
                "cryptblk_written_bytes_total",
                "counter",
                "Bytes written.",
                |s| s.write_bytes,
            ),
            (
                "cryptblk_flush_requests_total",
                "counter",
                "Flush requests completed.",
                |s| s.flushes,
            ),
            (
                "cryptblk_discard_requests_total",
                "counter",
                "Discard requests completed.",
                |s| s.discards,
            ),
            (
                "cryptblk_request_errors_total",
                "counter",
                "Requests answered with an error.",
                |s| s.errors,
            ),
            (
                "cryptblk_requests_in_flight",
                "gauge",
                "Requests taken from the guest or client and not yet answered.",
                |s| s.in_flight,
            ),
        ];
        for (name, kind, help, value) in counters {
            family(&mut out, name, kind, help);
            for s in &series {
                let _ = writeln!(out, "{name}{{{}}} {}", s.labels, value(&s.stats));
            }
        }
        family(
            &mut out,
            "cryptblk_read_latency_seconds",
            "histogram",
            "Time from taking a read request to answering it.",
        );
        for s in &series {
            histogram(
                &mut out,
                "cryptblk_read_latency_seconds",
                &s.labels,
                &s.stats.read_latency,
            );
        }
        family(
            &mut out,
            "cryptblk_write_latency_seconds",
            "histogram",
            "Time from taking a write request to answering it.",
        );
        for s in &series {
            histogram(
                &mut out,
                "cryptblk_write_latency_seconds",
                &s.labels,
                &s.stats.write_latency,
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
