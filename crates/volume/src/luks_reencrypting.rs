//! Opening a LUKS2 image that is in the middle of a reencryption (`online-reencrypt-v2`): the
//! volume keys are unlocked with the passphrase (or were known already) and checked against the reencryption digest,
//! a hotzone a crash interrupted is recovered (as cryptsetup does on its next run), and the
//! volume serves the new segment below the boundary and the old one above it; or, for an
//! encryption in place, the live segments as the header lists them (plaintext below the
//! boundary, the first part of it at the image's end, ciphertext above it). The reencryption
//! itself continues when asked (`cryptblk ctl reencrypt-start`, or offline).
use crate::crypt::{data_cipher, SegmentCiphers};
use crate::luks_volume::{LuksVolume, VolumeError};
use crate::{BackendOffset, CryptDevice, CryptLayout, IvSector};
use cryptblk_block::{BlockDevice, BlockError, Container};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::luks2::reencrypt::{
    ExtentCipher, KeyRole, ReencryptMode, Reencryption, Resilience,
};
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{KnownKey, LuksError, LuksImage, UnlockOptions, Unlocker};
use std::sync::Arc;

pub(crate) fn open(
    file: Arc<dyn Container>,
    header: Luks2Header,
    unlocker: Unlocker<'_>,
    unlock: &UnlockOptions,
    pool: Arc<CryptoPool>,
) -> Result<LuksVolume, VolumeError> {
    let path = file.name().to_path_buf();
    let luks_err = |source| VolumeError::Luks {
        path: path.clone(),
        source,
    };
    let mut r = Reencryption::open_with(
        file.header_io(),
        header,
        unlocker,
        unlock,
        None,
        pool.clone(),
    )
    .map_err(luks_err)?;
    r.ensure_servable().map_err(luks_err)?;
    if r.state().mode == ReencryptMode::Encrypt {
        // Served, the disk keeps the size its guest sees, also through the recovery below
        // (which may commit the last hotzone's segment).
        r.keep_volume_size().map_err(luks_err)?;
    }
    if r.is_interrupted() {
        if file.read_only() {
            return Err(luks_err(LuksError::InvalidArgument(
                "a reencryption was interrupted inside a hotzone: serve the image writable once (it is recovered on opening), or finish it with `cryptblk reencrypt --resume-only`".into(),
            )));
        }
        r.recover().map_err(luks_err)?;
        tracing::warn!(image = %path.display(), "recovered the hotzone a crash interrupted during the reencryption");
    }
    let known_keys = r.known_keys().map_err(luks_err)?;
    if r.state().mode == ReencryptMode::Encrypt {
        return open_encrypting(file.clone(), r, pool, known_keys);
    }
    let segments = r.online_segments().map_err(luks_err)?;
    let keyslot = r.opened_keyslot();
    let header = r.into_header();
    let layout = CryptLayout {
        data_offset: BackendOffset::new(segments.data_offset),
        payload_size: segments.size,
        iv_offset: IvSector::new(0),
        read_only: file.read_only(),
    };
    let backend: Arc<dyn BlockDevice> = file.clone();
    let device = CryptDevice::new(
        backend,
        layout,
        data_cipher(file.as_ref(), segments.old),
        pool,
    )
    .map_err(|e| e.with_path(&path))?;
    device
        .segments()
        .split(data_cipher(file.as_ref(), segments.new), segments.done)
        .map_err(|e| e.with_path(&path))?;
    tracing::info!(image = %path.display(), done = segments.done, size = segments.size, "serving a volume in mid-reencryption");
    Ok(LuksVolume::assemble(
        device,
        file,
        LuksImage::V2(header),
        keyslot,
        known_keys,
    ))
}

/// A plaintext image in mid-encryption (cryptblk's layout: backward, with a data shift): the
/// volume keeps the size the plaintext had, and serves the header's live segments.
fn open_encrypting(
    file: Arc<dyn Container>,
    r: Reencryption<'_>,
    pool: Arc<CryptoPool>,
    known_keys: Vec<KnownKey>,
) -> Result<LuksVolume, VolumeError> {
    let path = file.name().to_path_buf();
    let luks_err = |source| VolumeError::Luks {
        path: path.clone(),
        source,
    };
    let size = r.device_size().map_err(luks_err)?;
    let extents = r.extents().map_err(luks_err)?;
    let new = r.cipher_of(KeyRole::New).ok_or_else(|| {
        VolumeError::Block(BlockError::unsupported(
            "an encryption whose new volume key is not unlocked",
        ))
    })?;
    let new = data_cipher(file.as_ref(), new);
    // Where the ciphertext lies: behind the header, one data shift up.
    let data_offset = extents
        .iter()
        .find(|e| matches!(e.cipher, ExtentCipher::Crypt { .. }))
        .map(|e| e.device_offset - e.logical_start)
        .or(match r.state().resilience {
            Resilience::Datashift { shift } => Some(shift),
            _ => None,
        })
        .unwrap_or_default();
    let layout = CryptLayout {
        data_offset: BackendOffset::new(data_offset),
        payload_size: size,
        iv_offset: IvSector::new(0),
        read_only: file.read_only(),
    };
    let backend: Arc<dyn BlockDevice> = file.clone();
    let device = CryptDevice::new(backend, layout, new.clone(), pool.clone())
        .map_err(|e| e.with_path(&path))?;
    let ciphers = SegmentCiphers {
        old: None,
        new: Some(new),
        pool,
    };
    {
        let map = device.segments();
        let rewrite = map.hotzone_write();
        map.follow(&rewrite, &extents, &ciphers, true)
            .map_err(|e| e.with_path(&path))?;
    }
    let done = r.done_bytes().map_err(luks_err)?;
    tracing::info!(image = %path.display(), encrypted = done, size, "serving a plaintext image in mid-encryption");
    let r_keyslot = r.opened_keyslot();
    let header = r.into_header();
    Ok(LuksVolume::assemble(
        device,
        file,
        cryptblk_luks::LuksImage::V2(header),
        r_keyslot,
        known_keys,
    ))
}
