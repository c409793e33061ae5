//! `Keyslots`: the keyslot changes the daemon (`key-add`, `key-remove`) and the CLI
//! (`cryptblk key add|remove|change`) run on a LUKS header. What a user notices: the new
//! passphrase opens the volume, a removed one no longer does, a wrong one changes nothing,
//! and the last keyslot is kept unless its removal is allowed.
mod common;

use common::{cheap, container, PW};
use cryptblk_block::{OpenOptions, RawFile};
use cryptblk_luks::{LuksError, LuksVersion, UnlockOptions, Unlocker};
use cryptblk_volume::{Key, Keyslots, LastKeyslot, RemoveError, Volume, VolumeOptions};
use std::path::Path;
use std::sync::Arc;

/// Whether `passphrase` opens the volume (the door the daemon serves through), read-only
/// beside the header the test holds.
fn opens(path: &Path, passphrase: &[u8]) -> bool {
    let opts = VolumeOptions::default();
    let image = RawFile::open(
        path,
        OpenOptions {
            writable: false,
            lock: false,
        },
    )
    .unwrap();
    Volume::open(
        Arc::new(image),
        Key::Given(Unlocker::Passphrase(passphrase), &opts),
    )
    .is_ok()
}

#[test]
fn add_remove_and_change_keyslots_on_luks1_and_luks2() {
    for version in [LuksVersion::V1, LuksVersion::V2] {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("disk.luks");
        common::luks(&img, version, 1 << 20);
        let file = container(&img);
        let unlock = UnlockOptions::default();

        let (mut keyslots, warnings) = Keyslots::read(file.header_io()).unwrap();
        assert!(warnings.is_empty(), "{version:?}: {warnings:?}");
        assert_eq!(keyslots.version(), version);
        let wrong = keyslots.unlock(b"wrong", &unlock).err().unwrap();
        assert!(matches!(wrong, LuksError::WrongPassphrase), "{wrong:?}");

        // The only keyslot stays unless its removal is allowed.
        let unlocked = keyslots.unlock(PW, &unlock).unwrap();
        assert_eq!(unlocked.slot(), 0);
        match unlocked.remove_keyslot(LastKeyslot::Refuse) {
            Err(RemoveError::LastKeyslot { slot: 0 }) => {}
            other => panic!("{version:?}: {other:?}"),
        }
        assert!(opens(&img, PW), "{version:?}: the last keyslot kept");

        let unlocked = keyslots.unlock(PW, &unlock).unwrap();
        let added = unlocked.add_keyslot(b"second", Some(3), &cheap()).unwrap();
        assert_eq!(added, 3);
        assert!(
            opens(&img, b"second"),
            "{version:?}: the added keyslot opens"
        );

        // A header read again (a later command) sees both; removing the first leaves the new.
        let (mut keyslots, _) = Keyslots::read(file.header_io()).unwrap();
        let removed = keyslots
            .unlock(PW, &unlock)
            .unwrap()
            .remove_keyslot(LastKeyslot::Refuse)
            .unwrap();
        assert_eq!(removed, 0);
        assert!(!opens(&img, PW), "{version:?}: the removed passphrase");
        assert!(opens(&img, b"second"), "{version:?}");

        let slot = keyslots
            .change_passphrase(b"second", b"third", &cheap(), &unlock)
            .unwrap();
        assert!(opens(&img, b"third"), "{version:?}: slot {slot}");
        assert!(!opens(&img, b"second"), "{version:?}");

        // Allowed, the last keyslot goes: no passphrase opens the image any more.
        let (mut keyslots, _) = Keyslots::read(file.header_io()).unwrap();
        keyslots
            .unlock(b"third", &unlock)
            .unwrap()
            .remove_keyslot(LastKeyslot::Allow)
            .unwrap();
        assert!(!opens(&img, b"third"), "{version:?}");
    }
}
