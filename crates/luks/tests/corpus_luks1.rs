//! cryptsetup's own LUKS1 test images (../shared/corpus/cryptsetup).
mod common_core;
use common_core::*;
use cryptblk_luks::luks1::Luks1Header;
use cryptblk_luks::{LuksError, UnlockOptions};
use cryptblk_testutil::corpus::Corpus;

#[test]
fn compatimage_unlocks_and_key_verifies() {
    let Some(corpus) = Corpus::find_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = corpus.unpack(dir.path(), "compatimage.img.xz");
    let f = open_rw(&img);
    let (hdr, warnings) = Luks1Header::read(&f).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        hdr.cipher_spec().unwrap().to_luks2_string(),
        "aes-cbc-essiv:sha256"
    );
    let (slot, vk) = hdr
        .unlock(&f, b"compatkey", &UnlockOptions::default())
        .unwrap();
    hdr.verify_volume_key(&vk).unwrap();
    let key = write_key(dir.path(), "key", b"compatkey");
    assert_eq!(
        vk.as_bytes(),
        &cryptsetup_volume_key(&img, &key)[..],
        "slot {slot}"
    );
    assert!(matches!(
        hdr.unlock(&f, b"compatkeY", &UnlockOptions::default()),
        Err(LuksError::WrongPassphrase)
    ));
    assert!(
        hdr.unlock(&f, b"compatkey\n", &UnlockOptions::default())
            .is_err(),
        "newline must count"
    );
}

#[test]
fn compatv10image_unlocks() {
    let Some(corpus) = Corpus::find_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = corpus.unpack(dir.path(), "compatv10image.img.xz");
    let f = open_rw(&img);
    let (hdr, _) = Luks1Header::read(&f).unwrap();
    assert_eq!(
        hdr.cipher_spec().unwrap().to_luks2_string(),
        "aes-cbc-plain"
    );
    assert_eq!(hdr.data_offset(), 1010 * 512);
    let (slot, vk) = hdr
        .unlock(&f, b"compatkey", &UnlockOptions::default())
        .unwrap();
    assert_eq!(slot, 0);
    let key = write_key(dir.path(), "key", b"compatkey");
    assert_eq!(vk.as_bytes(), &cryptsetup_volume_key(&img, &key)[..]);
}

#[test]
fn valid_header_file_parses() {
    let Some(corpus) = Corpus::find_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = corpus.unpack(dir.path(), "valid_header_file.xz");
    let (hdr, _) = Luks1Header::read(&open_rw(&img)).unwrap();
    assert_eq!(hdr.uuid(), "14af2331-2046-46ea-ac0d-4453bb95e744");
    assert_eq!(
        hdr.cipher_spec().unwrap().to_luks2_string(),
        "aes-cbc-essiv:sha256"
    );
    assert_eq!(hdr.data_offset(), 4096 * 512);
    assert_eq!(hdr.dump()["hash_spec"], "sha512");
    // A header file shorter than its payload offset has no data.
    assert!(matches!(hdr.data_size(2 << 20), Ok(0)));
    assert!(matches!(
        hdr.data_size(1 << 20),
        Err(LuksError::Truncated(_))
    ));
    // Every keyslot of this header is disabled: nothing to try, and that is not a typo.
    assert!(hdr.active_keyslots().is_empty());
    let e = hdr
        .unlock(&open_rw(&img), b"anything", &UnlockOptions::default())
        .unwrap_err();
    assert!(matches!(e, LuksError::NoKeyslots), "{e}");
}

#[test]
fn luks1_images_parse_unlock_or_refuse_by_name() {
    let Some(corpus) = Corpus::find_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    corpus.unpack(dir.path(), "luks1-images.tar.xz");
    let base = dir.path().join("luks1-images");
    let keyfile = std::fs::read(base.join("keyfile1")).unwrap();
    let mut names: Vec<_> = std::fs::read_dir(&base)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".img"))
        .collect();
    names.sort();
    assert_eq!(names.len(), 12, "{names:?}");
    let mut unlocked = 0;
    for name in names {
        let img = base.join(&name);
        let f = open_rw(&img);
        let (hdr, _) = Luks1Header::read(&f).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!hdr.dump_text().is_empty());
        // What unlock must refuse, by the first name it cannot run (cipher before hash).
        let expect: Option<&str> = match name.as_str() {
            n if n.contains("serpent") => Some("serpent"),
            n if n.contains("twofish") => Some("twofish"),
            n if n.contains("lrw") => Some("lrw"),
            n if n.contains("essiv-wp256") => Some("wp256"),
            n if n.contains("whirlpool") => Some("whirlpool"),
            _ => None,
        };
        match (expect, hdr.unlock(&f, &keyfile, &UnlockOptions::default())) {
            (None, Ok((_, vk))) => {
                assert_eq!(
                    vk.as_bytes(),
                    &cryptsetup_volume_key(&img, &base.join("keyfile1"))[..],
                    "{name}"
                );
                unlocked += 1;
            }
            (Some(word), Err(e @ LuksError::Unsupported { .. })) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(word),
                    "{name}: error '{msg}' does not name {word}"
                );
            }
            (exp, other) => panic!(
                "{name}: expected refusal {exp:?}, got {:?}",
                other.map(|(s, _)| s)
            ),
        }
    }
    assert_eq!(
        unlocked, 3,
        "aes xts-plain64 sha1/sha256 and cbc-essiv:sha256 with sha1 must unlock"
    );
}
