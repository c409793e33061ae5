//! Opening a disk's image: probed, locked, and for LUKS unlocked, behind the dirty tracker a
//! migration uses.
use crate::error::{Context, Error, Result};
use crate::io_options;
use crate::key_cache::KeyCache;
use crate::key_file::{read_key_file, Passphrase};
use crate::secret::{decrypt_secret, MasterKey};
use cryptblk_block::{BlockDevice, Container, Format, OpenOptions, RawFile};
use cryptblk_control::api::{key_source, DiskConfig, KeySource};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::{KnownKey, LuksError, UnlockOptions, Unlocker};
use cryptblk_migration::DirtyTracker;
use cryptblk_volume::{CryptDevice, SegmentMap};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// Dirty tracking granularity of a raw image (a LUKS image tracks its encryption sectors).
const RAW_TRACKING_GRANULARITY: u64 = 4096;

/// An opened image.
pub struct OpenedImage {
    /// What the exports serve: the disk behind its dirty tracker (idle until a migration).
    pub device: Arc<dyn BlockDevice>,
    pub tracker: Arc<DirtyTracker>,
    /// The image (file or RBD image) under the encryption, which a migration copies and
    /// whose header keyslot changes and reencryptions update.
    pub file: Arc<dyn Container>,
    /// The LUKS UUID or the image file name.
    pub serial: String,
    /// The volume under the tracker: a LUKS image's decrypted payload, or a raw image as one
    /// plaintext part, which an online encryption turns into a LUKS2 volume while it serves.
    pub volume: CryptDevice,
    /// What the LUKS header says of the image; a raw image gets it when an online encryption
    /// writes its header.
    luks: RwLock<Option<LuksFacts>>,
    /// The volume keys serving it, for a successor daemon or the key cache (`VolumeKeys`).
    keys: Mutex<Option<VolumeKeys>>,
    /// Opened with volume keys already known (handed over, or cached): no key derivation.
    pub without_kdf: bool,
}

/// A LUKS volume's keys as a restarted daemon needs them: its UUID (the key cache's name for
/// it) and each key with its digest's fingerprint.
pub struct VolumeKeys {
    pub uuid: String,
    pub keys: Vec<KnownKey>,
}

impl VolumeKeys {
    pub fn duplicate(&self) -> VolumeKeys {
        VolumeKeys {
            uuid: self.uuid.clone(),
            keys: self.keys.iter().map(KnownKey::duplicate).collect(),
        }
    }
}

/// The secret a disk is opened with.
pub enum Secret {
    /// A passphrase the caller has (asked on a terminal), else the disk's configured key
    /// source; then the header's clevis tokens.
    Passphrase(Option<Passphrase>),
    /// Volume keys a predecessor daemon handed over; the passphrase path when they no longer
    /// match the header.
    Keys(Vec<KnownKey>),
}

/// What the metrics and `disk-list` show of a LUKS image (never its key).
#[derive(Debug, Clone)]
pub struct LuksFacts {
    /// The sector-crypto engine serving it.
    pub engine: &'static str,
    /// The cipher as LUKS2 names it (`aes-xts-plain64`) and its key size in bits.
    pub cipher: String,
    pub key_bits: usize,
}

impl LuksFacts {
    /// The facts of a volume encrypted with `spec` on `engine`.
    pub fn new(spec: &cryptblk_crypto::CipherSpec, engine: &'static str) -> LuksFacts {
        LuksFacts {
            engine,
            cipher: spec.to_luks2_string(),
            key_bits: spec.key_bytes() * 8,
        }
    }
}

impl OpenedImage {
    pub fn format(&self) -> Format {
        match self.luks() {
            Some(_) => Format::Luks,
            None => Format::Raw,
        }
    }

