//! `DirtyTracker`'s asynchronous path: a queue wrapper that refuses requests once the disk is
//! fenced, counts the others in until they complete (so a fence waits for them), and marks
//! what a modifying request touched as dirty once it completed — the same rules as the
//! synchronous wrapper (see `DirtyTracker`).

use crate::dirty::TrackState;
use cryptblk_block::aio::{Completion, IoQueue, IoRequest, QueueFull};
use cryptblk_block::BlockError;
use std::os::fd::RawFd;
use std::sync::Arc;

#[derive(Default, Clone, Copy)]
struct Slot {
    tag: u64,
    /// The range to mark dirty on completion (modifying requests).
    dirty: Option<(u64, u64)>,
    used: bool,
}

pub(crate) struct TrackingQueue {
    inner: Box<dyn IoQueue>,
    state: Arc<TrackState>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Refused requests, handed out by the next `drain`.
    refused: Vec<Completion>,
    signal: cryptblk_block::aio::Notifier,
}

impl TrackingQueue {
    pub(crate) fn new(inner: Box<dyn IoQueue>, state: Arc<TrackState>) -> Result<Self, BlockError> {
        let capacity = inner.capacity();
        // A handle on the inner eventfd, to wake the owner for refused requests.
        let signal = cryptblk_block::aio::Notifier::dup_of(inner.notifier())
            .map_err(|e| BlockError::io("dup eventfd", e))?;
        Ok(TrackingQueue {
            inner,
            state,
            slots: vec![Slot::default(); capacity],
            free: (0..capacity as u32).rev().collect(),
            refused: Vec::new(),
            signal,
        })
    }
}

impl IoQueue for TrackingQueue {
    fn notifier(&self) -> RawFd {
        self.inner.notifier()
    }

    fn capacity(&self) -> usize {
        self.slots.len()
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.refused.len()
    }

    unsafe fn push(&mut self, req: &IoRequest<'_>) -> Result<(), QueueFull> {
        if self.in_flight() >= self.slots.len() {
            return Err(QueueFull(self.in_flight()));
        }
        if let Err(e) = self.state.enter_async(req.op.name()) {
            self.refused.push(Completion {
                tag: req.tag,
                result: Err(e),
            });
            self.signal.notify();
            return Ok(());
        }
        let Some(index) = self.free.pop() else {
            self.state.leave();
            return Err(QueueFull(self.in_flight()));
        };
        self.slots[index as usize] = Slot {
            tag: req.tag,
            dirty: req.op.modifies().then_some((req.offset, req.len)),
            used: true,
        };
        let inner_req = IoRequest {
            tag: u64::from(index),
            ..*req
        };
        // SAFETY: forwarded from this function's contract.
        match unsafe { self.inner.push(&inner_req) } {
            Ok(()) => Ok(()),
            Err(full) => {
                self.slots[index as usize].used = false;
                self.free.push(index);
                self.state.leave();
                Err(full)
            }
        }
    }

    fn submit(&mut self) -> Result<(), BlockError> {
        self.inner.submit()
    }

    fn drain(&mut self, out: &mut dyn FnMut(Completion)) {
        let TrackingQueue {
            inner,
            state,
            slots,
            free,
            refused,
            signal,
        } = self;
        signal.clear();
        inner.drain(&mut |c| {
            let Some(slot) = usize::try_from(c.tag).ok().and_then(|i| slots.get_mut(i)) else {
                return;
            };
            if !slot.used {
                return;
            }
            slot.used = false;
            // Marked after the write landed (also when it failed: part of it may have), and
            // before the guest hears of it: see `DirtyTracker::mark`.
            if let Some((offset, len)) = slot.dirty {
                state.mark(offset, len);
            }
            state.leave();
            free.push(c.tag as u32);
            out(Completion {
                tag: slot.tag,
                result: c.result,
            });
        });
        for c in refused.drain(..) {
            out(c);
        }
    }

    fn wait(&mut self) {
        if self.refused.is_empty() {
            self.inner.wait();
        }
    }
}

impl Drop for TrackingQueue {
    /// Requests never collected still count against the fence: let them go.
    fn drop(&mut self) {
        for slot in self.slots.iter().filter(|s| s.used) {
            if let Some((offset, len)) = slot.dirty {
                self.state.mark(offset, len);
            }
            self.state.leave();
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::DirtyTracker;
    use cryptblk_block::aio::{open_queue, run_one, IoRequest, IoVec, QueueOptions};
    use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
    use std::sync::Arc;

    #[test]
    fn queue_marks_writes_and_refuses_after_the_fence() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.raw");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let raw: Arc<dyn BlockDevice> = Arc::new(
            RawFile::open(
                &path,
                OpenOptions {
                    writable: true,
                    lock: true,
                },
            )
            .unwrap(),
        );
        let tracker = Arc::new(DirtyTracker::new(raw, 0, 4096).unwrap());
        let device: Arc<dyn BlockDevice> = tracker.clone();
        let mut queue = open_queue(&device, &QueueOptions { depth: 4 }).unwrap();
        let bitmap = tracker.start_tracking().unwrap();
        bitmap.clear_all();
        let mut buf = vec![7u8; 8192];
        let iov = [IoVec::from_slice(&mut buf)];
        // SAFETY: `buf` outlives each call and is not touched meanwhile.
        unsafe { run_one(&mut *queue, &IoRequest::write(3 * 4096, &iov, false, 1)) }.unwrap();
        assert_eq!(bitmap.count(), 2);
        assert!(bitmap.is_set(3) && bitmap.is_set(4));
        // SAFETY: as above.
        unsafe { run_one(&mut *queue, &IoRequest::read(0, &iov, 2)) }.unwrap();
        assert_eq!(bitmap.count(), 2, "reads mark nothing");
        tracker.fence();
        // SAFETY: as above.
        let err =
            unsafe { run_one(&mut *queue, &IoRequest::write(0, &iov, false, 3)) }.unwrap_err();
        assert!(err.to_string().contains("handed over"), "{err}");
        assert_eq!(bitmap.count(), 2);
        assert_eq!(std::fs::read(&path).unwrap()[..4096], [0u8; 4096]);
    }
}
