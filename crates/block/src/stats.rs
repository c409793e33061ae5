//! I/O statistics a frontend keeps per export or per queue: operation and byte counters,
//! requests in flight, and latency histograms. Lock-free (relaxed atomics), so recording costs
//! a few uncontended atomic adds per request and a reader never stalls the data path.
//!
//! Each latency is recorded twice: into a fine log-linear histogram (quantiles for `ctl
//! stats`) and into fixed decimal buckets with a sum (`latency_buckets`, what `/metrics`
//! exposes as Prometheus histograms), so both always count the same requests.

use crate::latency_buckets::{BucketCounts, LatencyBuckets};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Sub-buckets per power of two: latencies are kept to within 1/4 (25 %) of their value.
const SUB_BITS: u32 = 2;
const SUBS: usize = 1 << SUB_BITS;
/// Covers 1 ns .. 2^40 ns (~18 min); anything longer lands in the last bucket.
const MAX_EXP: usize = 40;
const BUCKETS: usize = (MAX_EXP + 1) * SUBS;

/// A log-linear latency histogram (like HdrHistogram with two significant bits).
pub struct LatencyHistogram {
    buckets: [AtomicU64; BUCKETS],
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl LatencyHistogram {
    pub fn record(&self, latency: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.buckets[bucket_of(ns)].fetch_add(1, Ordering::Relaxed);
    }

    /// Number of recorded samples.
    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).sum()
    }

    /// The latency below which `q` (0.0..=1.0) of the samples fall, as the upper edge of
    /// its bucket; `None` without samples.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(Duration::from_nanos(bucket_upper(i)));
            }
        }
        Some(Duration::from_nanos(bucket_upper(BUCKETS - 1)))
    }
}

fn bucket_of(ns: u64) -> usize {
    if ns < SUBS as u64 {
        return ns as usize;
    }
    let exp = 63 - ns.leading_zeros() as usize; // >= SUB_BITS
    let sub = ((ns >> (exp - SUB_BITS as usize)) as usize) & (SUBS - 1);
    let idx = (exp - SUB_BITS as usize + 1) * SUBS + sub;
    idx.min(BUCKETS - 1)
}

/// The largest value that falls into bucket `i`.
fn bucket_upper(i: usize) -> u64 {
    if i < SUBS {
        return i as u64;
    }
    let exp = i / SUBS - 1 + SUB_BITS as usize;
    let sub = (i % SUBS) as u64;
    let step = 1u64 << (exp - SUB_BITS as usize);
    ((SUBS as u64 + sub) << (exp - SUB_BITS as usize)) + step - 1
}

/// Counters for one export or queue.
#[derive(Default)]
pub struct IoStats {
    reads: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
    write_bytes: AtomicU64,
    flushes: AtomicU64,
    discards: AtomicU64,
    /// Failed requests per [`IoKind`] (in its order).
    errors: [AtomicU64; IoKind::COUNT],
    in_flight: AtomicI64,
    read_latency: LatencyHistogram,
    write_latency: LatencyHistogram,
    /// Latency of successful requests per [`IoKind`] (`Other` is not timed).
    buckets: [LatencyBuckets; IoKind::COUNT - 1],
}

/// What kind of request a `Tracker` records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write,
    Flush,
    Discard,
    /// Anything else (GET_ID, WRITE_ZEROES is counted as a write): counted in flight and
    /// in errors only.
    Other,
}

impl IoKind {
    pub const COUNT: usize = 5;
    /// Every kind, in the order of the per-kind arrays of [`IoStatsSnapshot`].
    pub const ALL: [IoKind; IoKind::COUNT] = [
        IoKind::Read,
        IoKind::Write,
        IoKind::Flush,
        IoKind::Discard,
        IoKind::Other,
    ];

    /// Lower-case name, as metrics label it.
    pub fn name(self) -> &'static str {
        match self {
            IoKind::Read => "read",
            IoKind::Write => "write",
            IoKind::Flush => "flush",
            IoKind::Discard => "discard",
            IoKind::Other => "other",
        }
    }
}

/// A request in flight: created when it starts, `finish`ed when it completes. Dropping an
/// unfinished tracker counts the request as failed.
#[must_use = "finish the tracker when the request completes"]
pub struct Tracker<'a> {
    stats: &'a IoStats,
    kind: IoKind,
    bytes: u64,
    start: Instant,
    done: bool,
}

impl Tracker<'_> {
    pub fn finish(mut self, ok: bool) {
        self.done = true;
        self.stats.complete(self.kind, self.bytes, self.start, ok);
    }
}

impl Drop for Tracker<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.stats
                .complete(self.kind, self.bytes, self.start, false);
        }
    }
}

