//! The routes a generation of the segment map publishes: the volume's parts in order, each
//! with the storage that serves it (encrypted under a cipher, or plaintext, each at its own
//! place on the backend), and the range fenced off for rewriting. A stage routes each request
//! by its copy of them (`Routes::route`): one part, or the synchronous path.
use super::encrypted::CryptCore;
use super::plain::PlainCore;
use super::units::{Placement, VolumeOffset};
use cryptblk_block::BlockDevice;
use std::sync::Arc;

/// How one part of the volume is stored.
#[derive(Clone)]
pub(crate) enum Storage {
    Encrypted(Arc<CryptCore>),
    Plain(Arc<PlainCore>),
}

impl Storage {
    pub(crate) fn device(&self) -> &dyn BlockDevice {
        match self {
            Storage::Encrypted(core) => core.as_ref(),
            Storage::Plain(plain) => plain.as_ref(),
        }
    }

    /// Where the part's volume offsets are stored on the backend.
    pub(crate) fn placement(&self) -> Placement {
        match self {
            Storage::Encrypted(core) => core.layout.placement(),
            Storage::Plain(plain) => plain.place,
        }
    }

    /// What the part's sizes must be whole multiples of: its encryption sector, or a byte.
    pub(crate) fn sector(&self) -> u64 {
        match self {
            Storage::Encrypted(core) => core.sector(),
            Storage::Plain(_) => 1,
        }
    }

    pub(crate) fn backend(&self) -> &Arc<dyn BlockDevice> {
        match self {
            Storage::Encrypted(core) => &core.backend,
            Storage::Plain(plain) => &plain.backend,
        }
    }
}

/// One part of the volume: from `start` to the next part's start (the last: to the end).
#[derive(Clone)]
pub(crate) struct Part {
    pub start: VolumeOffset,
    pub storage: Storage,
}

/// What a generation routes by.
#[derive(Clone)]
pub(crate) struct Routes {
    /// In order of `start`, the first at 0. A part may be empty (its start equals the next
    /// one's): it serves nothing.
    pub parts: Arc<[Part]>,
    /// `[fence.0, fence.1)` is being rewritten: requests touching it take the synchronous
    /// path. Empty when `fence.0 >= fence.1`.
    pub fence: (VolumeOffset, VolumeOffset),
}

/// No range fenced off.
pub(super) const NO_FENCE: (VolumeOffset, VolumeOffset) =
    (VolumeOffset::new(0), VolumeOffset::new(0));

impl Routes {
    pub(super) fn single(storage: Storage) -> Routes {
        Routes {
            parts: Arc::from([Part {
                start: VolumeOffset::new(0),
                storage,
            }]),
            fence: NO_FENCE,
        }
    }

    /// The index of the part holding all of `len` bytes at `offset`, unless they touch the
    /// fence or cross into the next part.
    #[inline]
    pub(crate) fn route(&self, offset: VolumeOffset, len: u64) -> Option<usize> {
        let end = offset.saturating_add(len);
        if offset < self.fence.1 && end > self.fence.0 {
            return None;
        }
        // A disk nothing is changing: one part.
        if self.parts.len() == 1 {
            return Some(0);
        }
        let i = self
            .parts
            .partition_point(|p| p.start <= offset)
            .checked_sub(1)?;
        match self.parts.get(i + 1) {
            Some(next) if end > next.start => None,
            _ => Some(i),
        }
    }

    /// Whether every part is encrypted at one data offset (what the `threads` engine's
    /// offloaded crypto can serve: it knows a request only by its backend offset).
    pub(crate) fn uniformly_encrypted(&self) -> Option<&Arc<CryptCore>> {
        let Storage::Encrypted(first) = &self.parts.first()?.storage else {
            return None;
        };
        self.parts
            .iter()
            .all(|p| {
                matches!(&p.storage, Storage::Encrypted(c) if c.layout.data_offset == first.layout.data_offset)
            })
            .then_some(first)
    }

    /// The end of part `i` in a volume of `size` bytes.
    pub(super) fn end_of(&self, i: usize, size: u64) -> VolumeOffset {
        self.parts
            .get(i + 1)
            .map_or(VolumeOffset::new(size), |next| next.start)
    }

    /// The parts of a key-to-key reencryption with `done` bytes rewritten: the new cipher
    /// below, the old one above.
    pub(super) fn forward(
        new: &Arc<CryptCore>,
        old: &Arc<CryptCore>,
        done: VolumeOffset,
    ) -> Routes {
        Routes {
            parts: Arc::from([
                Part {
                    start: VolumeOffset::new(0),
                    storage: Storage::Encrypted(new.clone()),
                },
                Part {
                    start: done,
                    storage: Storage::Encrypted(old.clone()),
                },
            ]),
            fence: NO_FENCE,
        }
    }
}
