//! What the report knows of each metric a sample may carry: its column label, how it is
//! printed, and which way it is good (which round of a ratio of it is the worst).
use serde::{Deserialize, Serialize};

/// Which way a figure is good: the worst round is the lowest for a speed-up, the highest for
/// a time or a cost that should stay small.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Better {
    Higher,
    Lower,
}

pub struct Info {
    pub label: &'static str,
    pub digits: usize,
    /// The printed value is the figure divided by this (KiB shown as MiB).
    pub divide: f64,
    pub better: Better,
}

/// The latency a run adds over the ceiling measured next to it: its mean latency minus the
/// mean of the ceiling runs' (derived per round, not recorded).
pub const ADDED_LATENCY: &str = "added_lat_us";

const fn m(label: &'static str, digits: usize, better: Better) -> Info {
    Info {
        label,
        digits,
        divide: 1.0,
        better,
    }
}

use Better::{Higher, Lower};

const KNOWN: &[(&str, Info)] = &[
    ("iops", m("IOPS", 0, Higher)),
    ("mib_s", m("MiB/s", 1, Higher)),
    ("lat_mean_us", m("lat mean µs", 1, Lower)),
    (ADDED_LATENCY, m("added to ceiling's", 1, Lower)),
    ("lat_p50_us", m("p50", 1, Lower)),
    ("lat_p99_us", m("p99", 1, Lower)),
    ("lat_p999_us", m("p99.9", 1, Lower)),
    ("server_cpu_pct", m("server CPU %", 1, Lower)),
    ("server_cpu_us_per_io", m("server µs/IO", 2, Lower)),
    ("client_cpu_pct", m("client CPU %", 1, Lower)),
    (
        "server_rss_kib",
        Info {
            label: "server RSS MiB",
            digits: 0,
            divide: 1024.0,
            better: Lower,
        },
    ),
    ("seconds", m("s", 2, Lower)),
    (
        "peak_rss_kib",
        Info {
            label: "peak RSS MiB",
            digits: 0,
            divide: 1024.0,
            better: Lower,
        },
    ),
    ("gbps", m("GB/s", 2, Higher)),
    ("gb_per_cpu_s", m("GB per CPU-second", 2, Higher)),
    ("downtime_ms", m("downtime ms", 1, Lower)),
    ("fio_write_iops", m("fio write IOPS", 0, Higher)),
    ("ops_per_s", m("ops/s", 1, Higher)),
    ("ops", m("ops", 0, Higher)),
    ("errors", m("failed", 0, Lower)),
    ("median_us", m("median µs", 0, Lower)),
    ("count", m("waited reads", 0, Lower)),
    ("avg_us", m("avg µs", 0, Lower)),
    ("p50_us", m("p50 µs", 0, Lower)),
    ("p99_us", m("p99 µs", 0, Lower)),
    ("max_us", m("max µs", 0, Lower)),
    ("total_s", m("total s", 2, Lower)),
    ("bytes_sent", m("bytes sent", 0, Lower)),
    ("passes", m("passes", 0, Lower)),
];

/// A metric no entry names: its own name, two decimals, higher is better.
const UNKNOWN: Info = m("", 2, Higher);

pub fn info(name: &str) -> &'static Info {
    KNOWN
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(&UNKNOWN, |(_, i)| i)
}

pub fn label(name: &str) -> &str {
    match info(name).label {
        "" => name,
        l => l,
    }
}

/// `v` as the metric is printed; `n/a` for none.
pub fn show(name: &str, v: Option<f64>) -> String {
    let i = info(name);
    v.map_or_else(
        || "n/a".into(),
        |v| format!("{:.*}", i.digits, v / i.divide),
    )
}

/// The metrics of the serving matrix, in the order its detail table shows them.
pub fn matrix() -> Vec<String> {
    [
        "iops",
        "mib_s",
        "lat_mean_us",
        ADDED_LATENCY,
        "lat_p50_us",
        "lat_p99_us",
        "lat_p999_us",
        "server_cpu_pct",
        "server_cpu_us_per_io",
        "client_cpu_pct",
        "server_rss_kib",
    ]
    .map(String::from)
    .to_vec()
}
