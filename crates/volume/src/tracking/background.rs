//! A backup that yields to the VM: while the disk's own users are doing I/O, the backup's
//! reads take at most a share of the time: one at a time, each followed by a pause in
//! proportion to how long it took; while the users are idle, the backup reads at full speed.
//! The pause is kept by the export's connections (an NBD read gate), not by the read itself:
//! a read never sleeps on the I/O threads every disk shares.
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
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long the disk's users must have been quiet for a backup to read at full speed again.
pub(crate) const IDLE_AFTER: Duration = Duration::from_millis(50);

/// The longest pause after one read (a read that took seconds on a stalled disk does not
/// stop the backup for minutes).
const MAX_REST: Duration = Duration::from_secs(1);

/// How much of the read-time estimate the latest read replaces: the estimate follows a busier
/// disk within a few reads.
const LATEST_WEIGHT: f64 = 0.25;

/// How often, at least, a read waiting for the one under way asks again.
const WHILE_ONE_READS: Duration = Duration::from_millis(1);

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

/// When a backup's next read may start: the pure schedule, given the clock, the activity
/// count and the reads' measured times, so it can be checked without waiting.
#[derive(Debug)]
pub(crate) struct ShareSchedule {
    /// Time per read time: `1 / share`.
    spacing: f64,
    last_requests: u64,
    last_change: Option<Instant>,
    /// Seconds a byte takes to read now (0 before the first measurement).
    seconds_per_byte: f64,
    next_start: Option<Instant>,
    /// Reads under way, and when the last one started.
    reading: u32,
    started: Option<Instant>,
}

