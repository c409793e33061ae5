//! vu_bench's latency histogram: percentiles without keeping every sample.

/// Latencies in nanoseconds, counted in buckets: exact below 64 ns, then 64 buckets per power
/// of two (each bucket's width is at most 1/64 of its lower bound).
pub struct Histogram {
    counts: Vec<u64>,
}

const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;

impl Histogram {
    pub fn new() -> Histogram {
        Histogram {
            counts: vec![0; ((64 - SUB_BITS as usize) + 1) * SUB as usize],
        }
    }

    fn index(ns: u64) -> usize {
        if ns < SUB {
            return ns as usize;
        }
        let exp = 63 - ns.leading_zeros(); // >= SUB_BITS
        let sub = (ns >> (exp - SUB_BITS)) & (SUB - 1);
        ((exp - SUB_BITS + 1) as u64 * SUB + sub) as usize
    }

    /// The middle of bucket `i`, in nanoseconds.
    fn value(i: usize) -> f64 {
        let i = i as u64;
        if i < SUB {
            return i as f64;
        }
        let exp = (i / SUB) as u32 + SUB_BITS - 1;
        let width = 1u64 << (exp - SUB_BITS);
        ((SUB + i % SUB) << (exp - SUB_BITS)) as f64 + width as f64 / 2.0
    }

    pub fn add(&mut self, ns: u64) {
        self.counts[Self::index(ns)] += 1;
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
    }

    /// The latency at or under which `p` (0..1) of the requests completed, in µs.
    pub fn percentile_us(&self, p: f64) -> f64 {
        let total: u64 = self.counts.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let rank = ((p * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::value(i) / 1000.0;
            }
        }
        unreachable!("rank <= total")
    }
}

#[cfg(test)]
mod tests {
    use super::Histogram;

    #[test]
    fn percentiles_are_within_a_bucket_of_the_exact_value() {
        let mut h = Histogram::new();
        // 1..=1000 µs, one request each.
        for us in 1..=1000u64 {
            h.add(us * 1000);
        }
        for (p, exact) in [(0.5, 500.0), (0.99, 990.0), (0.999, 999.0)] {
            let got = h.percentile_us(p);
            assert!(
                (got - exact).abs() / exact < 1.0 / 64.0,
                "p{p}: {got} vs {exact}"
            );
        }
        let mut tiny = Histogram::new();
        tiny.add(7);
        assert_eq!(tiny.percentile_us(0.5), 0.007);
        assert_eq!(Histogram::new().percentile_us(0.99), 0.0);
        // The largest latency has a bucket.
        tiny.add(u64::MAX);
    }
}
