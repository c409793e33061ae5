// SPDX-License-Identifier: (MIT OR Apache-2.0)

mod virtio_blk;

pub use virtio_blk::{
    validate_lba, virtio_blk_max_queues, VirtioBlkConfig, VirtioBlkFeatureFlags, VirtioBlkQueue,
    VirtioBlkReqBuf, VirtioBlkTransport,
};
