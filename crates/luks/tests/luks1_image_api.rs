//! The version-independent `LuksImage` API over LUKS1 and LUKS2, checked with cryptsetup.
mod common_core;
use common_core::*;
use cryptblk_crypto::CipherSpec;
use cryptblk_luks::kdf::Argon2Variant;
use cryptblk_luks::{
    FormatOptions, HashAlg, LuksError, LuksImage, LuksVersion, PbkdfKind, PbkdfOptions,
    UnlockOptions,
};
use std::path::Path;

fn cheap(version: LuksVersion) -> PbkdfOptions {
    match version {
        LuksVersion::V1 => PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000),
        LuksVersion::V2 => PbkdfOptions {
            kind: PbkdfKind::Argon2(Argon2Variant::Argon2id),
            hash: HashAlg::Sha256,
            force_iterations: Some(4),
            memory_kib: 32,
            parallel: 1,
            ..PbkdfOptions::default()
        },
    }
}

fn format(
    path: &Path,
    version: LuksVersion,
) -> (std::fs::File, LuksImage, cryptblk_crypto::SecretKey) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .unwrap();
    let opts = FormatOptions {
        version,
        cipher: CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap(),
        hash: HashAlg::Sha256,
        pbkdf: cheap(version),
        sector_size: 512,
        label: None,
        uuid: Some("01234567-89ab-cdef-0123-456789abcdef".into()),
    };
    let (img, vk) = LuksImage::format(&f, &opts, b"old pass", Some(1 << 20)).unwrap();
    (f, img, vk)
}

#[test]
fn probe_and_read_dispatch_on_version() {
    let dir = tempfile::tempdir().unwrap();
    for version in [LuksVersion::V1, LuksVersion::V2] {
        let p = dir.path().join(format!("{version:?}.img"));
        let (f, img, vk) = format(&p, version);
        assert!(LuksImage::probe(&f).unwrap());
        let (again, warnings) = LuksImage::read(&f).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(again.version(), version);
        assert_eq!(again.uuid(), "01234567-89ab-cdef-0123-456789abcdef");
        assert_eq!(
            again.cipher_spec().unwrap().to_luks2_string(),
            "aes-xts-plain64"
        );
        assert_eq!(
            again.data_size(f.metadata().unwrap().len()).unwrap(),
            1 << 20
        );
        assert_eq!(again.data_offset(), img.data_offset());
        again.verify_volume_key(&vk).unwrap();
        let (slot, key) = again
            .unlock(&f, b"old pass", &UnlockOptions::default())
            .unwrap();
        assert_eq!((slot, key), (0, vk));
        let text = again.dump_text();
        assert!(
            text.contains("01234567-89ab-cdef-0123-456789abcdef"),
            "{text}"
        );
        assert!(again.dump_json().is_object());
    }
    let plain = dir.path().join("plain");
    std::fs::write(&plain, vec![0u8; 64 << 10]).unwrap();
    let f = open_rw(&plain);
    assert!(!LuksImage::probe(&f).unwrap());
    assert!(matches!(LuksImage::read(&f), Err(LuksError::NotLuks(_))));
    std::fs::write(&plain, b"LUK").unwrap();
    assert!(!LuksImage::probe(&open_rw(&plain)).unwrap());
    assert!(LuksImage::read(&open_rw(&plain)).is_err());
}

