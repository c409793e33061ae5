//! Opening a disk's image as a [`Volume`]: probed, locked, and for LUKS unlocked with what the
//! daemon has (volume keys handed over or cached, the configured passphrase, clevis tokens).
use crate::error::{Context, Error, Result};
use crate::io_options;
use crate::key_cache::KeyCache;
use crate::key_file::{read_key_file, Passphrase};
use crate::secret::{decrypt_secret, MasterKey};
use cryptblk_block::{BlockDevice, Container, Format, OpenOptions, RawFile};
use cryptblk_control::api::{key_source, DiskConfig, KeySource};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::{KnownKey, LuksError, UnlockOptions, Unlocker};
use cryptblk_volume::{DirtyTracker, LuksVolume, OpenError, Unlock, Volume, VolumeKeys};
use std::sync::Arc;

/// The secret a disk is opened with.
pub enum Secret {
    /// A passphrase the caller has (asked on a terminal), else the disk's configured key
    /// source; then the header's clevis tokens.
    Passphrase(Option<Passphrase>),
    /// Volume keys a predecessor daemon handed over; the passphrase path when they no longer
    /// match the header.
    Keys(Vec<KnownKey>),
}

/// Puts a volume's keys in the key cache, if there is one (a failure is logged: the disk
/// serves on, only a restart after a crash will need the passphrase again).
pub(crate) fn remember(cache: Option<&KeyCache>, keys: &VolumeKeys) {
    if let Some(cache) = cache {
        if let Err(e) = cache.store(&keys.uuid, &keys.keys) {
            tracing::warn!(uuid = %keys.uuid, "not cached: {e}");
        }
    }
}

/// What opening needs besides the disk's configuration.
pub struct OpenContext<'a> {
    pub pool: &'a Arc<CryptoPool>,
    pub unlock: &'a UnlockOptions,
    /// Decrypts a configured `key-secret`.
    pub master_key: Option<&'a MasterKey>,
    /// Volume keys that outlive the process (`serve --key-cache`).
    pub key_cache: Option<&'a KeyCache>,
}

/// Opens (and for LUKS, unlocks) the image of `config` with an exclusive lock (a file's
/// `flock`, an RBD image's exclusive lock), through the volume's door ([`Volume::open`]). A
/// LUKS volume opens with the keys `secret` hands over or the key cache holds when they still
/// match its header (no key derivation), else with the passphrase `secret` has (asked on a
/// terminal) or the configured key source's; when there is none or it opens no keyslot, the
/// header's clevis tokens are tried (`token_unlock`).
///
/// `inherited` is the image file a predecessor daemon handed over, open and locked.
pub fn open_image(
    config: &DiskConfig,
    inherited: Option<std::fs::File>,
    secret: Secret,
    cx: &OpenContext<'_>,
) -> Result<Volume> {
    let name = config.image.path();
    let container = open_container(config, inherited)?;
    let unlock = DiskUnlock {
        config,
        secret,
        writable: !config.readonly,
        cx,
    };
    let image = Volume::open(container, unlock).map_err(|e| match e {
        OpenError::Probe { path, source } => {
            Error::caused(format!("probing {}", path.display()), source)
        }
        OpenError::KeyForRaw { .. } => Error::usage(format!(
            "a key file is given, but {} is raw, not LUKS",
            name.display()
        )),
        e => open_error(e),
    })?;
    remember_keys(&image, cx.key_cache);
    Ok(image)
}

/// How the daemon unlocks a disk's LUKS image: with known keys first (handed over, or the
/// key cache's), then a passphrase (given, configured, or a clevis token's).
struct DiskUnlock<'a> {
    config: &'a DiskConfig,
    secret: Secret,
    writable: bool,
    cx: &'a OpenContext<'a>,
}

impl Unlock for DiskUnlock<'_> {
    type Error = Error;

    /// Whether a passphrase is given or configured (a raw image takes none).
    fn has_key(&self) -> bool {
        has_key(self.config) || matches!(self.secret, Secret::Passphrase(Some(_)))
    }

    fn unlock(self, container: Arc<dyn Container>) -> Result<LuksVolume> {
        let volume = unlock_luks(self.config, container, self.secret, self.writable, self.cx)?;
        for warning in volume.warnings() {
            let image = self.config.image.path().display();
            tracing::warn!(disk = %self.config.name, image = %image, "{warning}");
        }
        Ok(volume)
    }
}

/// The errors of [`Volume::open`] that `open_image` and `open_received` report alike (each
/// names an unreadable start and a key for a raw image its own way).
fn open_error(e: OpenError<Error>) -> Error {
    match e {
        OpenError::Unlock(e) => e,
        OpenError::Tracking(e) => Error::caused("setting up dirty tracking", e),
        e => Error::caused("opening the image", e),
    }
}

