//! [`Volume`]: what a guest's bytes are, as the daemon serves them. An image opened on its
//! [`Container`] (a file or an RBD image), LUKS unlocked ([`LuksVolume`]) or raw, behind the
//! tracking stage a migration reads and a hand-over fences ([`DirtyTracker`]), with what its
//! header says ([`LuksFacts`]) and the volume keys serving it ([`VolumeKeys`]).
//!
//! A raw image is a volume too: one plaintext part of a [`SegmentMap`], so that an online
//! encryption can turn it into LUKS2 while it serves.
use crate::{CryptDevice, DirtyTracker, LuksVolume, SegmentMap, TrackingError};
use cryptblk_block::{BlockDevice, Container, Format};
use cryptblk_luks::KnownKey;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// Dirty tracking granularity of a raw image (a LUKS image tracks its encryption sectors).
const RAW_TRACKING_GRANULARITY: u64 = 4096;

/// What a guest's bytes are: an image opened (and for LUKS unlocked), served through its
/// tracking stage, with what its header says and the keys serving it.
pub struct Volume {
    /// What the exports serve: the disk behind its dirty tracker (idle until a migration).
    pub device: Arc<dyn BlockDevice>,
    pub tracker: Arc<DirtyTracker>,
    /// The image (file or RBD image) under the encryption, which a migration copies and
    /// whose header keyslot changes and reencryptions update.
    pub container: Arc<dyn Container>,
    /// The LUKS UUID or the image file name.
    pub serial: String,
    /// The volume under the tracker: a LUKS image's decrypted payload, or a raw image as one
    /// plaintext part, which an online encryption turns into a LUKS2 volume while it serves.
    pub crypt: CryptDevice,
    /// What the LUKS header says of the image; a raw image gets it when an online encryption
    /// writes its header.
    luks: RwLock<Option<LuksFacts>>,
    /// The volume keys serving it, for a successor daemon or a key cache (`VolumeKeys`).
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

impl Volume {
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
    pub fn set_luks(&self, facts: LuksFacts) {
        *self.luks.write().unwrap_or_else(PoisonError::into_inner) = Some(facts);
    }

    /// Which storage serves which part of the volume (several during a reencryption).
    pub fn segments(&self) -> &Arc<SegmentMap> {
        self.crypt.segments()
    }

    /// A copy of the volume keys serving the disk (`None` for a raw one).
    pub fn volume_keys(&self) -> Option<VolumeKeys> {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(VolumeKeys::duplicate)
    }

    /// The volume keys changed (a reencryption started or finished, an encryption began), or
    /// became known (a key cache, if the caller keeps one, follows them).
    pub fn set_volume_keys(&self, keys: VolumeKeys) {
        *self.keys.lock().unwrap_or_else(PoisonError::into_inner) = Some(keys);
    }

    /// The volume of an unlocked LUKS image, behind its tracking stage (which counts in the
    /// image's encryption sectors). Reached through the door, [`Volume::open`].
    pub(crate) fn from_luks(volume: LuksVolume) -> Result<Volume, TrackingError> {
        let serial = volume.header().uuid().to_string();
        let keys = VolumeKeys {
            uuid: serial.clone(),
            keys: volume
                .known_keys()
                .iter()
                .map(KnownKey::duplicate)
                .collect(),
        };
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
        let without_kdf = volume.without_kdf();
        let file = volume.container().clone();
        let crypt = volume.device().clone();
        let payload_offset = volume.header().data_offset();
        let granularity = u64::from(volume.header().sector_size());
        let volume = Arc::new(volume);
        let tracker = Arc::new(DirtyTracker::new(
            volume.clone(),
            payload_offset,
            granularity,
        )?);
        Ok(Volume {
            device: tracker.clone(),
            tracker,
            container: file,
            serial,
            crypt,
            luks: RwLock::new(Some(facts)),
            keys: Mutex::new(Some(keys)),
            without_kdf,
        })
    }

    /// A raw image is served as one plaintext part of a volume (not the file directly), so
    /// that an online encryption can turn it into LUKS2 while it serves; its queues pay one
    /// plain load per request for that ([`SegmentMap`]). Reached through the door,
    /// [`Volume::open`].
    pub(crate) fn from_raw(raw: Arc<dyn Container>) -> Result<Volume, TrackingError> {
        let serial = raw
            .name()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let read_only = raw.read_only();
        let backend: Arc<dyn BlockDevice> = raw.clone();
        let volume = CryptDevice::plaintext(backend, read_only);
        let tracker = Arc::new(DirtyTracker::new(
            Arc::new(volume.clone()),
            0,
            RAW_TRACKING_GRANULARITY,
        )?);
        Ok(Volume {
            device: tracker.clone(),
            tracker,
            container: raw,
            serial,
            crypt: volume,
            luks: RwLock::new(None),
            keys: Mutex::new(None),
            without_kdf: false,
        })
    }
}