#[test]
fn change_passphrase_both_versions_cryptsetup_agrees() {
    let dir = tempfile::tempdir().unwrap();
    for version in [LuksVersion::V1, LuksVersion::V2] {
        let p = dir.path().join(format!("chg-{version:?}.img"));
        let (f, mut img, vk) = format(&p, version);
        let slot = img
            .change_passphrase(
                &f,
                b"old pass",
                b"new pass",
                &cheap(version),
                &UnlockOptions::default(),
            )
            .unwrap();
        assert_ne!(slot, 0, "the new passphrase must go to another slot first");
        assert_eq!(img.active_keyslots(), vec![slot]);
        let (reread, _) = LuksImage::read(&f).unwrap();
        assert!(matches!(
            reread.unlock(&f, b"old pass", &UnlockOptions::default()),
            Err(LuksError::WrongPassphrase)
        ));
        assert_eq!(
            reread
                .unlock(&f, b"new pass", &UnlockOptions::default())
                .unwrap(),
            (slot, vk.clone())
        );
        let new_key = write_key(dir.path(), "new", b"new pass");
        let old_key = write_key(dir.path(), "old", b"old pass");
        assert!(succeeds(
            "cryptsetup",
            &[
                "luksOpen",
                "--test-passphrase",
                "--key-file",
                s(&new_key),
                s(&p)
            ]
        ));
        assert!(!succeeds(
            "cryptsetup",
            &[
                "luksOpen",
                "--test-passphrase",
                "--key-file",
                s(&old_key),
                s(&p)
            ]
        ));
        assert_eq!(cryptsetup_volume_key(&p, &new_key), vk.as_bytes());
        // A wrong old passphrase changes nothing.
        let mut img = reread;
        assert!(matches!(
            img.change_passphrase(
                &f,
                b"nope",
                b"x",
                &cheap(version),
                &UnlockOptions::default()
            ),
            Err(LuksError::WrongPassphrase)
        ));
        assert_eq!(img.active_keyslots(), vec![slot]);
    }
}

#[test]
fn cryptsetup_luks2_image_reads_through_the_generic_api() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cs2.img");
    std::fs::File::create(&p)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let key = write_key(dir.path(), "k", b"luks2 pass");
    run(
        "cryptsetup",
        &[
            "luksFormat",
            "--type",
            "luks2",
            "--batch-mode",
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "32",
            "--pbkdf-force-iterations",
            "4",
            "--label",
            "lbl",
            "--key-file",
            s(&key),
            s(&p),
        ],
    );
    let f = open_rw(&p);
    let (img, _) = LuksImage::read(&f).unwrap();
    assert_eq!(img.version(), LuksVersion::V2);
    assert_eq!(img.label(), Some("lbl"));
    let (_, vk) = img
        .unlock(&f, b"luks2 pass", &UnlockOptions::default())
        .unwrap();
    assert_eq!(vk.as_bytes(), &cryptsetup_volume_key(&p, &key)[..]);
    let text = img.dump_text();
    assert!(
        text.contains("Label:         \tlbl") && text.contains("argon2id"),
        "{text}"
    );
}

#[test]
fn dumps_never_contain_the_volume_key() {
    let dir = tempfile::tempdir().unwrap();
    for version in [LuksVersion::V1, LuksVersion::V2] {
        let p = dir.path().join(format!("dump-{version:?}.img"));
        let (_f, img, vk) = format(&p, version);
        let json = img.dump_json().to_string().to_lowercase();
        let text = img.dump_text().to_lowercase();
        let hex_key = hex::encode(vk.as_bytes());
        let spaced: String = vk.as_bytes().iter().map(|b| format!("{b:02x} ")).collect();
        for needle in [&hex_key[..16], spaced.trim_end().get(..24).unwrap()] {
            assert!(
                !json.contains(needle) && !text.contains(needle),
                "{version:?} dump leaks key bytes"
            );
        }
    }
}

#[test]
fn failed_keyslot_write_leaves_header_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    for version in [LuksVersion::V1, LuksVersion::V2] {
        let p = dir.path().join(format!("ro-{version:?}.img"));
        let (_f, mut img, vk) = format(&p, version);
        let read_only = std::fs::File::open(&p).unwrap();
        assert!(img
            .add_keyslot(&read_only, &vk, b"second", None, &cheap(version))
            .is_err());
        assert_eq!(
            img.active_keyslots(),
            vec![0],
            "{version:?}: in-memory header changed"
        );
        let (on_disk, _) = LuksImage::read(&read_only).unwrap();
        assert_eq!(on_disk.active_keyslots(), vec![0]);
        assert!(img.remove_keyslot(&read_only, 0).is_err());
        assert_eq!(img.active_keyslots(), vec![0]);
        assert_eq!(
            img.unlock(&read_only, b"old pass", &UnlockOptions::default())
                .unwrap()
                .1,
            vk
        );
    }
}