impl ShareSchedule {
    /// A schedule giving the backup `percent` (1 to 100) of the time while the disk is busy.
    pub fn new(percent: u8) -> Self {
        ShareSchedule {
            spacing: 100.0 / f64::from(percent.clamp(1, 100)),
            last_requests: 0,
            last_change: None,
            seconds_per_byte: 0.0,
            next_start: None,
            reading: 0,
            started: None,
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

    /// Admits a read of `len` bytes at `now` while the disk is busy, or says how long until
    /// it may: not while another reads, nor before the pause after the last one is over
    /// (and, between its admission and its start, not before its expected share is).
    pub fn admit_busy(&mut self, len: u64, now: Instant) -> Result<(), Duration> {
        if self.reading > 0 {
            // The earliest the next may start, were this one to take the time expected: one
            // question per read rather than one per millisecond.
            let expected = Duration::from_secs_f64(len as f64 * self.seconds_per_byte)
                .mul_f64(self.spacing)
                .min(MAX_REST);
            let left = self.started.map_or(Duration::ZERO, |at| {
                (at + expected).saturating_duration_since(now)
            });
            return Err(left.max(WHILE_ONE_READS));
        }
        if let Some(wait) = self
            .next_start
            .and_then(|at| at.checked_duration_since(now))
            .filter(|wait| !wait.is_zero())
        {
            return Err(wait);
        }
        let read = len as f64 * self.seconds_per_byte;
        let turn = Duration::from_secs_f64(read * self.spacing).min(MAX_REST);
        self.next_start = Some(now + turn);
        Ok(())
    }

    /// A read starts.
    pub fn read_started(&mut self, now: Instant) {
        self.reading += 1;
        self.started = Some(now);
    }

    /// A read of `len` bytes that started took `took`, ending at `now`: the next one pauses
    /// in proportion, and the estimate of what reads take follows it.
    pub fn read_took(&mut self, len: u64, took: Duration, now: Instant) {
        self.reading = self.reading.saturating_sub(1);
        let pause = took.mul_f64(self.spacing - 1.0).min(MAX_REST);
        self.next_start = self.next_start.max(Some(now + pause));
        if len == 0 {
            return;
        }
        let latest = took.as_secs_f64() / len as f64;
        self.seconds_per_byte = if self.seconds_per_byte == 0.0 {
            latest
        } else {
            self.seconds_per_byte * (1.0 - LATEST_WEIGHT) + latest * LATEST_WEIGHT
        };
    }
}

/// A backup export's reads yielding to the disk's users: the export's read gate asks
/// [`admit`](Self::admit), the backup's view reports each read's time
/// ([`read_took`](Self::read_took)).
pub struct BackgroundReads {
    activity: GuestActivity,
    schedule: Mutex<ShareSchedule>,
}

impl BackgroundReads {
    /// Reads that take `percent` of the time while `activity` says the disk is busy.
    pub fn new(activity: GuestActivity, percent: u8) -> Self {
        BackgroundReads {
            activity,
            schedule: Mutex::new(ShareSchedule::new(percent)),
        }
    }

    fn schedule(&self) -> std::sync::MutexGuard<'_, ShareSchedule> {
        self.schedule.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a read of `len` bytes may start at `now`, or how long until it may.
    pub fn admit(&self, len: u64, now: Instant) -> Result<(), Duration> {
        let mut schedule = self.schedule();
        if !schedule.busy(self.activity.requests(), now) {
            return Ok(());
        }
        schedule.admit_busy(len, now)
    }

    /// A read of the backup's view starts; it ends with [`read_took`](Self::read_took).
    pub fn read_started(&self) {
        self.schedule().read_started(Instant::now());
    }

    /// A read of `len` bytes took `took`.
    pub fn read_took(&self, len: u64, took: Duration) {
        self.schedule().read_took(len, took, Instant::now());
    }

    /// The share of a busy disk's time, in percent.
    pub fn percent(&self) -> u8 {
        (100.0 / self.schedule().spacing).round() as u8
    }
}

impl std::fmt::Debug for BackgroundReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackgroundReads")
            .field("percent", &self.percent())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_busy_disk_gives_the_backup_its_share_of_the_time() {
        let mut schedule = ShareSchedule::new(20);
        let start = Instant::now();
        assert!(schedule.busy(5, start), "a count that moved is busy");
        assert!(
            schedule.admit_busy(MIB, start).is_ok(),
            "before any measurement a read starts at once"
        );
        // Reads of 1 MiB take 4 ms: at a share of 20 %, one may start every 20 ms.
        schedule.read_took(
            MIB,
            Duration::from_millis(4),
            start - Duration::from_secs(1),
        );
        assert!(schedule.admit_busy(MIB, start).is_ok());
        let t = start + Duration::from_millis(1);
        assert_eq!(schedule.admit_busy(MIB, t), Err(Duration::from_millis(19)));
        let t = start + Duration::from_millis(20);
        assert!(schedule.admit_busy(MIB, t).is_ok());
        // Half the size, half the turn.
        assert!(schedule
            .admit_busy(MIB / 2, t + Duration::from_millis(20))
            .is_ok());
        assert_eq!(
            schedule.admit_busy(MIB, t + Duration::from_millis(21)),
            Err(Duration::from_millis(9))
        );
    }

    #[test]
    fn one_read_at_a_time_then_a_pause_in_proportion_to_it() {
        let mut schedule = ShareSchedule::new(25);
        let start = Instant::now();
        assert!(schedule.admit_busy(MIB, start).is_ok());
        schedule.read_started(start);
        let later = start + Duration::from_secs(5);
        assert_eq!(
            schedule.admit_busy(MIB, later),
            Err(WHILE_ONE_READS),
            "not while one reads, however long"
        );
        // It took 10 ms, longer than expected: three times that of pause at 25 %.
        let end = start + Duration::from_millis(10);
        schedule.read_took(MIB, Duration::from_millis(10), end);
        assert_eq!(
            schedule.admit_busy(MIB, end),
            Err(Duration::from_millis(30))
        );
        assert!(schedule
            .admit_busy(MIB, end + Duration::from_millis(30))
            .is_ok());
    }

    #[test]
    fn the_estimate_follows_a_busier_disk() {
        let mut schedule = ShareSchedule::new(50);
        let start = Instant::now();
        let before = start - Duration::from_secs(1);
        schedule.read_took(MIB, Duration::from_millis(2), before);
        for _ in 0..20 {
            schedule.read_took(MIB, Duration::from_millis(10), before);
        }
        assert!(schedule.admit_busy(MIB, start).is_ok());
        let wait = schedule.admit_busy(MIB, start).unwrap_err();
        assert!(
            wait > Duration::from_millis(19) && wait <= Duration::from_millis(20),
            "{wait:?}"
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
    fn a_disk_never_used_is_idle_and_turns_are_bounded() {
        let mut schedule = ShareSchedule::new(1);
        let start = Instant::now();
        assert!(!schedule.busy(0, start));
        schedule.read_took(
            MIB,
            Duration::from_secs(30),
            start - Duration::from_secs(60),
        );
        assert!(schedule.admit_busy(MIB, start).is_ok());
        assert_eq!(schedule.admit_busy(MIB, start), Err(MAX_REST));
        let mut whole = ShareSchedule::new(100);
        whole.read_took(
            MIB,
            Duration::from_millis(5),
            start - Duration::from_secs(1),
        );
        assert!(whole.admit_busy(MIB, start).is_ok());
        assert_eq!(
            whole.admit_busy(MIB, start),
            Err(Duration::from_millis(5)),
            "at 100 %, one read's time each"
        );
    }
}
