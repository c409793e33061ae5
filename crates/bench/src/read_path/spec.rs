//! A workload of `read-path --workloads`: `rw:bs:depth`, checked where it is given.
use crate::config::{Rw, Workload};

/// One workload of `--workloads`: `rw:bs:depth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    pub rw: Rw,
    pub bs: u64,
    pub depth: u32,
}

/// vu_bench's split ring takes three descriptors per request: 1024 entries hold 341.
const MAX_DEPTH: u32 = 1024 / 3;

impl Spec {
    pub fn parse(s: &str) -> Result<Spec, String> {
        let bad = |why: &str| {
            format!("workload '{s}': {why} (expected rw:bs:depth, e.g. randread:4096:128)")
        };
        let parts: Vec<&str> = s.trim().split(':').collect();
        let [rw, bs, depth] = parts[..] else {
            return Err(bad("three fields separated by ':'"));
        };
        let rw = match rw {
            "read" => Rw::Read,
            "randread" => Rw::Randread,
            "write" => Rw::Write,
            "randwrite" => Rw::Randwrite,
            _ => return Err(bad("rw is read, randread, write or randwrite")),
        };
        let bs: u64 = bs
            .parse()
            .ok()
            .filter(|b| *b > 0 && b % 4096 == 0)
            .ok_or_else(|| bad("bs is a positive multiple of 4096 bytes"))?;
        let depth: u32 = depth
            .parse()
            .ok()
            .filter(|d| (1..=MAX_DEPTH).contains(d))
            .ok_or_else(|| bad(&format!("depth is 1..={MAX_DEPTH}")))?;
        Ok(Spec { rw, bs, depth })
    }

    /// The name its records carry: the spec itself, with the queue count when above one.
    pub fn name(&self, queues: u32) -> String {
        let base = format!("{}:{}:{}", self.rw.name(), self.bs, self.depth);
        if queues == 1 {
            base
        } else {
            format!("{base}:q{queues}")
        }
    }

    pub(super) fn workload(&self, queues: u32) -> Workload {
        Workload {
            rw: self.rw,
            bs: self.bs,
            depth: self.depth,
            queues,
        }
    }

    pub(super) fn reads(&self) -> bool {
        matches!(self.rw, Rw::Read | Rw::Randread)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_specs_parse_and_bad_ones_say_what_is_wrong() {
        assert_eq!(
            Spec::parse("randread:4096:128").unwrap(),
            Spec {
                rw: Rw::Randread,
                bs: 4096,
                depth: 128
            }
        );
        assert_eq!(
            Spec::parse("write:65536:16").unwrap().name(1),
            "write:65536:16"
        );
        assert_eq!(
            Spec::parse("read:65536:4").unwrap().name(2),
            "read:65536:4:q2"
        );
        for (bad, why) in [
            ("randread:4096", "three fields"),
            ("randrw:4096:32", "rw is read"),
            ("read:1000:4", "multiple of 4096"),
            ("read:4k:4", "multiple of 4096"),
            ("read:4096:0", "depth is 1..=341"),
            ("read:4096:342", "depth is 1..=341"),
        ] {
            let err = Spec::parse(bad).unwrap_err();
            assert!(err.contains(why) && err.contains(bad), "{bad}: {err}");
        }
    }
}
