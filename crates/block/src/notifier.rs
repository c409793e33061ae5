//! The eventfd through which a queue tells its owner's event loop that completions are ready
//! (and the memory budget tells a waiting queue that bytes were granted to it): a leaf that the
//! I/O framework and the budget both use.

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
use rustix::io::Errno;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

/// A non-blocking eventfd. Producers add completions to a list first and `notify` second;
/// the consumer `clear`s first and reads the list second, so no completion is ever left
/// without a pending wake-up.
#[derive(Debug)]
pub struct Notifier {
    fd: OwnedFd,
}

impl Notifier {
    pub fn new() -> io::Result<Self> {
        let fd = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?;
        Ok(Notifier { fd })
    }

    /// A second handle on the same counter.
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(Notifier {
            fd: self.fd.try_clone()?,
        })
    }

    /// Makes the eventfd readable.
    pub fn notify(&self) {
        let one = 1u64.to_ne_bytes();
        // The only possible failure is EAGAIN when the counter is saturated, which still
        // leaves it readable: nothing to handle.
        let _ = rustix::io::write(&self.fd, &one);
    }

    /// Resets the counter so the eventfd is no longer readable; true if it was.
    pub fn clear(&self) -> bool {
        let mut buf = [0u8; 8];
        // EAGAIN (nothing pending) is an expected result.
        matches!(rustix::io::read(&self.fd, &mut buf), Ok(8))
    }

    /// Blocks until the eventfd is readable (it stays readable: `clear` resets it).
    pub fn wait(&self) {
        let mut pfd = [PollFd::new(&self.fd, PollFlags::IN)];
        while let Err(Errno::INTR) = poll(&mut pfd, None) {}
    }
}

impl AsFd for Notifier {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Notifier {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_then_clear() {
        let n = Notifier::new().unwrap();
        assert!(!n.clear());
        let other = n.try_clone().unwrap();
        other.notify();
        other.notify();
        n.wait();
        assert!(n.clear());
        assert!(!n.clear());
    }
}
