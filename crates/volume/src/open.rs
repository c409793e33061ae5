//! The one door to an image: [`Volume::open`] (and [`Opened::open`] under it) look at the
//! first bytes of an opened [`Container`] and open it as what it is. A LUKS1 or LUKS2 image is
//! unlocked the way the caller says ([`Unlock`]: a passphrase, volume keys already derived,
//! or a procedure of its own such as the daemon's key cache, key sources and clevis tokens,
//! all ending in `luks_open.rs`); anything else is raw, and refused when a key was given for
//! it (a raw image takes none, and serving it plain when the user meant it encrypted would be
//! the worse mistake).
//!
//! Opening the container (a locked file, an RBD image, a migration's incoming file) and
//! refusing formats a caller cannot serve (qcow2 for the daemon) stay with the caller: the
//! door starts from bytes, not from a path.
//!
//! ```text
//!   container ──► LUKS magic? ──yes──► Unlock::unlock ──► LuksVolume ──► Volume::from_luks
//!                     │
//!                     no ──► key given? ──yes──► OpenError::KeyForRaw
//!                                 │
//!                                 no ──► Volume::from_raw
//! ```
use crate::luks_open::{open_luks_volume_with, VolumeOptions};
use crate::{LuksVolume, TrackingError, Volume, VolumeError};
use cryptblk_block::Container;
use cryptblk_luks::{LuksError, LuksImage, Unlocker};
use std::path::PathBuf;
use std::sync::Arc;

/// How [`Volume::open`] unlocks the image if it is LUKS. [`Key`] covers a passphrase or
/// volume keys the caller has; a caller with more ways to find a key (the daemon's key cache,
/// configured key sources and clevis tokens) implements it with its own error type.
pub trait Unlock {
    /// Why unlocking failed, as the caller reports it.
    type Error;

    /// Whether a key is given: a raw image takes none and is refused with one.
    fn has_key(&self) -> bool;

    /// Unlocks the LUKS1/LUKS2 image on `container`.
    fn unlock(self, container: Arc<dyn Container>) -> Result<LuksVolume, Self::Error>;
}

/// A key the caller has, or none (then a LUKS image is refused: [`VolumeError::NoKey`]).
#[derive(Debug)]
pub enum Key<'a> {
    None,
    /// A passphrase (tried on the keyslots, through their KDF) or volume keys already derived
    /// (no KDF; [`LuksError::KnownKeyStale`] when they no longer match the header).
    Given(Unlocker<'a>, &'a VolumeOptions),
}

impl Unlock for Key<'_> {
    type Error = VolumeError;

    fn has_key(&self) -> bool {
        matches!(self, Key::Given(..))
    }

    fn unlock(self, container: Arc<dyn Container>) -> Result<LuksVolume, VolumeError> {
        match self {
            Key::Given(unlocker, opts) => open_luks_volume_with(container, unlocker, opts),
            Key::None => Err(VolumeError::NoKey {
                path: container.name().to_path_buf(),
            }),
        }
    }
}

/// Why [`Volume::open`] failed; `E` is the [`Unlock`]'s own error.
#[derive(Debug, thiserror::Error)]
pub enum OpenError<E> {
    /// The first bytes could not be read.
    #[error("reading the start of {}", path.display())]
    Probe {
        path: PathBuf,
        #[source]
        source: LuksError,
    },
    /// A key was given for a raw image.
    #[error("a key is given, but {} is raw, not LUKS", path.display())]
    KeyForRaw { path: PathBuf },
    #[error(transparent)]
    Unlock(E),
    #[error("setting up dirty tracking")]
    Tracking(#[source] TrackingError),
}

/// An image opened as its first bytes say: a LUKS image unlocked, or a raw one as it is.
/// What [`Volume::open`] serves; an offline command copying the payload takes it as it is
/// (without the tracking stage).
pub enum Opened {
    Luks(Box<LuksVolume>),
    Raw(Arc<dyn Container>),
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Opened::Luks(volume) => f.debug_tuple("Opened::Luks").field(volume).finish(),
            Opened::Raw(container) => f
                .debug_tuple("Opened::Raw")
                .field(&container.name())
                .finish(),
        }
    }
}

impl Opened {
    /// Detects the format of the image in `container` (LUKS1 and LUKS2 by their magic,
    /// anything else raw) and opens it: a LUKS image unlocked by `unlock`, a raw one refused
    /// when `unlock` has a key.
    pub fn open<U: Unlock>(
        container: Arc<dyn Container>,
        unlock: U,
    ) -> Result<Opened, OpenError<U::Error>> {
        let luks = LuksImage::probe(container.header_io()).map_err(|source| OpenError::Probe {
            path: container.name().to_path_buf(),
            source,
        })?;
        if luks {
            return unlock
                .unlock(container)
                .map(|volume| Opened::Luks(Box::new(volume)))
                .map_err(OpenError::Unlock);
        }
        if unlock.has_key() {
            return Err(OpenError::KeyForRaw {
                path: container.name().to_path_buf(),
            });
        }
        Ok(Opened::Raw(container))
    }
}

impl Volume {
    /// The door to a volume: the image in `container` opened as its first bytes say
    /// ([`Opened::open`]) and put behind its tracking stage. The daemon opens every disk it
    /// serves through here, attached or received by a migration.
    pub fn open<U: Unlock>(
        container: Arc<dyn Container>,
        unlock: U,
    ) -> Result<Volume, OpenError<U::Error>> {
        match Opened::open(container, unlock)? {
            Opened::Luks(volume) => Volume::from_luks(*volume),
            Opened::Raw(container) => Volume::from_raw(container),
        }
        .map_err(OpenError::Tracking)
    }
}
