//! The sender's model of the link: with `--max-bandwidth`, every byte sent occupies the link
//! for 1/rate seconds, and nothing else can be sent until the bytes before it have gone. One
//! clock for both channels, because they share the network: an urgent answer still waits for
//! the slice of bulk data already on the wire, which is why bulk data goes out in slices.

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
