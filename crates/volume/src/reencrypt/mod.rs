//! Re-encryption as volume operations: a served LUKS2 volume's key replaced while it serves
//! (cryptsetup's LUKS2 reencryption, forward, in place), a served raw volume encrypted in
//! place (`--encrypt`: backward, with a data shift), and the preparation the CLI's offline
//! commands share with them ([`NewLayout`], [`convert_luks1_first`]).
//!
//! The engine is `cryptblk_luks::luks2::reencrypt::Reencryption` (hotzones, resilience,
//! recovery, finish); the offline CLI drives it over the image alone. Online, the volume
//! drives it hotzone by hotzone and moves its [`SegmentMap`](crate::SegmentMap) after each
//! commit, so that the data path serves exactly what the header says:
//!
//! ```text
//!   Volume::reencrypt_online ──► header: LUKS1? convert ── no reencryption? init (Supervisor's params)
//!        │                        unlock both keys, recover a failed hotzone, split the map
//!        ▼
//!   per hotzone: pause? ─► fence ─► Reencryption::step ─► map advances/follows ─► throttle
//!        │                               └─ fails: recover from the header, then stop
//!        ▼
//!   finish: the old key gone (the map's single new segment); the caller hears Finished
//! ```
//!
//! The caller (the daemon) keeps what is its own through a [`Supervisor`]: the parameters of a
//! new run, progress, and where volume keys go when they change (a key cache).
mod encrypt;
mod error;
mod online;
mod prepare;
mod run;

pub use error::{OnlineError, OnlineErrorKind};
pub use prepare::{convert_luks1_first, ChosenLayout, NewLayout, PrepareError};

use crate::{SegmentMap, Volume, VolumeKeys};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::luks2::reencrypt::{EncryptParams, InitParams};
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::UnlockOptions;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// cryptsetup's recommended `--reduce-device-size`: a 16 MiB header area, luksFormat's
/// default data offset, with room for every keyslot.
pub const DEFAULT_REDUCE: u64 = 32 << 20;

/// What an online run does to the volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnlineMode {
    /// A new volume key (cipher, key size, sector size) for a LUKS2 volume.
    Reencrypt,
    /// A raw volume encrypted in place.
    Encrypt,
}

impl OnlineMode {
    pub fn name(self) -> &'static str {
        match self {
            OnlineMode::Reencrypt => "reencrypt",
            OnlineMode::Encrypt => "encrypt",
        }
    }

    /// The run a volume's map is in the middle of (found so when it was opened), if any:
    /// parts at different offsets are an encryption's (its data moves); a key-to-key
    /// reencryption keeps the payload where it is.
    pub fn under_way(segments: &SegmentMap) -> Option<OnlineMode> {
        segments
            .is_split()
            .then(|| match segments.single_data_offset() {
                Some(_) => OnlineMode::Reencrypt,
                None => OnlineMode::Encrypt,
            })
    }
}

/// The hotzone being rewritten: volume bytes `[offset, offset + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hotzone {
    pub offset: u64,
    pub len: u64,
}

/// A run got going: the keys are unlocked, the map serves the header's segments, the first
/// hotzone is next.
#[derive(Debug, Clone)]
pub struct RunStart {
    pub mode: OnlineMode,
    /// Volume bytes in the new layout (for an encryption: counted from the volume's end,
    /// which it works down from).
    pub done: u64,
    pub total: u64,
    /// The resilience of the hotzones as LUKS2 names it (`checksum`, `datashift`, ...).
    pub resilience: String,
    /// The new cipher as the status shows it.
    pub cipher: String,
}

/// How a run ended when it did not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every byte is in the new layout and the header says so.
    Finished,
    /// The pause flag was seen; the boundary is committed, a later run continues.
    Paused,
}

/// What an online run is given.
pub struct OnlineOptions<'a> {
    /// How the caller names the volume, in messages and log lines.
    pub name: &'a str,
    /// Unlocks the header's keyslots (a new encryption's first keyslot takes it).
    pub passphrase: &'a [u8],
    pub unlock: &'a UnlockOptions,
    pub pool: Arc<CryptoPool>,
    /// Bytes per second the run may read and write (0: no limit).
    pub max_bandwidth: u64,
    /// Set to stop once the hotzone being rewritten is committed.
    pub pause: &'a AtomicBool,
}

/// The caller's side of an online run.
pub trait Supervisor {
    /// The caller's error, which a volume error becomes.
    type Error: From<OnlineError>;

    /// The parameters of a new reencryption of `header` (asked only when the header has
    /// none under way; LUKS1 is converted before).
    fn reencryption_params(&self, header: &Luks2Header) -> Result<InitParams, Self::Error>;

    /// The new header of an encryption in place (asked only when the volume is still raw).
    fn encryption_params(&self) -> Result<EncryptParams, Self::Error>;

    /// The run got going (see [`RunStart`]); an error before this left the image unchanged,
    /// or as a restart would find it.
    fn started(&self, run: RunStart);

    /// The hotzone about to be rewritten.
    fn hotzone(&self, zone: Hotzone);

    /// A hotzone is committed: `done` bytes are in the new layout.
    fn advanced(&self, done: u64);

    /// The volume keys changed (both while a run is under way, the new one alone after the
    /// finish); the volume takes them right after ([`Volume::volume_keys`]).
    fn keys_changed(&self, keys: &VolumeKeys);
}

impl Volume {
    /// Runs an online reencryption (`Reencrypt`, a LUKS2 volume or a LUKS1 one converted
    /// first) or encryption in place (`Encrypt`, a raw volume, or one whose encryption is
    /// under way) until it finishes, is paused or fails. Started anew, or continued from what
    /// the header says; the volume serves throughout.
    pub fn reencrypt_online<S: Supervisor>(
        &self,
        mode: OnlineMode,
        options: &OnlineOptions<'_>,
        supervisor: &S,
    ) -> Result<Outcome, S::Error> {
        let run = run::Run::new(self, options);
        match mode {
            OnlineMode::Reencrypt => run.rotate(supervisor),
            OnlineMode::Encrypt => run.encrypt(supervisor),
        }
    }
}
