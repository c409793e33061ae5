//! The checkpoint stage: on a disk with a checkpoint, a write, discard or write-zeroes to a
//! region whose bit is not durable yet is sent to the synchronous path ([`RecordingPath`]),
//! which records it in the write-intent log on an I/O thread (the queue's thread never waits
//! for a flush) and only then does it. Every other request passes at the cost of one atomic
//! load (no checkpoint) or a few (bits durable): the steady state.
//!
//! A write admitted while a checkpoint is being added may find its bit durable in the
//! bitmap being retired and pass; it is recorded in the new one when it completes, before its
//! caller hears of it, so the checkpoint added counts it as changed since.

use super::TrackState;
use crate::checkpoint::Generation;
use cryptblk_block::aio::{Admit, SlotRequest, Stage};
use cryptblk_block::{BlockDevice, BlockError, Extent};
use std::sync::Arc;

pub(crate) struct CheckpointStage {
    state: Arc<TrackState>,
    /// The generation of the last write checked, kept to check the next one without a lock.
    cached: Option<Arc<Generation>>,
    /// The generation each slot's modifying request was admitted under.
    admitted: Vec<u64>,
}

impl CheckpointStage {
    pub(crate) fn new(state: Arc<TrackState>, capacity: usize) -> Self {
        CheckpointStage {
            state,
            cached: None,
            admitted: vec![0; capacity],
        }
    }
}

impl Stage for CheckpointStage {
    fn admit(&mut self, slot: usize, caller: &SlotRequest, _transfer: &mut SlotRequest) -> Admit {
        if !caller.op.modifies() {
            return Admit::Pass;
        }
        // A backup's old bytes are copied on the synchronous path too (rare: once per region).
        let copy = self.state.needs_copy(caller.offset, caller.len);
        let log = &self.state.intent;
        let active = log.active();
        self.admitted[slot] = active;
        if copy {
            return Admit::Synchronous;
        }
        if active == 0 {
            return Admit::Pass;
        }
        if self.cached.as_ref().is_none_or(|g| g.id != active) {
            self.cached = log.current();
        }
        let (offset, len) = self.state.file_range(caller.offset, caller.len);
        match &self.cached {
            Some(g) if g.id == active && g.is_durable(offset, len) => Admit::Pass,
            _ => Admit::Synchronous,
        }
    }

    fn complete(
        &mut self,
        slot: usize,
        caller: &SlotRequest,
        result: &mut Result<(), BlockError>,
    ) -> u64 {
        if caller.op.modifies() && self.state.intent.active() != self.admitted[slot] {
            // A checkpoint was added (or removed) meanwhile: rare, so done here, on the
            // queue's thread.
            if let Err(e) = self
                .state
                .record(caller.op.name(), caller.offset, caller.len)
            {
                if result.is_ok() {
                    *result = Err(e);
                }
            }
        }
        0
    }
}

/// The synchronous path of a tracked disk's queues: the volume's own methods, with what a
/// modifying request touches recorded in the write-intent log before (and, should a
/// checkpoint have been added meanwhile, again after) it is done, and during a backup its old
/// bytes copied to the backup's scratch before.
pub(crate) struct RecordingPath {
    pub(crate) state: Arc<TrackState>,
    pub(crate) inner: Arc<dyn BlockDevice>,
}

impl RecordingPath {
    fn modify(
        &self,
        op: &'static str,
        offset: u64,
        len: u64,
        run: impl FnOnce() -> Result<(), BlockError>,
    ) -> Result<(), BlockError> {
        self.state.record(op, offset, len)?;
        self.state.copy_old(offset, len);
        run()?;
        self.state.record(op, offset, len)
    }
}

impl BlockDevice for RecordingPath {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        self.modify("write", offset, buf.len() as u64, || {
            self.inner.write_at(buf, offset)
        })
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.modify("discard", offset, len, || self.inner.discard(offset, len))
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        self.inner.block_status(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.modify("write zeroes", offset, len, || {
            self.inner.write_zeroes(offset, len)
        })
    }
}
