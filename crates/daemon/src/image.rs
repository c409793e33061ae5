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
use cryptblk_volume::{DirtyTracker, LuksVolume, Volume, VolumeKeys};
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
/// `flock`, an RBD image's exclusive lock). A LUKS volume opens with the keys `secret` hands
/// over or the key cache holds when they still match its header (no key derivation), else
/// with the passphrase `secret` has (asked on a terminal) or the configured key source's;
/// when there is none or it opens no keyslot, the header's clevis tokens are tried
/// (`token_unlock`).
///
/// `inherited` is the image file a predecessor daemon handed over, open and locked.
pub fn open_image(
    config: &DiskConfig,
    inherited: Option<std::fs::File>,
    secret: Secret,
    cx: &OpenContext<'_>,
) -> Result<Volume> {
    let name = config.image.path();
    let (container, format) = open_container(config, inherited)?;
    match format {
        Format::Luks => {
            let (volume, without_kdf) =
                unlock_luks(config, container, secret, !config.readonly, cx)?;
            for warning in volume.warnings() {
                tracing::warn!(disk = %config.name, image = %name.display(), "{warning}");
            }
            let mut image = luks_image(volume, cx.key_cache)?;
            image.without_kdf = without_kdf;
            Ok(image)
        }
        Format::Raw => {
            if has_key(config) || matches!(secret, Secret::Passphrase(Some(_))) {
                return Err(Error::usage(format!(
                    "a key file is given, but {} is raw, not LUKS",
                    name.display()
                )));
            }
            Volume::from_raw(container).context("setting up dirty tracking")
        }
        other => Err(unservable(name, other)),
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
) -> Result<(cryptblk_volume::LuksVolume, bool)> {
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
                return Ok((volume, true));
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
    crate::token_unlock::open_luks(container, given, &opts).map(|volume| (volume, false))
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

/// Opens what holds the image, locked, and says what format it is in. A file is probed (and
/// opened only when it is LUKS or raw); an RBD image is LUKS when it starts with the LUKS
/// magic (as `rbd encryption format` and QEMU's `encrypt.format=` write it), else raw.
fn open_container(
    config: &DiskConfig,
    inherited: Option<std::fs::File>,
) -> Result<(Arc<dyn Container>, Format)> {
    let writable = !config.readonly;
    if let Some(name) = config.image.rbd() {
        let device = crate::rbd::open(name, writable)?;
        let format = if crate::rbd::starts_with_luks_magic(&device)? {
            Format::Luks
        } else {
            Format::Raw
        };
        return Ok((Arc::new(device), format));
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
    Ok((Arc::new(file), format))
}

/// The volume of an unlocked LUKS image; its keys go to the key cache, if there is one.
fn luks_image(volume: LuksVolume, key_cache: Option<&KeyCache>) -> Result<Volume> {
    let image = Volume::from_luks(volume).context("setting up dirty tracking")?;
    if let Some(keys) = image.volume_keys() {
        remember(key_cache, &keys);
    }
    Ok(image)
}

/// Opens an image a migration is bringing in, from the file the migration writes: `gate`
/// turns the opened disk into the one to serve (reads of blocks not here yet fetch them).
pub fn open_received(
    config: &DiskConfig,
    passphrase: Option<Passphrase>,
    file: Arc<dyn Container>,
    cx: &OpenContext<'_>,
    gate: impl FnOnce(Arc<dyn BlockDevice>) -> Result<Arc<dyn BlockDevice>>,
) -> Result<Volume> {
    let mut magic = [0u8; 6];
    file.read_at(&mut magic, 0)
        .context("reading the received header")?;
    let mut image = if magic == *b"LUKS\xba\xbe" {
        let (volume, _) = unlock_luks(config, file, Secret::Passphrase(passphrase), true, cx)
            .map_err(|e| e.context("opening the received LUKS volume"))?;
        luks_image(volume, cx.key_cache)?
    } else {
        if has_key(config) || passphrase.is_some() {
            return Err(Error::usage(
                "a key file is given, but the incoming image is raw",
            ));
        }
        Volume::from_raw(file).context("setting up dirty tracking")?
    };
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
