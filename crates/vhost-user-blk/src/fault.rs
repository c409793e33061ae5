//! Crash points for the restart tests: the places in a request's life where a daemon killed
//! at the wrong moment could lose or repeat a request (`tests/restart.rs` aborts the daemon at
//! each of them and checks its successor completes every request exactly once).
//!
//! Only compiled in with the `fault-injection` feature, which nothing but this crate's own
//! tests enables (its dev-dependency on itself); a normal build gets an empty inline `hit`.
//! With the feature, `CRYPTBLK_FAULT_ABORT=<point>:<n>` (a `Point::name` and a count from 1)
//! makes the process abort, as `kill -9` would stop it, the n-th time that point is reached.

/// Where a request can be cut off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    /// Taken from the available ring, not yet marked in flight.
    Popped,
    /// Marked in flight, not yet executed.
    Marked,
    /// Executed; its head recorded as the completion under way, the used ring not updated.
    Completing,
    /// On the used ring (used->idx advanced), not yet cleared from the inflight region.
    Used,
    /// Completions recorded; the guest not yet signalled.
    BeforeSignal,
}

impl Point {
    pub const ALL: [Point; 5] = [
        Point::Popped,
        Point::Marked,
        Point::Completing,
        Point::Used,
        Point::BeforeSignal,
    ];

    /// The point's name in `CRYPTBLK_FAULT_ABORT`.
    pub const fn name(self) -> &'static str {
        match self {
            Point::Popped => "popped",
            Point::Marked => "marked",
            Point::Completing => "completing",
            Point::Used => "used",
            Point::BeforeSignal => "before-signal",
        }
    }
}

/// The environment variable naming the crash point.
pub const ENV: &str = "CRYPTBLK_FAULT_ABORT";

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn hit(_point: Point) {}

#[cfg(feature = "fault-injection")]
pub(crate) fn hit(point: Point) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    static TARGET: OnceLock<Option<(Point, u64)>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);
    let target = TARGET.get_or_init(|| {
        let spec = std::env::var(ENV).ok()?;
        let (name, nth) = spec.split_once(':')?;
        let point = Point::ALL.into_iter().find(|p| p.name() == name)?;
        Some((point, nth.parse().ok()?))
    });
    if let Some((target, nth)) = *target {
        if target == point && HITS.fetch_add(1, Ordering::SeqCst) + 1 == nth {
            eprintln!("{ENV}: aborting at {} #{nth}", point.name());
            std::process::abort();
        }
    }
}
