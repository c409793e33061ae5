//! Telling the export what the pull has stored: once a stretch of the export is durable in the
//! chain, a TRIM on an export that takes releases (cryptblk's backup export: read-only and
//! offering TRIM) lets it stop keeping that stretch. The backup then copies nothing more
//! there when the VM writes it, and its copies leave the scratch, so a full backup of a
//! disk written all over needs a scratch only for what is still ahead of the pull.
//!
//! Releases go over a second connection of their own (the first one belongs to the reader
//! thread), opened only to an export that takes them. A release that fails costs the export
//! some scratch, never the pull: it is noted, and no more are sent.
use cryptblk_nbd_client::{Client, NbdUri};

/// cryptblk's export releases whole 1 MiB granules (`cryptblk_volume::RELEASE_GRANULE`):
/// each release starts at one, so the granule the last one ended in is released too.
const GRANULE: u64 = 1 << 20;

pub(crate) struct Releaser {
    client: Option<Client>,
    /// The export's bytes below this were released (a granule's start).
    released: u64,
}

impl Releaser {
    /// A second connection to the export when `wanted` and the export (as `first`, a
    /// connection to it, found it) takes releases; otherwise one that releases nothing.
    pub(crate) fn connect(
        uri: &NbdUri,
        first: &Client,
        wanted: bool,
        note: &mut impl FnMut(&str),
    ) -> Releaser {
        let client = if wanted && first.can_release() {
            match Client::connect(uri, &[]) {
                Ok(client) => Some(client),
                Err(e) => {
                    note(&format!(
                        "not releasing what this pull stores (a second connection failed: {e}); the export keeps it until the backup ends"
                    ));
                    None
                }
            }
        } else {
            None
        };
        Releaser {
            client,
            released: 0,
        }
    }

    /// Everything below `durable` is in the chain for good: release what was not yet.
    pub(crate) fn release_below(&mut self, durable: u64, note: &mut impl FnMut(&str)) {
        let Some(client) = &mut self.client else {
            return;
        };
        if durable <= self.released {
            return;
        }
        match client.release(self.released, durable - self.released) {
            Ok(()) => self.released = durable - durable % GRANULE,
            Err(e) => {
                note(&format!(
                    "the export refused to release bytes {}..{durable} ({e}); not releasing any more, the export keeps them until the backup ends",
                    self.released
                ));
                self.client = None;
            }
        }
    }

    /// Says goodbye on the second connection.
    pub(crate) fn disconnect(self) {
        if let Some(client) = self.client {
            client.disconnect();
        }
    }
}
