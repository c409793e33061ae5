//! The daemon's memory budget: what every queue of every disk (vhost-user virtqueues, NBD
//! connections) may make the daemon hold in request data at once, all together
//! (`cryptblk_block::MemoryBudget`), and how much of it the buffer cache keeps while idle.
//!
//! Set by `serve --memory-budget SIZE` or a `--config` file's `memory-budget`; by default a
//! sixteenth of the memory the daemon may use (the machine's RAM, or its cgroup's
//! `memory.max` when lower), at least `MIN_BUDGET` and at most `MAX_DEFAULT_BUDGET`.

use cryptblk_block::{buffers, MemoryBudget};
use std::path::Path;

/// The smallest budget accepted: room for the largest NBD request (a 32 MiB WRITE) with its
/// encrypted copy.
pub const MIN_BUDGET: u64 = 64 << 20;
/// The default budget is at most this.
pub const MAX_DEFAULT_BUDGET: u64 = 1 << 30;
/// The default budget is this fraction of the memory available.
pub const DEFAULT_FRACTION: u64 = 16;
/// What the buffer cache keeps of the budget while idle: an eighth, within these bounds.
const KEEP_MIN: u64 = 4 << 20;
const KEEP_MAX: u64 = buffers::DEFAULT_KEEP;

/// The budget in effect and where it came from, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    pub bytes: u64,
    /// "--memory-budget", or how the default was derived.
    pub source: String,
}

/// The budget from the command line or config file, else the default for this machine.
pub fn budget(configured: Option<u64>) -> Result<Budget, String> {
    match configured {
        Some(bytes) if bytes < MIN_BUDGET => Err(format!(
            "memory budget {} MiB: at least {} MiB (the largest NBD request and its encrypted \
             copy must fit)",
            bytes >> 20,
            MIN_BUDGET >> 20
        )),
        Some(bytes) => Ok(Budget {
            bytes,
            source: "configured".into(),
        }),
        None => {
            let (available, what) = available_memory();
            Ok(Budget {
                bytes: default_budget(available),
                source: format!(
                    "default: 1/{DEFAULT_FRACTION} of {what} ({} MiB), within {} MiB..{} MiB",
                    available >> 20,
                    MIN_BUDGET >> 20,
                    MAX_DEFAULT_BUDGET >> 20
                ),
            })
        }
    }
}

/// The default budget for `available` bytes of memory.
pub fn default_budget(available: u64) -> u64 {
    (available / DEFAULT_FRACTION).clamp(MIN_BUDGET, MAX_DEFAULT_BUDGET)
}

/// What the buffer cache keeps at most under a budget of `bytes`.
pub fn cache_keep(bytes: u64) -> u64 {
    (bytes / 8).clamp(KEEP_MIN, KEEP_MAX)
}

/// Makes `budget` the process's: every queue opened from now on reserves from it.
pub fn apply(budget: &Budget) {
    MemoryBudget::process().set_limit(budget.bytes);
    buffers::set_keep_limit(cache_keep(budget.bytes));
}

/// The memory the daemon may use: the machine's RAM, or its cgroup's limit when lower, and
/// which it was.
fn available_memory() -> (u64, &'static str) {
    let ram = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_total(&text))
        // Without /proc the default is the floor.
        .unwrap_or(0);
    match cgroup_limit() {
        Some(limit) if limit < ram => (limit, "the cgroup's memory.max"),
        _ => (ram, "RAM"),
    }
}

/// `MemTotal` of /proc/meminfo, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// The lowest `memory.max` of this process's cgroup (v2) and its ancestors.
fn cgroup_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mut dir = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let mut lowest: Option<u64> = None;
    loop {
        if let Ok(value) = std::fs::read_to_string(dir.join("memory.max")) {
            if let Ok(limit) = value.trim().parse::<u64>() {
                lowest = Some(lowest.map_or(limit, |l| l.min(limit)));
            }
        }
        if dir == Path::new("/sys/fs/cgroup") || !dir.pop() {
            return lowest;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_a_sixteenth_of_memory_within_bounds() {
        assert_eq!(default_budget(0), MIN_BUDGET);
        assert_eq!(default_budget(512 << 20), MIN_BUDGET);
        assert_eq!(default_budget(4 << 30), 256 << 20);
        assert_eq!(default_budget(256 << 30), MAX_DEFAULT_BUDGET);
        assert_eq!(cache_keep(MIN_BUDGET), 8 << 20);
        assert_eq!(cache_keep(MAX_DEFAULT_BUDGET), 32 << 20);
    }

    #[test]
    fn a_budget_too_small_is_refused_with_the_least() {
        let e = budget(Some(1 << 20)).unwrap_err();
        assert!(e.contains("at least 64 MiB"), "{e}");
        assert_eq!(budget(Some(MIN_BUDGET)).unwrap().bytes, MIN_BUDGET);
        let default = budget(None).unwrap();
        assert!(default.bytes >= MIN_BUDGET && default.bytes <= MAX_DEFAULT_BUDGET);
        assert!(
            default.source.starts_with("default: 1/16 of"),
            "{default:?}"
        );
    }

    #[test]
    fn mem_total_is_read_in_bytes() {
        let text = "MemTotal:       24684092 kB\nMemFree:         6000000 kB\n";
        assert_eq!(mem_total(text), Some(24684092 * 1024));
        assert_eq!(mem_total("nothing"), None);
    }
}