/// Unlocks the LUKS volume on `container`: with known keys first (handed over, or the key
/// cache's), then a passphrase.
fn unlock_luks(
    config: &DiskConfig,
    container: Arc<dyn Container>,
    secret: Secret,
    writable: bool,
    cx: &OpenContext<'_>,
) -> Result<LuksVolume> {
    let opts = cryptblk_volume::VolumeOptions {
        writable,
        unlock: cx.unlock.clone(),
        pool: Some(cx.pool.clone()),
        ..Default::default()
    };
    let (known, source, given) = match secret {
        Secret::Keys(keys) => (Some(keys), "the predecessor daemon", None),
        Secret::Passphrase(given) => (cached_keys(&container, cx), "the key cache", given),
    };
    if let Some(keys) = known {
        match cryptblk_volume::open_luks_volume_with(
            container.clone(),
            Unlocker::Keys(&keys),
            &opts,
        ) {
            Ok(volume) => {
                tracing::info!(disk = %config.name, "opened with the volume key from {source} (no key derivation)");
                return Ok(volume);
            }
            Err(cryptblk_volume::VolumeError::Luks {
                source: LuksError::KnownKeyStale(_),
                ..
            }) => {
                tracing::warn!(disk = %config.name, "the volume key from {source} no longer matches the header (re-encrypted or re-formatted since); unlocking with the passphrase");
            }
            Err(e) => return Err(Error::caused("opening the LUKS volume", e)),
        }
    }
    let given = match given {
        Some(p) => Some(p),
        None => configured_passphrase(config, cx)?,
    };
    crate::token_unlock::open_luks(container, given, &opts)
}

/// The key cache's keys for the LUKS volume on `container`, if there is a cache and an entry.
fn cached_keys(container: &Arc<dyn Container>, cx: &OpenContext<'_>) -> Option<Vec<KnownKey>> {
    let cache = cx.key_cache?;
    let (header, _) = cryptblk_luks::LuksImage::read(container.header_io()).ok()?;
    cache.lookup(header.uuid())
}

/// The passphrase the disk's configuration names: its key file, or its `key-secret` decrypted
/// with the daemon's master key (a passed descriptor was read by the request already).
fn configured_passphrase(config: &DiskConfig, cx: &OpenContext<'_>) -> Result<Option<Passphrase>> {
    match key_source(config.key_params(), "key", false)
        .map_err(|e| Error::invalid_params(e.message))?
    {
        Some(KeySource::File(path)) => read_key_file(path).map(Some),
        Some(KeySource::Secret { ciphertext, iv }) => {
            decrypt_secret(cx.master_key, ciphertext, iv, "key").map(Some)
        }
        Some(KeySource::Fd(_)) | None => Ok(None),
    }
}

/// Whether the configuration names a passphrase (a raw image takes none).
fn has_key(config: &DiskConfig) -> bool {
    config.key_file.is_some() || config.key_secret.is_some()
}

fn unservable(name: &std::path::Path, format: Format) -> Error {
    Error::usage(format!(
        "{} is {}: serve exports LUKS and raw images (convert it first)",
        name.display(),
        format.name()
    ))
}

/// Opens what holds the image, locked. A file is probed first and opened only when it is
/// LUKS or raw (the volume's door tells those two apart); an RBD image holds one of them.
fn open_container(
    config: &DiskConfig,
    inherited: Option<std::fs::File>,
) -> Result<Arc<dyn Container>> {
    let writable = !config.readonly;
    if let Some(name) = config.image.rbd() {
        return Ok(Arc::new(crate::rbd::open(name, writable)?));
    }
    let path = config.image.path();
    let format = cryptblk_block::probe_format(path)
        .with_context(|| format!("probing {}", path.display()))?;
    if !matches!(format, Format::Luks | Format::Raw) {
        return Err(unservable(path, format));
    }
    let io = cryptblk_block::IoSettings {
        cache: io_options::cache_mode(config.cache),
        aio: io_options::aio_engine(config.aio),
    };
    let opts = OpenOptions {
        writable,
        lock: true,
    };
    let file = match inherited {
        Some(file) => RawFile::from_inherited(file, path, opts, io),
        None => RawFile::open_with(path, opts, io),
    }
    .context("opening the image")?;
    Ok(Arc::new(file))
}

/// A LUKS volume's keys go to the key cache, if there is one.
fn remember_keys(image: &Volume, key_cache: Option<&KeyCache>) {
    if let Some(keys) = image.volume_keys() {
        remember(key_cache, &keys);
    }
}

/// Opens an image a migration is bringing in, from the file the migration writes, through the
/// volume's door as `open_image` does: `gate` turns the opened disk into the one to serve
/// (reads of blocks not here yet fetch them).
pub fn open_received(
    config: &DiskConfig,
    passphrase: Option<Passphrase>,
    file: Arc<dyn Container>,
    cx: &OpenContext<'_>,
    gate: impl FnOnce(Arc<dyn BlockDevice>) -> Result<Arc<dyn BlockDevice>>,
) -> Result<Volume> {
    let unlock = DiskUnlock {
        config,
        secret: Secret::Passphrase(passphrase),
        writable: true,
        cx,
    };
    let mut image = Volume::open(file, unlock).map_err(|e| match e {
        OpenError::Probe { source, .. } => Error::caused("reading the received header", source),
        OpenError::KeyForRaw { .. } => {
            Error::usage("a key file is given, but the incoming image is raw")
        }
        OpenError::Unlock(e) => e.context("opening the received LUKS volume"),
        e => open_error(e),
    })?;
    remember_keys(&image, cx.key_cache);
    // Serve through the gate, and keep a tracker on top so the disk can migrate on later.
    let inner = image.tracker.inner().clone();
    let gated = gate(inner)?;
    let tracker = Arc::new(
        DirtyTracker::new(
            gated,
            image.tracker.payload_offset(),
            image.tracker.granularity(),
        )
        .context("setting up dirty tracking")?,
    );
    image.device = tracker.clone();
    image.tracker = tracker;
    Ok(image)
}
