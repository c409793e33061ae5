//! The door to a volume: `Volume::open` tells LUKS1, LUKS2 and raw apart by the first bytes of
//! the container, unlocks a LUKS image as the caller says, and refuses a key for a raw image.
mod common;

use common::{container, PW};
use cryptblk_block::{Container, Format};
use cryptblk_luks::{LuksVersion, Unlocker};
use cryptblk_volume::{Key, LuksVolume, OpenError, Opened, Unlock, Volume, VolumeOptions};
use std::cell::Cell;
use std::sync::Arc;

const PAYLOAD: u64 = 1 << 20;

fn rw() -> VolumeOptions {
    VolumeOptions {
        writable: true,
        ..Default::default()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// Opens LUKS1 and LUKS2 with the passphrase, then again with the keys it handed out (no KDF):
/// what was written through the first volume reads back through the second, and the backend
/// holds ciphertext.
#[test]
fn luks1_and_luks2_open_by_passphrase_then_by_keys() {
    for version in [LuksVersion::V1, LuksVersion::V2] {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("disk.luks");
        common::luks(&img, version, PAYLOAD);
        let opts = rw();
        let data = pattern(8192, 7);
        let keys = {
            let volume =
                Volume::open(container(&img), Key::Given(Unlocker::Passphrase(PW), &opts)).unwrap();
            assert_eq!(volume.format(), Format::Luks, "{version:?}");
            assert!(!volume.without_kdf, "{version:?}: opened by a passphrase");
            assert_eq!(volume.device.size(), PAYLOAD, "{version:?}");
            volume.device.write_at(&data, 4096).unwrap();
            volume.device.flush().unwrap();
            volume.volume_keys().unwrap()
        };
        let raw = std::fs::read(&img).unwrap();
        assert!(
            !raw.windows(data.len()).any(|w| w == data),
            "{version:?}: plaintext on disk"
        );
        let volume = Volume::open(
            container(&img),
            Key::Given(Unlocker::Keys(&keys.keys), &opts),
        )
        .unwrap();
        assert!(volume.without_kdf, "{version:?}: opened by known keys");
        assert_eq!(volume.serial, keys.uuid);
        let mut back = vec![0u8; data.len()];
        volume.device.read_at(&mut back, 4096).unwrap();
        assert_eq!(back, data, "{version:?}");
    }
}

#[test]
fn luks_with_a_wrong_passphrase_or_no_key_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.luks");
    common::luks(&img, LuksVersion::V2, PAYLOAD);
    let opts = rw();
    let wrong = Volume::open(
        container(&img),
        Key::Given(Unlocker::Passphrase(b"wrong"), &opts),
    )
    .err()
    .unwrap();
    match wrong {
        OpenError::Unlock(e) => assert!(e.is_wrong_passphrase(), "{e}"),
        e => panic!("not an unlock error: {e:?}"),
    }
    let none = Volume::open(container(&img), Key::None).err().unwrap();
    assert_eq!(
        none.to_string(),
        format!(
            "{} is LUKS, and no passphrase or key was given",
            img.display()
        )
    );
}

#[test]
fn raw_opens_as_it_is_and_refuses_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.raw");
    let data = pattern(PAYLOAD as usize, 3);
    std::fs::write(&img, &data).unwrap();
    let volume = Volume::open(container(&img), Key::None).unwrap();
    assert_eq!(volume.format(), Format::Raw);
    assert!(volume.volume_keys().is_none());
    assert_eq!(volume.serial, "disk.raw");
    let mut back = vec![0u8; 4096];
    volume.device.read_at(&mut back, 8192).unwrap();
    assert_eq!(back, data[8192..8192 + 4096]);
    drop(volume);

    let opts = rw();
    let refused = Volume::open(container(&img), Key::Given(Unlocker::Passphrase(PW), &opts))
        .err()
        .unwrap();
    assert!(
        matches!(refused, OpenError::KeyForRaw { .. }),
        "{refused:?}"
    );
    assert_eq!(
        refused.to_string(),
        format!("a key is given, but {} is raw, not LUKS", img.display())
    );
    // Nothing written: the image is what it was.
    assert_eq!(std::fs::read(&img).unwrap(), data);
}

/// An image that only begins like LUKS is LUKS (and fails to unlock), not raw: the door does
/// not serve a damaged LUKS header's ciphertext as plaintext. An empty one is raw.
#[test]
fn the_magic_decides_and_a_short_image_is_raw() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("damaged");
    let mut bytes = vec![0u8; 64 << 10];
    bytes[..6].copy_from_slice(b"LUKS\xba\xbe");
    std::fs::write(&img, &bytes).unwrap();
    let err = Opened::open(container(&img), Key::None).err().unwrap();
    assert!(matches!(err, OpenError::Unlock(_)), "{err:?}");

    let empty = dir.path().join("empty");
    std::fs::write(&empty, b"LUK").unwrap();
    assert!(matches!(
        Opened::open(container(&empty), Key::None).unwrap(),
        Opened::Raw(_)
    ));
}

/// A caller's own unlock procedure: asked only for a LUKS image (a raw one is never asked for
/// a key), and its error comes back as it made it.
struct Asking<'a> {
    asked: &'a Cell<u32>,
    has_key: bool,
}

impl Unlock for Asking<'_> {
    type Error = String;

    fn has_key(&self) -> bool {
        self.has_key
    }

    fn unlock(self, container: Arc<dyn Container>) -> Result<LuksVolume, String> {
        self.asked.set(self.asked.get() + 1);
        cryptblk_volume::open_luks_volume_on(container, PW, &rw()).map_err(|e| e.to_string())
    }
}

#[test]
fn a_callers_unlock_is_asked_only_for_luks() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("disk.raw");
    std::fs::write(&raw, vec![0u8; 4096]).unwrap();
    let luks_img = dir.path().join("disk.luks");
    common::luks(&luks_img, LuksVersion::V2, PAYLOAD);
    let asked = Cell::new(0);
    let unlock = |has_key| Asking {
        asked: &asked,
        has_key,
    };

    let volume = Volume::open(container(&raw), unlock(false)).unwrap();
    assert_eq!((volume.format(), asked.get()), (Format::Raw, 0));
    drop(volume);
    assert!(matches!(
        Volume::open(container(&raw), unlock(true)),
        Err(OpenError::KeyForRaw { .. })
    ));
    assert_eq!(asked.get(), 0);

    let volume = Volume::open(container(&luks_img), unlock(false)).unwrap();
    assert_eq!((volume.format(), asked.get()), (Format::Luks, 1));
    drop(volume);
    std::fs::write(&luks_img, b"LUKS\xba\xbe\x00\x02 not a header").unwrap();
    match Volume::open(container(&luks_img), unlock(true)) {
        Err(OpenError::Unlock(message)) => assert!(message.contains("disk.luks"), "{message}"),
        other => panic!("not the caller's error: {:?}", other.err()),
    }
    assert_eq!(asked.get(), 2);
}
