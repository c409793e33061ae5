//! The segment map following a LUKS2 header's live segments. A reencryption that moves data
//! (an encryption in place: plaintext below the boundary, part of it moved to the image's
//! end, ciphertext above it one data shift higher) has parts at different data offsets, and
//! plaintext ones; after each of its commits the queues route by exactly what the header
//! says, so that what a restart reads back is what was served.
use super::encrypted::CryptCore;
use super::plain::PlainCore;
use super::routes::{Part, Storage};
use super::segments::SegmentMap;
use super::units::{BackendOffset, IvNumbering, Placement, VolumeOffset};
use cryptblk_block::BlockError;
use cryptblk_crypto::{CryptoPool, SectorCipher};
use cryptblk_luks::luks2::reencrypt::{ExtentCipher, KeyRole, SegmentExtent};
use std::sync::{Arc, RwLockWriteGuard};

/// The ciphers of a reencryption's live segments, by role (`None` for a plaintext side), as
/// the data path uses them (see `data_cipher`), and the crypto workers they run on.
#[derive(Clone)]
pub struct SegmentCiphers {
    pub old: Option<Arc<dyn SectorCipher>>,
    pub new: Option<Arc<dyn SectorCipher>>,
    pub pool: Arc<CryptoPool>,
}

fn layout_error(extent: &SegmentExtent, why: &str) -> BlockError {
    BlockError::unsupported(format!(
        "serving LUKS2 segment {} ({} bytes at volume offset {}): {why}",
        extent.id, extent.len, extent.logical_start
    ))
}

impl SegmentMap {
    /// Serves the live segments `extents` (a reencryption's, from `Reencryption::extents`)
    /// from now on; `rewrite` is the hotzone lock, so no synchronous request runs meanwhile.
    /// `reencrypting` is false once the header holds a single segment again. A part the map
    /// serves already (the same storage at the same place) is kept, with its buffers.
    pub fn follow(
        &self,
        rewrite: &RwLockWriteGuard<'_, ()>,
        extents: &[SegmentExtent],
        ciphers: &SegmentCiphers,
        reencrypting: bool,
    ) -> Result<(), BlockError> {
        let current = self.routes();
        let backend = current.parts[0].storage.backend().clone();
        let read_only = cryptblk_block::BlockDevice::read_only(self);
        let mut parts = Vec::with_capacity(extents.len());
        for extent in extents {
            if extent.in_reencryption {
                return Err(layout_error(
                    extent,
                    "a hotzone a crash interrupted must be recovered first",
                ));
            }
            let start = VolumeOffset::new(extent.logical_start);
            let place = Placement::of_segment(start, BackendOffset::new(extent.device_offset))
                .ok_or_else(|| layout_error(extent, "it lies below its volume offset"))?;
            let storage = match &extent.cipher {
                ExtentCipher::Plain => {
                    let reuse = current.parts.iter().find_map(|p| match &p.storage {
                        Storage::Plain(plain) if plain.place == place => Some(p.storage.clone()),
                        _ => None,
                    });
                    reuse.unwrap_or_else(|| {
                        Storage::Plain(Arc::new(PlainCore {
                            backend: backend.clone(),
                            place,
                            size: self.size_cell().clone(),
                            read_only,
                        }))
                    })
                }
                ExtentCipher::Crypt {
                    role,
                    sector_size,
                    iv_tweak,
                    ..
                } => {
                    let cipher = match role {
                        KeyRole::Old => ciphers.old.as_ref(),
                        KeyRole::New => ciphers.new.as_ref(),
                    }
                    .ok_or_else(|| layout_error(extent, "its volume key is not unlocked"))?;
                    let sector = u64::from(*sector_size);
                    if cipher.sector_size() as u64 != sector {
                        return Err(layout_error(extent, "its sector size is not its cipher's"));
                    }
                    let ivs = IvNumbering::of_luks2_segment(*iv_tweak, start, sector);
                    let reuse = current.parts.iter().find_map(|p| match &p.storage {
                        Storage::Encrypted(core)
                            if core.layout.placement() == place
                                && core.ivs == ivs
                                && Arc::ptr_eq(&core.cipher, cipher) =>
                        {
                            Some(p.storage.clone())
                        }
                        _ => None,
                    });
                    match reuse {
                        Some(storage) => storage,
                        None => Storage::Encrypted(CryptCore::part(
                            backend.clone(),
                            cipher.clone(),
                            ciphers.pool.clone(),
                            place,
                            ivs,
                            self.size_cell().clone(),
                            read_only,
                        )?),
                    }
                }
            };
            parts.push(Part { start, storage });
        }
        // Progress: the bytes under the new key (for an encryption, all of its ciphertext).
        let done = extents
            .iter()
            .filter(|e| {
                matches!(
                    e.cipher,
                    ExtentCipher::Crypt {
                        role: KeyRole::New,
                        ..
                    }
                )
            })
            .map(|e| e.len)
            .sum();
        self.install(rewrite, parts, reencrypting, done)
    }
}
