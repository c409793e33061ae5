//! A step every request of a pipeline passes on its way to the engine and back: the range and
//! read-only check (built in, [`Bounds`]), the volume's crypto, discard rounding, the
//! migration's fence and dirty log. Each is applied once per request, in one place, whatever
//! the engine.

use super::{IoOp, IoRequest, SlotRequest};
use crate::error::check_range;
use crate::BlockError;
use std::path::PathBuf;
use std::sync::Arc;

/// What a stage decides about a request.
#[derive(Debug)]
pub enum Admit {
    /// On to the next stage (or the engine).
    Pass,
    /// Finished here, with this result; it never reaches the engine.
    Finish(Result<(), BlockError>),
    /// Run, as this stage sees it, on the pipeline's synchronous path (the volume's own
    /// `BlockDevice` methods on the I/O threads), past the stages behind this one.
    Synchronous,
}

/// One step of a pipeline. Stages are called on the queue's thread only.
pub trait Stage: Send {
    /// Sees a request on its way down: `caller` is the request as pushed, `transfer` the
    /// request as the stages in front of this one left it (in this stage's offsets), which it
    /// may rewrite for the stages behind it. The buffers of both stay valid until the stage
    /// sees the request complete (the pipeline holds them).
    fn admit(&mut self, slot: usize, caller: &SlotRequest, transfer: &mut SlotRequest) -> Admit;

    /// Sees a request this stage passed on, once it finished (before the caller hears of it);
    /// may change its result. Returns the bytes of data work it did (the drain's budget). The
    /// default does nothing. The caller's buffers are still valid (the completion is not
    /// handed out yet).
    fn complete(
        &mut self,
        slot: usize,
        caller: &SlotRequest,
        result: &mut Result<(), BlockError>,
    ) -> u64 {
        let _ = (slot, caller, result);
        0
    }

    /// The queue is dropped with the request passed on and never collected.
    fn abandon(&mut self, slot: usize, caller: &SlotRequest) {
        let _ = (slot, caller);
    }
}

/// The range and read-only check of a pipeline, applied before any stage. The top layer sets
/// it: a layer maps its valid range inside its backend's, so its check implies the backend's.
#[derive(Clone)]
pub struct Bounds {
    /// The device's size, read at each request (an RBD image may grow).
    size: Arc<dyn Fn() -> u64 + Send + Sync>,
    read_only: bool,
    path: Option<PathBuf>,
}

impl Bounds {
    /// Requests within `size` bytes; modifying ones refused when `read_only`.
    pub fn new(size: u64, read_only: bool) -> Self {
        Bounds::live(Arc::new(move || size), read_only)
    }

    /// As `new`, with the size read from `size` at each request.
    pub fn live(size: Arc<dyn Fn() -> u64 + Send + Sync>, read_only: bool) -> Self {
        Bounds {
            size,
            read_only,
            path: None,
        }
    }

    /// Names `path` in the errors.
    pub fn with_path(mut self, path: PathBuf) -> Self {
        self.path = Some(path);
        self
    }

    pub(crate) fn check(&self, req: &IoRequest<'_>) -> Result<(), BlockError> {
        let refused = if req.op.modifies() && self.read_only {
            Err(BlockError::read_only(req.op.name()).at(req.offset))
        } else if req.op != IoOp::Flush {
            check_range(req.op.name(), req.offset, req.len, (self.size)())
        } else {
            Ok(())
        };
        match &self.path {
            Some(path) => refused.map_err(|e| e.with_path(path)),
            None => refused,
        }
    }
}
