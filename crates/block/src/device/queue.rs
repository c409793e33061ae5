//! A device's queue: the pipeline a `BlockDevice` offers (an asynchronous engine, a layer's
//! stages over its backend's queue) or, for a device without one, its synchronous methods on
//! the I/O thread pool. The I/O framework (`aio`) knows engines and stages, not devices; this
//! is where a device meets it.

use super::sync_engine;
use crate::aio::{Bounds, IoQueue, Pipeline, QueueOptions};
use crate::{BlockDevice, BlockError};
use std::sync::Arc;

/// Opens a queue on `device`: see [`open_pipeline`].
pub fn open_queue(
    device: &Arc<dyn BlockDevice>,
    opts: &QueueOptions,
) -> Result<Box<dyn IoQueue>, BlockError> {
    Ok(Box::new(open_pipeline(device, opts)?))
}

/// The pipeline of a queue on `device`: its own (`BlockDevice::pipeline`: an asynchronous
/// engine, a layer's stages) when it has one, else its synchronous methods on the I/O thread
/// pool.
pub fn open_pipeline(
    device: &Arc<dyn BlockDevice>,
    opts: &QueueOptions,
) -> Result<Pipeline, BlockError> {
    match device.pipeline(opts) {
        Some(pipeline) => pipeline,
        None => Pipeline::synchronous(device.clone(), opts),
    }
}

impl Pipeline {
    /// Any `BlockDevice` served by its synchronous methods on the I/O thread pool, through
    /// bounce buffers. Only the range is checked here: such a device refuses writes with its
    /// own, more specific, error.
    pub fn synchronous(
        device: Arc<dyn BlockDevice>,
        opts: &QueueOptions,
    ) -> Result<Self, BlockError> {
        let bounds = Bounds::new(device.size(), false);
        Pipeline::new(opts, bounds, |notifier, capacity| {
            Ok(sync_engine::engine(device, capacity, notifier))
        })
    }

    /// Gives the stages a synchronous path: `device`'s methods on the I/O thread pool.
    pub fn set_sync_path(&mut self, device: Arc<dyn BlockDevice>) {
        self.set_sync_engine(|notifier, capacity| sync_engine::engine(device, capacity, notifier));
    }
}