    /// The LUKS facts, `None` for a raw image.
    pub fn luks(&self) -> Option<LuksFacts> {
        self.luks
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The image has become LUKS2 (an online encryption wrote its header).
    pub(crate) fn set_luks(&self, facts: LuksFacts) {
        *self.luks.write().unwrap_or_else(PoisonError::into_inner) = Some(facts);
    }

    /// Which storage serves which part of the volume (several during a reencryption).
    pub fn segments(&self) -> &Arc<SegmentMap> {
        self.volume.segments()
    }

    /// A copy of the volume keys serving the disk (`None` for a raw one).
    pub(crate) fn volume_keys(&self) -> Option<VolumeKeys> {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(VolumeKeys::duplicate)
    }

    /// The volume keys changed (a reencryption started or finished, an encryption began), or
    /// became known; the key cache follows when there is one.
    pub(crate) fn set_volume_keys(&self, keys: VolumeKeys, cache: Option<&KeyCache>) {
        remember(cache, &keys);
        *self.keys.lock().unwrap_or_else(PoisonError::into_inner) = Some(keys);
    }
}

/// Puts a volume's keys in the key cache, if there is one (a failure is logged: the disk
/// serves on, only a restart after a crash will need the passphrase again).
fn remember(cache: Option<&KeyCache>, keys: &VolumeKeys) {
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
) -> Result<OpenedImage> {
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
            raw_image(container)
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

fn luks_image(
    volume: cryptblk_volume::LuksVolume,
    key_cache: Option<&KeyCache>,
) -> Result<OpenedImage> {
    let serial = volume.header().uuid().to_string();
    let keys = VolumeKeys {
        uuid: serial.clone(),
        keys: volume
            .known_keys()
            .iter()
            .map(KnownKey::duplicate)
            .collect(),
    };
    remember(key_cache, &keys);
    let engine = volume
        .device()
        .cipher()
        .map_or("none", |cipher| cipher.engine_name());
    let facts = volume
        .header()
        .cipher_spec()
        .map(|spec| LuksFacts::new(&spec, engine))
        .unwrap_or(LuksFacts {
            engine,
            cipher: String::new(),
            key_bits: 0,
        });
    let file = volume.container().clone();
    let crypt = volume.device().clone();
    let payload_offset = volume.header().data_offset();
    let granularity = u64::from(volume.header().sector_size());
    let volume = Arc::new(volume);
    let tracker = Arc::new(
        DirtyTracker::new(volume.clone(), payload_offset, granularity)
            .context("setting up dirty tracking")?,
    );
    Ok(OpenedImage {
        device: tracker.clone(),
        tracker,
        file,
        serial,
        volume: crypt,
        luks: RwLock::new(Some(facts)),
        keys: Mutex::new(Some(keys)),
        without_kdf: false,
    })
}

/// A raw image is served as one plaintext part of a volume (not the file directly), so that
/// an online encryption can turn it into LUKS2 while it serves; its queues pay one plain load
/// per request for that (`cryptblk_volume::SegmentMap`).
fn raw_image(raw: Arc<dyn Container>) -> Result<OpenedImage> {
    let serial = raw
        .name()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let read_only = raw.read_only();
    let backend: Arc<dyn BlockDevice> = raw.clone();
    let volume = CryptDevice::plaintext(backend, read_only);
    let tracker = Arc::new(
        DirtyTracker::new(Arc::new(volume.clone()), 0, RAW_TRACKING_GRANULARITY)
            .context("setting up dirty tracking")?,
    );
    Ok(OpenedImage {
        device: tracker.clone(),
        tracker,
        file: raw,
        serial,
        volume,
        luks: RwLock::new(None),
        keys: Mutex::new(None),
        without_kdf: false,
    })
}

/// Opens an image a migration is bringing in, from the file the migration writes: `gate`
/// turns the opened disk into the one to serve (reads of blocks not here yet fetch them).
pub fn open_received(
    config: &DiskConfig,
    passphrase: Option<Passphrase>,
    file: Arc<dyn Container>,
    cx: &OpenContext<'_>,
    gate: impl FnOnce(Arc<dyn BlockDevice>) -> Result<Arc<dyn BlockDevice>>,
) -> Result<OpenedImage> {
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
        raw_image(file)?
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
