//! The volume: what a guest's bytes are. It sits between the frontends (vhost-user-blk, NBD,
//! convert) and the backends (`cryptblk-block`'s raw file and qcow2, `cryptblk-rbd`):
//!
//! - [`Volume`] is what the daemon serves: an image opened, LUKS or raw, behind its tracking
//!   stage, with its LUKS facts and the keys serving it. [`Volume::open`] is the door: it
//!   tells LUKS from raw by the image's first bytes and unlocks as the caller says
//!   ([`Unlock`]);
//! - [`LuksVolume`] is a LUKS1 or LUKS2 image unlocked on its [`Container`]
//!   (`open_luks_volume*`), with its LUKS facts; [`CryptDevice`] is its payload, decrypted
//!   sector by sector, and the per-queue crypt stage its pipelines run
//!   (`CryptDevice::open_pipeline`);
//! - [`SegmentMap`] is how the volume's parts are stored while an online re-encryption or
//!   encryption moves the boundary between old and new ([`SegmentCiphers`], [`data_cipher`]);
//! - [`Volume::reencrypt_online`] replaces a served volume's key, or encrypts a raw one in
//!   place, hotzone by hotzone while it serves; [`NewLayout`] and [`convert_luks1_first`]
//!   are the preparation the CLI's offline `reencrypt` shares with it;
//! - [`Volume::resize`] grows and shrinks a disk while it serves; [`resize_luks`] and
//!   [`resize_raw`] one that is not open, by the same steps;
//! - [`Keyslots`] adds and removes the keyslots of a LUKS header, the daemon's on a disk it
//!   serves as the CLI's on an image not open;
//! - [`DirtyTracker`] is the tracking stage: the blocks written since a migration last sent
//!   them, and the fence of a hand-over;
//! - [`CheckpointStore`] keeps a disk's checkpoints (what changed since each, for incremental
//!   backups), recorded through the write-intent log ([`IntentLog`]) the tracker's stages
//!   pass every write through.
//!
//! Backends know nothing about LUKS, and the volume knows nothing about the protocol in front
//! of it.
//!
//! [`Container`]: cryptblk_block::Container

pub mod checkpoint;
mod crypt;
mod keyslots;
mod luks_open;
mod luks_reencrypting;
mod luks_volume;
mod open;
mod reencrypt;
mod resize;
mod tracking;
mod volume;

pub use checkpoint::{CheckpointError, CheckpointStore, IntentLog};
pub use crypt::{
    data_cipher, BackendOffset, CryptDevice, CryptLayout, IvSector, SegmentCiphers, SegmentMap,
    VolumeOffset, DRAIN_TIMEOUT,
};
pub use keyslots::{Keyslots, LastKeyslot, RemoveError, Unlocked};
pub use luks_open::{open_luks_volume, open_luks_volume_on, open_luks_volume_with, VolumeOptions};
pub use luks_volume::{LuksVolume, VolumeError};
pub use open::{Key, OpenError, Opened, Unlock};
pub use reencrypt::{
    convert_luks1_first, ChosenLayout, Hotzone, NewLayout, OnlineError, OnlineErrorKind,
    OnlineMode, OnlineOptions, Outcome, PrepareError, RunStart, Supervisor, DEFAULT_REDUCE,
};
pub use resize::{resize_luks, resize_raw, ResizeError, Resized, RAW_SECTOR};
pub use tracking::{
    BackgroundReads, BackupView, CopyBeforeWrite, DirtyBitmap, DirtyTracker, GuestActivity,
    TrackingError, COPY_REGION, RELEASE_GRANULE,
};
pub use volume::{LuksFacts, Volume, VolumeKeys};
