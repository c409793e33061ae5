//! A ceiling on how fast an export's clients may read, shared by all its connections: a backup
//! reading a whole disk at the device's full speed takes most of it from the VM writing that
//! disk (4 KiB random writes drop to a third here while a pull reads), and what a backup may
//! take is the operator's call, as QEMU's `speed` of a block job is.
//!
//! Virtual scheduling: each READ is due when the bytes admitted before it have had their time
//! at the rate; it may start up to [`READ_RATE_BURST`] early, so that reads of any size pass and a
//! client reading ahead keeps a few requests under way. A read that is not due yet waits in
//! its connection (which reads no further requests meanwhile), never on a shared thread.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// What decides when an export's READ may start, all its connections together: a rate
/// ceiling ([`ReadPacer`]), or an owner's own schedule (a backup export yielding to the VM).
/// A read that may not start yet waits in its connection, never on a shared I/O thread.
pub trait ReadGate: Send + Sync {
    /// Admits a read of `len` bytes at `now`, or says how long until it may be asked again.
    fn admit(&self, len: u64, now: Instant) -> Result<(), Duration>;

    /// What it is, for logs (`Export`'s `Debug`).
    fn describe(&self) -> String;

    /// Sleeps until a read of `len` bytes is admitted: for a connection that serves one
    /// request at a time on its own thread.
    fn wait_for_turn(&self, len: u64) {
        while let Err(wait) = self.admit(len, Instant::now()) {
            std::thread::sleep(wait);
        }
    }
}

/// How far ahead of its due time a read may start.
pub const READ_RATE_BURST: Duration = Duration::from_millis(50);

/// An export's read rate ceiling.
#[derive(Debug)]
pub struct ReadPacer {
    bytes_per_second: u64,
    /// When the next read is due; `None` before the first.
    next_due: Mutex<Option<Instant>>,
}

impl ReadPacer {
    /// A ceiling of `bytes_per_second` (at least 1).
    pub fn new(bytes_per_second: u64) -> ReadPacer {
        ReadPacer {
            bytes_per_second: bytes_per_second.max(1),
            next_due: Mutex::new(None),
        }
    }

    pub fn bytes_per_second(&self) -> u64 {
        self.bytes_per_second
    }

    /// Admits a read of `len` bytes at `now`, or says how long until it may be asked again.
    pub fn admit_at(&self, len: u64, now: Instant) -> Result<(), Duration> {
        let mut next_due = self.next_due.lock().unwrap_or_else(PoisonError::into_inner);
        let due = next_due.map_or(now, |due| due.max(now));
        if let Some(early) = due.checked_duration_since(now + READ_RATE_BURST) {
            if !early.is_zero() {
                return Err(early);
            }
        }
        let seconds = len as f64 / self.bytes_per_second as f64;
        *next_due = Some(due + Duration::from_secs_f64(seconds));
        Ok(())
    }
}

impl ReadGate for ReadPacer {
    fn admit(&self, len: u64, now: Instant) -> Result<(), Duration> {
        self.admit_at(len, now)
    }

    fn describe(&self) -> String {
        format!("at most {} bytes per second", self.bytes_per_second)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn reads_are_admitted_at_the_rate_after_a_burst() {
        let pacer = ReadPacer::new(100 * MIB);
        let start = Instant::now();
        // 4 MiB at 100 MiB/s is 40 ms: the first two pass at once (the second 40 ms early).
        assert!(pacer.admit(4 * MIB, start).is_ok());
        assert!(pacer.admit(4 * MIB, start).is_ok());
        let wait = pacer.admit(4 * MIB, start).unwrap_err();
        assert!(
            wait > Duration::from_millis(25) && wait <= Duration::from_millis(31),
            "{wait:?}"
        );
        // After waiting, it passes; a second's worth of reads takes a second.
        let mut now = start + wait;
        let mut admitted = 0;
        while now < start + Duration::from_secs(1) {
            match pacer.admit(4 * MIB, now) {
                Ok(()) => admitted += 4 * MIB,
                Err(wait) => now += wait,
            }
        }
        // The two at the start, then the rest of the second and one burst.
        let total = admitted + 8 * MIB;
        assert!(
            (100 * MIB..=112 * MIB).contains(&total),
            "{} MiB in a second",
            total / MIB
        );
    }

    #[test]
    fn a_read_larger_than_the_burst_still_passes() {
        let pacer = ReadPacer::new(MIB);
        let start = Instant::now();
        assert!(pacer.admit(32 * MIB, start).is_ok());
        // It took 32 s of the rate: the next waits for them, less the burst.
        let wait = pacer.admit(4096, start).unwrap_err();
        assert_eq!(wait, Duration::from_secs(32) - READ_RATE_BURST);
        assert!(pacer.admit(4096, start + wait).is_ok());
    }

    #[test]
    fn an_idle_pacer_does_not_save_up_a_burst() {
        let pacer = ReadPacer::new(MIB);
        let start = Instant::now();
        assert!(pacer.admit(MIB, start).is_ok());
        let later = start + Duration::from_secs(60);
        assert!(pacer.admit(MIB, later).is_ok());
        assert!(pacer.admit(MIB, later).is_err());
    }
}
