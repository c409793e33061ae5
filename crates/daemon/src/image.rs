//! Opening a disk's image: probed, locked, and for LUKS unlocked, behind the dirty tracker a
//! migration uses.
use crate::error::{Context, Error, Result};
use crate::key_file::{read_key_file, Passphrase};
use crate::secret::{decrypt_secret, MasterKey};
use cryptblk_block::{
    BlockDevice, Container, CryptDevice, Format, OpenOptions, RawFile, SegmentMap,
};
use cryptblk_control::api::{key_source, DiskConfig, KeySource};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::UnlockOptions;
use cryptblk_migration::DirtyTracker;
use std::sync::{Arc, PoisonError, RwLock};

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
}

/// What opening needs besides the disk's configuration.
pub struct OpenContext<'a> {
    pub pool: &'a Arc<CryptoPool>,
    pub unlock: &'a UnlockOptions,
    /// Decrypts a configured `key-secret`.
    pub master_key: Option<&'a MasterKey>,
}

/// Opens (and for LUKS, unlocks) the image of `config` with an exclusive lock (a file's
/// `flock`, an RBD image's exclusive lock). The passphrase is `passphrase` when the caller has
/// one (asked on a terminal), else the configured key file's; when there is none or it opens
/// no keyslot, the header's clevis tokens are tried (`token_unlock`).
pub fn open_image(
    config: &DiskConfig,
    passphrase: Option<Passphrase>,
    cx: &OpenContext<'_>,
) -> Result<OpenedImage> {
    let name = config.image.path();
    let (container, format) = open_container(config)?;
    match format {
        Format::Luks => {
            // The passphrase given, then the header's clevis tokens.
            let given = match passphrase {
                Some(p) => Some(p),
                None => configured_passphrase(config, cx)?,
            };
            let volume = crate::token_unlock::open_luks(
                container,
                given,
                &cryptblk_block::VolumeOptions {
                    writable: !config.readonly,
                    unlock: cx.unlock.clone(),
                    pool: Some(cx.pool.clone()),
                    ..Default::default()
                },
            )?;
            for warning in volume.warnings() {
                tracing::warn!(disk = %config.name, image = %name.display(), "{warning}");
            }
            luks_image(volume)
        }
        Format::Raw => {
            if has_key(config) || passphrase.is_some() {
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
fn open_container(config: &DiskConfig) -> Result<(Arc<dyn Container>, Format)> {
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
        cache: config.cache,
        aio: config.aio,
    };
    let file = RawFile::open_with(
        path,
        OpenOptions {
            writable,
            lock: true,
        },
        io,
    )
    .context("opening the image")?;
    Ok((Arc::new(file), format))
}

fn luks_image(volume: cryptblk_block::LuksVolume) -> Result<OpenedImage> {
    let serial = volume.header().uuid().to_string();
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
    })
}

/// A raw image is served as one plaintext part of a volume (not the file directly), so that
/// an online encryption can turn it into LUKS2 while it serves; its queues pay one plain load
/// per request for that (`cryptblk_block::SegmentMap`).
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
        let given = match passphrase {
            Some(p) => Some(p),
            None => configured_passphrase(config, cx)?,
        };
        let volume = crate::token_unlock::open_luks(
            file,
            given,
            &cryptblk_block::VolumeOptions {
                writable: true,
                unlock: cx.unlock.clone(),
                pool: Some(cx.pool.clone()),
                ..Default::default()
            },
        )
        .map_err(|e| e.context("opening the received LUKS volume"))?;
        luks_image(volume)?
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
