//! The tracking stage a `DirtyTracker` puts in front of its device's pipeline: it refuses
//! requests once the disk is fenced, counts the others in until they complete (so a fence waits
//! for them), and marks what a modifying request touched as dirty once it completed — the
//! same rules as the synchronous wrapper (see `DirtyTracker`).

use super::state::TrackState;
use cryptblk_block::aio::{Admit, SlotRequest, Stage};
use cryptblk_block::BlockError;
use std::sync::Arc;

pub(super) struct TrackingStage {
    state: Arc<TrackState>,
    /// The epoch parity each slot's request is counted in.
    parity: Vec<usize>,
}

impl TrackingStage {
    pub(super) fn new(state: Arc<TrackState>, capacity: usize) -> Self {
        TrackingStage {
            state,
            parity: vec![0; capacity],
        }
    }

    /// The request is over: marked (a modifying one, also when it failed: part of it may have
    /// landed) after it reached the disk and before the guest hears of it (see
    /// `TrackState::mark`), then counted out.
    fn finish(&self, slot: usize, req: &SlotRequest) {
        if req.op.modifies() {
            self.state.mark(req.offset, req.len);
        }
        self.state.leave(self.parity[slot]);
    }
}

impl Stage for TrackingStage {
    fn admit(&mut self, slot: usize, caller: &SlotRequest, _transfer: &mut SlotRequest) -> Admit {
        match self.state.enter_async(caller.op.name()) {
            Ok(parity) => {
                self.parity[slot] = parity;
                Admit::Pass
            }
            Err(e) => Admit::Finish(Err(e)),
        }
    }

    fn complete(
        &mut self,
        slot: usize,
        caller: &SlotRequest,
        _result: &mut Result<(), BlockError>,
    ) -> u64 {
        self.finish(slot, caller);
        0
    }

    /// A request never collected still counts against the fence: let it go.
    fn abandon(&mut self, slot: usize, caller: &SlotRequest) {
        self.finish(slot, caller);
    }
}

#[cfg(test)]
mod tests {
    use crate::DirtyTracker;
    use cryptblk_block::aio::{
        read_at, run_one, write_at, IoBuffers, IoRequest, OwnedBuffer, QueueOptions,
    };
    use cryptblk_block::open_queue;
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
        write_at(&mut *queue, 3 * 4096, &[7u8; 8192]).unwrap();
        assert_eq!(bitmap.count(), 2);
        assert!(bitmap.is_set(3) && bitmap.is_set(4));
        read_at(&mut *queue, 0, &mut [0u8; 8192]).unwrap();
        assert_eq!(bitmap.count(), 2, "reads mark nothing");
        tracker.fence();
        let iov = IoBuffers::whole(Arc::new(OwnedBuffer::from_bytes(&[7u8; 8192])), 8192).unwrap();
        let err = run_one(&mut *queue, &IoRequest::write(0, &iov, false, 3)).unwrap_err();
        assert!(err.to_string().contains("handed over"), "{err}");
        assert_eq!(bitmap.count(), 2);
        assert_eq!(std::fs::read(&path).unwrap()[..4096], [0u8; 4096]);
    }
}
