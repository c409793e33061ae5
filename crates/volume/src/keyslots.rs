//! Keyslot changes on a LUKS header, the one sequence both the daemon (`key-add`,
//! `key-remove` on a disk it serves) and the CLI (`cryptblk key add|remove|change` on an image
//! not open) run: read the header, verify a passphrase against it, write the keyslot, and the
//! header goes back (both copies, crash-safe: `cryptblk-luks`).
//!
//! The caller reads the passphrases (a prompt, a file, a descriptor, a secret) and holds the
//! image against other writers (the CLI's lock, the daemon's header-change guard); a new
//! passphrase is asked for only once the existing one opened a keyslot, so
//! [`Keyslots::unlock`] comes first and the change follows on what it returns.
use cryptblk_crypto::SecretKey;
use cryptblk_luks::{HeaderIo, LuksError, LuksImage, LuksVersion, PbkdfOptions, UnlockOptions};

/// The keyslots of a LUKS1/LUKS2 header, read from `io` to be changed there.
pub struct Keyslots<'a> {
    io: &'a dyn HeaderIo,
    header: LuksImage,
}

/// Why a keyslot was not removed.
#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    /// The passphrase opens the header's only keyslot: without it the data is lost. The
    /// message is the caller's (which disk, and how to force it if it can).
    #[error("keyslot {slot} is the last one")]
    LastKeyslot { slot: usize },
    #[error(transparent)]
    Luks(#[from] LuksError),
}

/// Whether removing the header's only keyslot is refused ([`RemoveError::LastKeyslot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LastKeyslot {
    Refuse,
    Allow,
}

impl<'a> Keyslots<'a> {
    /// Reads the header on `io`, with the findings of reading it (e.g. a damaged secondary
    /// LUKS2 copy).
    pub fn read(io: &'a dyn HeaderIo) -> Result<(Keyslots<'a>, Vec<String>), LuksError> {
        let (header, warnings) = LuksImage::read(io)?;
        Ok((Keyslots { io, header }, warnings))
    }

    pub fn version(&self) -> LuksVersion {
        self.header.version()
    }

    /// Why the header must not be written (a LUKS2 requirement we do not know), if so.
    pub fn read_only_reason(&self) -> Option<String> {
        self.header.read_only_reason()
    }

    /// Verifies `passphrase`: the keyslot it opens and the volume key it gives, with which
    /// the change goes on.
    pub fn unlock(
        &mut self,
        passphrase: &[u8],
        opts: &UnlockOptions,
    ) -> Result<Unlocked<'_, 'a>, LuksError> {
        let (slot, volume_key) = self.header.unlock(self.io, passphrase, opts)?;
        Ok(Unlocked {
            keyslots: self,
            slot,
            volume_key,
        })
    }

    /// Replaces the passphrase `old` by `new`: the new keyslot is written before the old one
    /// is removed, so at every moment one of them opens the image. Returns the new slot.
    pub fn change_passphrase(
        &mut self,
        old: &[u8],
        new: &[u8],
        pbkdf: &PbkdfOptions,
        opts: &UnlockOptions,
    ) -> Result<usize, LuksError> {
        self.header
            .change_passphrase(self.io, old, new, pbkdf, opts)
    }
}

/// A header a passphrase opened: the keyslot it opened and the volume key (wiped on drop).
pub struct Unlocked<'k, 'a> {
    keyslots: &'k mut Keyslots<'a>,
    slot: usize,
    volume_key: SecretKey,
}

impl Unlocked<'_, '_> {
    /// The keyslot the passphrase opened.
    pub fn slot(&self) -> usize {
        self.slot
    }

    pub fn version(&self) -> LuksVersion {
        self.keyslots.version()
    }

    /// Adds a keyslot for `new_passphrase` (in `slot`, or the first free one) holding the
    /// volume key; returns its number.
    pub fn add_keyslot(
        self,
        new_passphrase: &[u8],
        slot: Option<usize>,
        pbkdf: &PbkdfOptions,
    ) -> Result<usize, LuksError> {
        let Keyslots { io, header } = self.keyslots;
        header.add_keyslot(*io, &self.volume_key, new_passphrase, slot, pbkdf)
    }

    /// Removes the keyslot the passphrase opened; returns its number. The header's only
    /// keyslot is removed only when `last` allows it.
    pub fn remove_keyslot(self, last: LastKeyslot) -> Result<usize, RemoveError> {
        let Keyslots { io, header } = self.keyslots;
        if header.active_keyslots().len() == 1 && last == LastKeyslot::Refuse {
            return Err(RemoveError::LastKeyslot { slot: self.slot });
        }
        header.remove_keyslot(*io, self.slot)?;
        Ok(self.slot)
    }
}
