//! An unlocked LUKS1/LUKS2 volume: the `CryptDevice` over its payload, with what its header
//! said and the keys that opened it (opened by `luks_open.rs`).

use crate::crypt::Placement;
use crate::{BackendOffset, CryptDevice, CryptLayout, IvSector, VolumeOffset};
use cryptblk_block::{BlockDevice, BlockError, Container, Extent, ExtentKind};
use cryptblk_crypto::{default_engine_for, CryptoError, CryptoPool, SecretKey};
use cryptblk_luks::{KnownKey, LuksError, LuksImage};
use std::path::PathBuf;
use std::sync::Arc;

/// Why a LUKS volume could not be opened. The header and unlock errors keep the `LuksError`
/// so that callers can tell a wrong passphrase from a damaged header.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VolumeError {
    // Not `transparent`: callers walking the error chain must find the `BlockError` itself
    // (its kind says e.g. "locked"), not only its underlying OS error.
    #[error("{0}")]
    Block(#[from] BlockError),
    #[error("{}: {source}", path.display())]
    Luks {
        path: PathBuf,
        #[source]
        source: LuksError,
    },
    #[error("{}: cannot open for writing: {reason}", path.display())]
    ReadOnlyHeader { path: PathBuf, reason: String },
    #[error("{}: cannot set up the {spec} cipher: {source}", path.display())]
    Cipher {
        path: PathBuf,
        spec: String,
        #[source]
        source: CryptoError,
    },
    #[error("{} is LUKS, and no passphrase or key was given", path.display())]
    NoKey { path: PathBuf },
}

impl VolumeError {
    /// True when the only problem is that no keyslot accepted the passphrase.
    pub fn is_wrong_passphrase(&self) -> bool {
        matches!(
            self,
            VolumeError::Luks {
                source: LuksError::WrongPassphrase,
                ..
            }
        )
    }
}

/// An unlocked LUKS volume: the decrypted payload plus what the header said about it.
pub struct LuksVolume {
    device: CryptDevice,
    container: Arc<dyn Container>,
    header: LuksImage,
    keyslot: Option<usize>,
    warnings: Vec<String>,
    /// Opened with its volume keys already known (`Unlocker::Keys`): no key derivation.
    without_kdf: bool,
    /// On locked pages, wiped on drop (`SecretKey`).
    known_keys: Vec<KnownKey>,
}

impl std::fmt::Debug for LuksVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LuksVolume")
            .field("container", &self.container.name())
            .field("device", &self.device)
            .field("header", &self.header)
            .field("keyslot", &self.keyslot)
            .finish_non_exhaustive()
    }
}

impl LuksVolume {
    /// Puts the decrypted view over `file` once the volume key is known, e.g. right after
    /// `LuksImage::format` returned it, without running the KDF again. Writable when `file` is.
    pub fn from_unlocked(
        file: Arc<dyn Container>,
        header: LuksImage,
        keyslot: usize,
        key: &SecretKey,
        pool: Arc<CryptoPool>,
    ) -> Result<LuksVolume, VolumeError> {
        Self::with_key(file, header, Some(keyslot), key, pool)
    }

    /// The volume over `file` with its volume key, opened by `keyslot` or known already.
    pub(crate) fn with_key(
        file: Arc<dyn Container>,
        header: LuksImage,
        keyslot: Option<usize>,
        key: &SecretKey,
        pool: Arc<CryptoPool>,
    ) -> Result<LuksVolume, VolumeError> {
        let path = file.name().to_path_buf();
        if !file.read_only() {
            if let Some(reason) = header.read_only_reason() {
                return Err(VolumeError::ReadOnlyHeader { path, reason });
            }
        }
        let luks_err = |source| VolumeError::Luks {
            path: path.clone(),
            source,
        };
        let spec = header.cipher_spec().map_err(luks_err)?;
        let payload_size = header.data_size(file.size()).map_err(luks_err)?;
        let cipher = default_engine_for(&spec)
            .and_then(|engine| engine.new_cipher(&spec, key, header.sector_size() as usize))
            .map_err(|source| VolumeError::Cipher {
                path: path.clone(),
                spec: spec.to_string(),
                source,
            })?;
        let cipher = crate::crypt::data_cipher(file.as_ref(), cipher);
        let layout = CryptLayout {
            data_offset: BackendOffset::new(header.data_offset()),
            payload_size,
            iv_offset: IvSector::new(0),
            read_only: file.read_only(),
        };
        let backend: Arc<dyn BlockDevice> = file.clone();
        let device =
            CryptDevice::new(backend, layout, cipher, pool).map_err(|e| e.with_path(&path))?;
        let known_keys = vec![KnownKey {
            key: SecretKey::from_slice(key.as_bytes()),
            digest: header.volume_key_fingerprint().map_err(luks_err)?,
        }];
        Ok(LuksVolume {
            device,
            container: file,
            header,
            keyslot,
            warnings: Vec::new(),
            without_kdf: false,
            known_keys,
        })
    }

