//! A fixed-size latency histogram (about 6 % resolution at any magnitude), so that recording
//! millions of on-demand requests costs no memory growth.

use std::time::Duration;

const SUB_BITS: u32 = 4;
const SUB: u64 = 1 << SUB_BITS;
const BUCKETS: usize = (SUB + (64 - SUB_BITS as u64) * SUB) as usize;

#[derive(Clone)]
pub struct LatencyHistogram {
    counts: Box<[u64; BUCKETS]>,
    total: u64,
    sum_us: u128,
    max_us: u64,
}

impl std::fmt::Debug for LatencyHistogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencyHistogram")
            .field("count", &self.total)
            .field("summary", &self.summary())
            .finish()
    }
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            counts: Box::new([0; BUCKETS]),
            total: 0,
            sum_us: 0,
            max_us: 0,
        }
    }
}

/// What a status report shows of a histogram, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatencySummary {
    pub count: u64,
    pub avg_us: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

fn bucket_of(us: u64) -> usize {
    if us < SUB {
        return us as usize;
    }
    let exp = 63 - us.leading_zeros(); // >= SUB_BITS
    let shift = exp - SUB_BITS;
    let sub = (us >> shift) & (SUB - 1);
    (SUB + u64::from(shift) * SUB + sub) as usize
}

/// The largest value that falls in bucket `i`.
fn bucket_high(i: usize) -> u64 {
    let i = i as u64;
    if i < SUB {
        return i;
    }
    let shift = (i - SUB) / SUB;
    let sub = (i - SUB) % SUB;
    let low = (SUB + sub) << shift;
    low + ((1u64 << shift) - 1)
}

impl LatencyHistogram {
    pub fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.counts[bucket_of(us)] += 1;
        self.total += 1;
        self.sum_us += u128::from(us);
        self.max_us = self.max_us.max(us);
    }

    /// The value at quantile `q` (0..=1), rounded up to its bucket's upper edge.
    pub fn quantile_us(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return bucket_high(i).min(self.max_us);
            }
        }
        self.max_us
    }

    pub fn summary(&self) -> LatencySummary {
        LatencySummary {
            count: self.total,
            avg_us: if self.total == 0 {
                0.0
            } else {
                self.sum_us as f64 / self.total as f64
            },
            p50_us: self.quantile_us(0.50),
            p99_us: self.quantile_us(0.99),
            max_us: self.max_us,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_in_order() {
        let mut last = 0;
        for us in [
            0u64,
            1,
            15,
            16,
            17,
            31,
            32,
            100,
            1000,
            12345,
            1 << 40,
            u64::MAX,
        ] {
            let b = bucket_of(us);
            assert!(b < BUCKETS);
            assert!(b >= last);
            last = b;
            assert!(
                bucket_high(b) >= us,
                "{us} above its bucket's top {}",
                bucket_high(b)
            );
        }
    }

    #[test]
    fn quantiles_are_within_resolution() {
        let mut h = LatencyHistogram::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let s = h.summary();
        assert_eq!(s.count, 1000);
        assert!((s.avg_us - 500.5).abs() < 1e-9);
        assert!((500..=500 * 107 / 100).contains(&s.p50_us), "{s:?}");
        assert!((990..=1000).contains(&s.p99_us), "{s:?}");
        assert_eq!(s.max_us, 1000);
    }
}
