//! The eventfd through which a queue tells its owner's event loop that completions are ready
//! (and the memory budget tells a waiting queue that bytes were granted to it): a leaf that the
//! I/O framework and the budget both use.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// A non-blocking eventfd. Producers add completions to a list first and `notify` second;
/// the consumer `clear`s first and reads the list second, so no completion is ever left
/// without a pending wake-up.
#[derive(Debug)]
pub struct Notifier {
    fd: OwnedFd,
}

impl Notifier {
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes two integers and returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
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
        // SAFETY: writes 8 bytes from a live local buffer to our own descriptor. The only
        // possible failure is EAGAIN when the counter is saturated, which still leaves it
        // readable: nothing to handle.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Resets the counter so the eventfd is no longer readable; true if it was.
    pub fn clear(&self) -> bool {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local buffer from our own non-blocking
        // descriptor; EAGAIN (nothing pending) is an expected result.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        n == 8
    }

    /// Blocks until the eventfd is readable (it stays readable: `clear` resets it).
    pub fn wait(&self) {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        loop {
            // SAFETY: one valid pollfd, length 1, no timeout.
            let rc = unsafe { libc::poll(&mut pfd, 1, -1) };
            if rc >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return;
            }
        }
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