impl IoStats {
    /// Starts tracking a request of `bytes` payload bytes.
    pub fn start(&self, kind: IoKind, bytes: u64) -> Tracker<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Tracker {
            stats: self,
            kind,
            bytes,
            start: Instant::now(),
            done: false,
        }
    }

    /// Records a request whose start was taken earlier (when the tracker cannot borrow the
    /// stats across threads): call `begin` at submission and `complete` at completion.
    pub fn begin(&self) -> Instant {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Instant::now()
    }

    pub fn complete(&self, kind: IoKind, bytes: u64, start: Instant, ok: bool) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        if !ok {
            self.errors[kind as usize].fetch_add(1, Ordering::Relaxed);
            return;
        }
        let latency = start.elapsed();
        if let Some(buckets) = self.buckets.get(kind as usize) {
            buckets.record(latency);
        }
        match kind {
            IoKind::Read => {
                self.reads.fetch_add(1, Ordering::Relaxed);
                self.read_bytes.fetch_add(bytes, Ordering::Relaxed);
                self.read_latency.record(latency);
            }
            IoKind::Write => {
                self.writes.fetch_add(1, Ordering::Relaxed);
                self.write_bytes.fetch_add(bytes, Ordering::Relaxed);
                self.write_latency.record(latency);
            }
            IoKind::Flush => {
                self.flushes.fetch_add(1, Ordering::Relaxed);
            }
            IoKind::Discard => {
                self.discards.fetch_add(1, Ordering::Relaxed);
            }
            IoKind::Other => {}
        }
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed).max(0) as u64
    }

    pub fn snapshot(&self) -> IoStatsSnapshot {
        let us = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e6);
        IoStatsSnapshot {
            reads: self.reads.load(Ordering::Relaxed),
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            write_bytes: self.write_bytes.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
            discards: self.discards.load(Ordering::Relaxed),
            errors: self.errors.iter().map(|e| e.load(Ordering::Relaxed)).sum(),
            errors_by_kind: std::array::from_fn(|i| self.errors[i].load(Ordering::Relaxed)),
            in_flight: self.in_flight(),
            read_p50_us: us(self.read_latency.quantile(0.5)),
            read_p99_us: us(self.read_latency.quantile(0.99)),
            write_p50_us: us(self.write_latency.quantile(0.5)),
            write_p99_us: us(self.write_latency.quantile(0.99)),
            latency: std::array::from_fn(|i| self.buckets[i].snapshot()),
        }
    }
}

/// A point-in-time copy of `IoStats`; latencies in microseconds (`None` without samples).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IoStatsSnapshot {
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
    pub discards: u64,
    /// Failed requests of every kind.
    pub errors: u64,
    /// Failed requests per [`IoKind`], in the order of [`IoKind::ALL`].
    pub errors_by_kind: [u64; IoKind::COUNT],
    pub in_flight: u64,
    pub read_p50_us: Option<f64>,
    pub read_p99_us: Option<f64>,
    pub write_p50_us: Option<f64>,
    pub write_p99_us: Option<f64>,
    /// Latency buckets of successful reads, writes, flushes and discards (the first four of
    /// [`IoKind::ALL`]).
    pub latency: [BucketCounts; IoKind::COUNT - 1],
}

impl IoStatsSnapshot {
    /// Sums counters of several queues; latency quantiles cannot be summed and are taken
    /// from the worst queue (an upper bound).
    pub fn merge(&mut self, other: &IoStatsSnapshot) {
        self.reads += other.reads;
        self.read_bytes += other.read_bytes;
        self.writes += other.writes;
        self.write_bytes += other.write_bytes;
        self.flushes += other.flushes;
        self.discards += other.discards;
        self.errors += other.errors;
        for (a, b) in self.errors_by_kind.iter_mut().zip(other.errors_by_kind) {
            *a += b;
        }
        for (a, b) in self.latency.iter_mut().zip(&other.latency) {
            a.merge(b);
        }
        self.in_flight += other.in_flight;
        let max = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.read_p50_us = max(self.read_p50_us, other.read_p50_us);
        self.read_p99_us = max(self.read_p99_us, other.read_p99_us);
        self.write_p50_us = max(self.write_p50_us, other.write_p50_us);
        self.write_p99_us = max(self.write_p99_us, other.write_p99_us);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_cover_their_values() {
        let mut last = 0;
        for ns in (0..100_000u64).chain([1 << 20, 123_456_789, 1 << 30, 1 << 39]) {
            let b = bucket_of(ns);
            assert!(b >= last, "bucket order at {ns}");
            last = b;
            assert!(bucket_upper(b) >= ns, "{ns} above its bucket's upper edge");
            // Two significant bits: the upper edge is within 25 % (plus rounding) of the value.
            assert!(
                bucket_upper(b) as f64 <= ns as f64 * 1.25 + 1.0,
                "bucket of {ns} too coarse"
            );
        }
    }

    #[test]
    fn quantiles_of_a_known_distribution() {
        let h = LatencyHistogram::default();
        assert_eq!(h.quantile(0.5), None);
        for _ in 0..98 {
            h.record(Duration::from_micros(10));
        }
        h.record(Duration::from_millis(5));
        h.record(Duration::from_millis(5));
        let p50 = h.quantile(0.5).unwrap();
        assert!(p50 >= Duration::from_micros(10) && p50 <= Duration::from_micros(13));
        let p99 = h.quantile(0.99).unwrap();
        assert!(p99 >= Duration::from_millis(5) && p99 <= Duration::from_micros(6300));
        assert_eq!(h.count(), 100);
    }

    #[test]
    fn counters_and_in_flight() {
        let s = IoStats::default();
        let t = s.start(IoKind::Read, 4096);
        assert_eq!(s.in_flight(), 1);
        t.finish(true);
        let w = s.start(IoKind::Write, 512);
        drop(w); // unfinished: an error
        let snap = s.snapshot();
        assert_eq!((snap.reads, snap.read_bytes, snap.writes), (1, 4096, 0));
        assert_eq!((snap.errors, snap.in_flight), (1, 0));
        assert!(snap.read_p50_us.is_some() && snap.write_p50_us.is_none());
        assert_eq!(snap.errors_by_kind, [0, 1, 0, 0, 0]);
        // The buckets count exactly the successful requests the counters count.
        assert_eq!(snap.latency[IoKind::Read as usize].count(), 1);
        assert_eq!(snap.latency[IoKind::Write as usize].count(), 0);
        let f = s.start(IoKind::Flush, 0);
        f.finish(true);
        let snap = s.snapshot();
        assert_eq!(
            (snap.flushes, snap.latency[IoKind::Flush as usize].count()),
            (1, 1)
        );
    }
}
