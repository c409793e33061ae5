//! The sender's model of the link: with `--max-bandwidth`, every byte sent occupies the link
//! for 1/rate seconds, and nothing else can be sent until the bytes before it have gone. One
//! clock for both channels, because they share the network: an urgent answer still waits for
//! the slice of bulk data already on the wire, which is why bulk data goes out in slices.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Link {
    bytes_per_sec: Option<u64>,
    /// When the bytes sent so far have crossed the link.
    free_at: Instant,
}

impl Link {
    pub fn new(bytes_per_sec: Option<u64>) -> Self {
        Link {
            bytes_per_sec,
            free_at: Instant::now(),
        }
    }

    /// How long until the link is free again (zero when it is).
    pub fn busy_for(&self) -> Duration {
        self.free_at.saturating_duration_since(Instant::now())
    }

    /// Accounts `bytes` just handed to a socket.
    pub fn sent(&mut self, bytes: usize) {
        let Some(rate) = self.bytes_per_sec else {
            return;
        };
        let start = self.free_at.max(Instant::now());
        self.free_at = start + Duration::from_secs_f64(bytes as f64 / rate as f64);
    }
}

/// Waits until the link is nearly free (with no cap, at once). Up to `LINK_QUEUE` of queued
/// transmission is allowed, as in a NIC queue: sleeping for every few microseconds would cost
/// more than the wait itself (a sleep overshoots by tens of microseconds).
pub(super) fn wait_link(link: &Mutex<Link>) {
    const LINK_QUEUE: Duration = Duration::from_micros(200);
    let busy = link
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .busy_for();
    if busy > LINK_QUEUE {
        std::thread::sleep(busy - LINK_QUEUE / 2);
    }
}

pub(super) fn link_sent(link: &Mutex<Link>, bytes: usize) {
    link.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .sent(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_cap_the_link_is_always_free() {
        let mut link = Link::new(None);
        link.sent(1 << 30);
        assert_eq!(link.busy_for(), Duration::ZERO);
    }

    #[test]
    fn with_a_cap_bytes_occupy_the_link_for_their_time() {
        // 10 MB/s: 1 MB takes 100 ms, and the next 1 MB queues behind it. Time passing
        // between the calls (a loaded machine) shortens what is left, never the total.
        let started = Instant::now();
        let mut link = Link::new(Some(10_000_000));
        for total_ms in [100, 200] {
            link.sent(1_000_000);
            let busy = link.busy_for();
            let total = Duration::from_millis(total_ms);
            assert!(busy <= total, "{busy:?}");
            assert!(busy + started.elapsed() >= total, "{busy:?}");
        }
    }
}
