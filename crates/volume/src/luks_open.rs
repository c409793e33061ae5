//! The one door to a LUKS1/LUKS2 image: lock the file, read and validate the header, and open
//! the volume as the header says: unlocked by a keyslot (`LuksVolume`), or, in the middle of
//! a reencryption, as its segments lie (`luks_reencrypting`).

use crate::luks_volume::{LuksVolume, VolumeError};
use cryptblk_block::{Container, IoSettings, OpenOptions, RawFile};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::{LuksImage, UnlockOptions, Unlocker};
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// How to open a LUKS volume.
#[derive(Clone, Default)]
pub struct VolumeOptions {
    pub writable: bool,
    pub unlock: UnlockOptions,
    /// Crypto workers to use; `None` shares one process-wide pool sized to the machine.
    pub pool: Option<Arc<CryptoPool>>,
    /// Cache mode and aio engine of the image file.
    pub io: IoSettings,
}

impl std::fmt::Debug for VolumeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumeOptions")
            .field("writable", &self.writable)
            .field("unlock", &self.unlock)
            .field("pool_threads", &self.pool.as_ref().map(|p| p.threads()))
            .field("io", &self.io)
            .finish()
    }
}

fn shared_pool() -> Arc<CryptoPool> {
    static POOL: OnceLock<Arc<CryptoPool>> = OnceLock::new();
    Arc::clone(POOL.get_or_init(|| Arc::new(CryptoPool::with_default_threads())))
}

/// Opens the LUKS image at `path` (locked: exclusively when writable, shared otherwise) and
/// unlocks it with `passphrase`.
pub fn open_luks_volume(
    path: impl AsRef<Path>,
    passphrase: &[u8],
    opts: &VolumeOptions,
) -> Result<LuksVolume, VolumeError> {
    let file = Arc::new(RawFile::open_with(
        path,
        OpenOptions {
            writable: opts.writable,
            lock: true,
        },
        opts.io,
    )?);
    open_luks_volume_on(file, passphrase, opts)
}

/// Unlocks the LUKS image in an already open container (e.g. a file a migration is writing
/// into, or an RBD image). The volume is writable when the container is; `opts.writable` only
/// adds the check that the header allows writing. `opts.io` is the container's business.
pub fn open_luks_volume_on(
    file: Arc<dyn Container>,
    passphrase: &[u8],
    opts: &VolumeOptions,
) -> Result<LuksVolume, VolumeError> {
    open_luks_volume_with(file, Unlocker::Passphrase(passphrase), opts)
}

/// As `open_luks_volume_on`, with a passphrase or with volume keys already known
/// (`Unlocker::Keys`: a restarted daemon's, opened without a KDF).
pub fn open_luks_volume_with(
    file: Arc<dyn Container>,
    unlocker: Unlocker<'_>,
    opts: &VolumeOptions,
) -> Result<LuksVolume, VolumeError> {
    let path = file.name().to_path_buf();
    let path = path.as_path();
    let luks_err = |source| VolumeError::Luks {
        path: path.to_path_buf(),
        source,
    };
    let (header, warnings) = LuksImage::read(file.header_io()).map_err(luks_err)?;
    for w in &warnings {
        tracing::warn!(image = %path.display(), "{w}");
    }
    let pool = opts.pool.clone().unwrap_or_else(shared_pool);
    let without_kdf = matches!(unlocker, Unlocker::Keys(_));
    let opened = |volume: LuksVolume, warnings| {
        let volume = volume.with_warnings(warnings);
        match without_kdf {
            true => volume.opened_without_kdf(),
            false => volume,
        }
    };
    if let LuksImage::V2(h) = &header {
        if h.reencrypt_state().map_err(luks_err)?.is_some() {
            let volume =
                crate::luks_reencrypting::open(file, h.clone(), unlocker, &opts.unlock, pool)?;
            return Ok(opened(volume, warnings));
        }
    }
    if opts.writable {
        if let Some(reason) = header.read_only_reason() {
            return Err(VolumeError::ReadOnlyHeader {
                path: path.to_path_buf(),
                reason,
            });
        }
    }
    // Refuse a truncated image before spending seconds in the KDF.
    header.data_size(file.size()).map_err(luks_err)?;
    let (keyslot, key) = header
        .unlock_with(file.header_io(), unlocker, &opts.unlock)
        .map_err(luks_err)?;
    let volume = LuksVolume::with_key(file, header, keyslot, &key, pool)?;
    Ok(opened(volume, warnings))
}