    /// A volume from its parts (the header as read, the keyslot that opened it, its keys).
    pub(crate) fn assemble(
        device: CryptDevice,
        container: Arc<dyn Container>,
        header: LuksImage,
        keyslot: Option<usize>,
        known_keys: Vec<KnownKey>,
    ) -> LuksVolume {
        LuksVolume {
            device,
            container,
            header,
            keyslot,
            warnings: Vec::new(),
            without_kdf: false,
            known_keys,
        }
    }

    /// The same volume, with the findings from reading its header.
    pub(crate) fn with_warnings(mut self, warnings: Vec<String>) -> LuksVolume {
        self.warnings = warnings;
        self
    }

    pub fn device(&self) -> &CryptDevice {
        &self.device
    }

    pub fn into_device(self) -> CryptDevice {
        self.device
    }

    pub fn header(&self) -> &LuksImage {
        &self.header
    }

    /// The keyslot that accepted the passphrase (`None` when the volume was opened with
    /// its volume keys known).
    pub fn keyslot(&self) -> Option<usize> {
        self.keyslot
    }

    /// The volume keys it was opened with and their digests' fingerprints (two in the middle
    /// of a reencryption), so that a successor daemon can open it again without a KDF.
    pub fn known_keys(&self) -> &[KnownKey] {
        &self.known_keys
    }

    /// The same volume, opened with its volume keys already known.
    pub(crate) fn opened_without_kdf(mut self) -> LuksVolume {
        self.without_kdf = true;
        self
    }

    /// Whether it was opened with its volume keys already known (handed over, or cached),
    /// without running a KDF.
    pub fn without_kdf(&self) -> bool {
        self.without_kdf
    }

    /// Non-fatal findings from reading the header (e.g. a damaged secondary LUKS2 copy).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The container (image file or RBD image), for header maintenance while the volume is
    /// open and for copying its ciphertext in a migration.
    pub fn container(&self) -> &Arc<dyn Container> {
        &self.container
    }
}

/// Errors name the image: the crypto layer does not know it, and backend errors already do
/// (`with_path` keeps the innermost path).
impl BlockDevice for LuksVolume {
    fn size(&self) -> u64 {
        self.device.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.device.logical_block_size()
    }
    fn read_only(&self) -> bool {
        self.device.read_only()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.device
            .read_at(buf, offset)
            .map_err(|e| e.with_path(self.container.name()))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        self.device
            .write_at(buf, offset)
            .map_err(|e| e.with_path(self.container.name()))
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.device
            .flush()
            .map_err(|e| e.with_path(self.container.name()))
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.device
            .discard(offset, len)
            .map_err(|e| e.with_path(self.container.name()))
    }
    /// Data everywhere, except on a container whose never-written areas read as zeros through
    /// the volume too (RBD: `crypt/zero_holes.rs`): there the container's unallocated runs
    /// are plaintext zeros, so `convert` and NBD clients can skip them.
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        let data = self
            .device
            .block_status(offset, len)
            .map_err(|e| e.with_path(self.container.name()))?;
        if !self.container.unwritten_reads_as_zeros() || data.len == 0 {
            return Ok(data);
        }
        let stored = Placement::at(BackendOffset::new(self.header.data_offset()));
        let below = self
            .container
            .block_status(stored.backend(VolumeOffset::new(offset)).bytes(), data.len)
            .map_err(|e| e.with_path(self.container.name()))?;
        // Whole sectors only: a sector is zeros only if all of its ciphertext is.
        let sector = u64::from(self.header.sector_size());
        let whole = ((offset + below.len) / sector * sector).saturating_sub(offset);
        Ok(match below.kind {
            ExtentKind::Unallocated | ExtentKind::Zero if whole > 0 => Extent {
                len: whole,
                kind: ExtentKind::Unallocated,
            },
            _ => Extent {
                len: below.len.max(sector).min(data.len),
                kind: ExtentKind::Data,
            },
        })
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.device
            .write_zeroes(offset, len)
            .map_err(|e| e.with_path(self.container.name()))
    }
    fn pipeline(
        &self,
        opts: &cryptblk_block::aio::QueueOptions,
    ) -> Option<Result<cryptblk_block::aio::Pipeline, BlockError>> {
        self.device.pipeline(opts)
    }
}
