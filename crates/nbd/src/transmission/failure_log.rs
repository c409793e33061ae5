//! Logging failed requests without flooding the log: a client that keeps sending requests to a
//! disk that refuses them (one handed over to a migration destination, a stalled cluster)
//! would otherwise write one line per request, thousands a second.

use std::fmt::Display;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// At most one line per `INTERVAL` per connection; the failures in between are counted and the
/// count is given with the next line.
const INTERVAL: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub(crate) struct FailureLog {
    started: Instant,
    /// Milliseconds since `started` before which nothing more is logged.
    quiet_until_ms: AtomicU64,
    unlogged: AtomicU64,
}

impl FailureLog {
    pub(crate) fn new() -> FailureLog {
        FailureLog {
            started: Instant::now(),
            quiet_until_ms: AtomicU64::new(0),
            unlogged: AtomicU64::new(0),
        }
    }

    /// Logs `error` unless a failure was logged less than `INTERVAL` ago; then only counts it.
    /// Returns whether it was logged.
    pub(crate) fn report(&self, export: &str, error: &dyn Display) -> bool {
        let now = self.started.elapsed().as_millis() as u64;
        let quiet_until = self.quiet_until_ms.load(Ordering::Relaxed);
        let ours = now >= quiet_until
            && self
                .quiet_until_ms
                .compare_exchange(
                    quiet_until,
                    now + INTERVAL.as_millis() as u64,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok();
        if !ours {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        match self.unlogged.swap(0, Ordering::Relaxed) {
            0 => tracing::warn!(export, "request failed: {error}"),
            n => tracing::warn!(
                export,
                "request failed: {error} (and {n} more since the last such line)"
            ),
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_failures_is_one_line_and_a_count() {
        let log = FailureLog::new();
        assert!(log.report("e", &"first"));
        let logged = (0..1000).filter(|_| log.report("e", &"again")).count();
        assert_eq!(
            logged, 0,
            "a burst right after a logged failure is only counted"
        );
        assert_eq!(log.unlogged.load(Ordering::Relaxed), 1000);
        std::thread::sleep(INTERVAL + Duration::from_millis(20));
        assert!(log.report("e", &"later"));
        assert_eq!(
            log.unlogged.load(Ordering::Relaxed),
            0,
            "the count went out with it"
        );
    }
}
