//! Request latency counted into fixed buckets with decimal bounds (10 µs .. 10 s), the shape a
//! Prometheus histogram exposes: a count per bucket and the sum of all latencies. Recording is
//! a search over 19 bounds and two relaxed atomic adds, without allocation or lock; the
//! quantiles `ctl stats` prints come from the finer log-linear histogram in `stats`, which
//! records the same samples.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets in nanoseconds (each bucket holds the latencies above the
/// previous bound and up to its own); a last bucket holds everything above 10 s. Steps of 1,
/// 2.5 and 5 per decade: from a page-cache hit on a fast core to a stalled device.
pub const LATENCY_BOUNDS_NS: [u64; 19] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// Buckets including the one above the last bound (`le="+Inf"`).
pub const LATENCY_BUCKETS: usize = LATENCY_BOUNDS_NS.len() + 1;

/// The live counters, shared by the threads completing requests.
pub struct LatencyBuckets {
    counts: [AtomicU64; LATENCY_BUCKETS],
    sum_ns: AtomicU64,
}

impl Default for LatencyBuckets {
    fn default() -> Self {
        LatencyBuckets {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl LatencyBuckets {
    pub fn record(&self, latency: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        let bucket = LATENCY_BOUNDS_NS.partition_point(|&bound| bound < ns);
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> BucketCounts {
        BucketCounts {
            counts: std::array::from_fn(|i| self.counts[i].load(Ordering::Relaxed)),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
        }
    }
}

/// A copy of [`LatencyBuckets`]: per-bucket counts (not cumulative; bucket `i` is bounded by
/// `LATENCY_BOUNDS_NS[i]`, the last one unbounded) and the sum of the latencies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BucketCounts {
    pub counts: [u64; LATENCY_BUCKETS],
    pub sum_ns: u64,
}

impl BucketCounts {
    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Samples at or below each bound, then the total (`le="+Inf"`): what a Prometheus
    /// histogram's `_bucket` series show.
    pub fn cumulative(&self) -> [u64; LATENCY_BUCKETS] {
        let mut total = 0;
        std::array::from_fn(|i| {
            total += self.counts[i];
            total
        })
    }

    /// Adds another queue's counts (histograms of the same buckets sum exactly).
    pub fn merge(&mut self, other: &BucketCounts) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a += b;
        }
        // Wraps like the atomic sum does (after centuries of summed latency).
        self.sum_ns = self.sum_ns.wrapping_add(other.sum_ns);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_land_at_or_below_their_bound() {
        let b = LatencyBuckets::default();
        for ns in [
            0,
            10_000,
            10_001,
            24_999,
            10_000_000_000,
            10_000_000_001,
            u64::MAX,
        ] {
            b.record(Duration::from_nanos(ns));
        }
        let snap = b.snapshot();
        assert_eq!(snap.counts[0], 2, "0 and exactly 10 µs are <= 10 µs");
        assert_eq!(snap.counts[1], 2);
        assert_eq!(snap.counts[LATENCY_BUCKETS - 2], 1, "exactly 10 s");
        assert_eq!(snap.counts[LATENCY_BUCKETS - 1], 2, "above 10 s");
        assert_eq!(snap.count(), 7);
        let cumulative = snap.cumulative();
        assert!(cumulative.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(cumulative[LATENCY_BUCKETS - 1], 7);
        let mut twice = snap;
        twice.merge(&snap);
        assert_eq!(twice.count(), 14);
        assert_eq!(twice.sum_ns, snap.sum_ns.wrapping_mul(2));
    }
}
