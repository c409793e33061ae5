//! A backup that yields to the VM: while the disk's own users are doing I/O, the backup's
//! reads take at most a share of the time, one at a time, each followed by a rest in
//! proportion to how long it took; while they are idle, the backup reads at full speed.
//!
//! The kernel's I/O priorities would be the natural tool, but the multi-queue schedulers most
//! virtual and NVMe disks use (`none`, `mq-deadline`) ignore the idle class, and a backup at
//! the device's full speed left a VM's 4 KiB writes at a fiftieth of their rate here. A
//! fixed `max-bandwidth` is the operator's guess of the disk's speed; a share follows the
//! disk as it is (its reads take longer when the disk is busier), as ZFS's scrub delay and
//! Ceph's background recovery classes do.
//!
//! "Busy" is "a request entered the disk in the last [`IDLE_AFTER`]": the tracker counts every
//! request it admits, one relaxed add beside the counts it keeps anyway.

use super::TrackState;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the disk's users must have been quiet for a backup to read at full speed again.
pub const IDLE_AFTER: Duration = Duration::from_millis(50);

/// The longest rest after one read (a read that took seconds on a stalled disk does not
/// stop the backup for minutes).
const MAX_REST: Duration = Duration::from_secs(1);

/// The requests a tracked disk's users made, as a count that only grows.
#[derive(Clone)]
pub struct GuestActivity(Arc<TrackState>);

impl GuestActivity {
    pub(super) fn of(state: Arc<TrackState>) -> Self {
        GuestActivity(state)
    }

    /// Requests entered so far.
    pub fn requests(&self) -> u64 {
        self.0.entered.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for GuestActivity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("GuestActivity")
            .field(&self.requests())
            .finish()
    }
}

/// When a backup's next read may start: the pure schedule, given the clock and the activity
/// count, so it can be checked without waiting.
#[derive(Debug)]
pub struct ShareSchedule {
    /// Rest per unit of read time: `(1 - share) / share`.
    rest_per_read: f64,
    last_requests: u64,
    last_change: Option<Instant>,
    rest_until: Option<Instant>,
}

impl ShareSchedule {
    /// A schedule giving the backup `percent` (1 to 100) of the time while the disk is busy.
    pub fn new(percent: u8) -> Self {
        let share = f64::from(percent.clamp(1, 100)) / 100.0;
        ShareSchedule {
            rest_per_read: (1.0 - share) / share,
            last_requests: 0,
            last_change: None,
            rest_until: None,
        }
    }

    /// Whether the disk's users were busy lately, given their request count now.
    pub fn busy(&mut self, requests: u64, now: Instant) -> bool {
        if requests != self.last_requests {
            self.last_requests = requests;
            self.last_change = Some(now);
        }
        self.last_change
            .is_some_and(|changed| now.saturating_duration_since(changed) < IDLE_AFTER)
    }

    /// How long a read that would start at `now` must wait (zero: it may start).
    pub fn wait(&self, now: Instant) -> Duration {
        self.rest_until
            .map_or(Duration::ZERO, |until| until.saturating_duration_since(now))
    }

    /// A read that took `took` ended at `now`: the next one rests in proportion.
    pub fn read_took(&mut self, took: Duration, now: Instant) {
        let rest = took.mul_f64(self.rest_per_read).min(MAX_REST);
        self.rest_until = Some(now + rest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_disk_gives_the_backup_its_share_of_the_time() {
        let mut schedule = ShareSchedule::new(20);
        let start = Instant::now();
        assert!(schedule.busy(5, start), "a count that moved is busy");
        assert_eq!(
            schedule.wait(start),
            Duration::ZERO,
            "the first read starts at once"
        );
        // A read of 4 ms at a share of 20 % rests 16 ms.
        schedule.read_took(Duration::from_millis(4), start + Duration::from_millis(4));
        assert_eq!(
            schedule.wait(start + Duration::from_millis(4)),
            Duration::from_millis(16)
        );
        assert_eq!(
            schedule.wait(start + Duration::from_millis(20)),
            Duration::ZERO
        );
    }

    #[test]
    fn a_quiet_disk_is_idle_after_the_quiet_time() {
        let mut schedule = ShareSchedule::new(20);
        let start = Instant::now();
        assert!(schedule.busy(7, start));
        assert!(
            schedule.busy(7, start + IDLE_AFTER / 2),
            "quiet, but not for long"
        );
        assert!(
            !schedule.busy(7, start + IDLE_AFTER),
            "quiet for the whole time"
        );
        assert!(
            schedule.busy(8, start + IDLE_AFTER * 3),
            "one request makes it busy again"
        );
    }

    #[test]
    fn a_disk_never_used_is_idle_and_rests_are_bounded() {
        let mut schedule = ShareSchedule::new(1);
        let start = Instant::now();
        assert!(!schedule.busy(0, start));
        schedule.read_took(Duration::from_secs(30), start);
        assert_eq!(schedule.wait(start), MAX_REST);
        let mut whole = ShareSchedule::new(100);
        whole.read_took(Duration::from_secs(1), start);
        assert_eq!(
            whole.wait(start),
            Duration::ZERO,
            "a share of 100 % never rests"
        );
    }
}
