//! Images cryptblk formats and modifies are accepted by the real cryptsetup.
mod common_core;

use common_core::*;
use cryptblk_crypto::SecretKey;
use cryptblk_luks::kdf::Argon2Variant;
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{HashAlg, LuksError, PbkdfKind, PbkdfOptions};
use std::fs::File;

fn epoch(img: &std::path::Path) -> u64 {
    let out = run("cryptsetup", &["luksDump", s(img)]);
    let line = out
        .lines()
        .find(|l| l.starts_with("Epoch:"))
        .expect("Epoch line");
    line.trim_start_matches("Epoch:").trim().parse().unwrap()
}

fn test_pass(img: &std::path::Path, key: &std::path::Path, slot: Option<&str>) -> bool {
    let mut args = vec![
        "luksOpen",
        "--test-passphrase",
        "--batch-mode",
        "--key-file",
        s(key),
    ];
    if let Some(slot) = slot {
        args.extend_from_slice(&["--key-slot", slot]);
    }
    args.push(s(img));
    succeeds("cryptsetup", &args)
}

#[test]
fn formatted_image_opens_in_cryptsetup() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img");
    let key = write_key(dir.path(), "key", b"passphrase one");
    let file = open_rw_create(&img);
    let vk = SecretKey::random(64).unwrap();
    let opts = format_opts("aes-xts-plain64", 64, 4096);
    let h = Luks2Header::format(&file, &opts, b"passphrase one", &vk, Some(8 << 20)).unwrap();
    assert_eq!(file.metadata().unwrap().len(), (16 << 20) + (8 << 20));
    assert_eq!(h.active_keyslots(), vec![0]);

    let dump = run("cryptsetup", &["luksDump", s(&img)]);
    assert!(dump.contains("cryptblk-test"), "{dump}");
    assert!(dump.contains("sector: 4096"), "{dump}");
    assert!(dump.contains("aes-xts-plain64"), "{dump}");
    assert!(
        test_pass(&img, &key, None),
        "cryptsetup rejects the passphrase of a cryptblk image"
    );
    assert_eq!(cryptsetup_volume_key(&img, &key), vk.as_bytes());
    assert_eq!(run("cryptsetup", &["luksUUID", s(&img)]).trim(), h.uuid());

    let (again, warnings) = read(&img);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        again.data_size(file.metadata().unwrap().len()).unwrap(),
        8 << 20
    );
    let (slot, got) = unlock(&img, b"passphrase one").unwrap();
    assert_eq!((slot, got.as_bytes()), (0, vk.as_bytes()));
}

#[test]
fn formats_other_ciphers_and_kdfs() {
    for (cipher, bytes, sector, pbkdf) in [
        ("aes-xts-plain64", 32, 512, cheap_pbkdf2(HashAlg::Sha512)),
        ("aes-cbc-essiv:sha256", 32, 512, cheap_pbkdf2(HashAlg::Sha1)),
        ("aes-xts-plain64", 64, 4096, cheap_argon()),
        (
            "aes-xts-plain64",
            64,
            4096,
            PbkdfOptions {
                kind: PbkdfKind::Argon2(Argon2Variant::Argon2i),
                ..cheap_argon()
            },
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("img");
        let key = write_key(dir.path(), "key", b"pw");
        let file = open_rw_create(&img);
        let vk = SecretKey::random(bytes).unwrap();
        let mut opts = format_opts(cipher, bytes, sector);
        opts.pbkdf = pbkdf;
        Luks2Header::format(&file, &opts, b"pw", &vk, None).unwrap();
        assert!(test_pass(&img, &key, None), "{cipher}/{sector}");
        assert_eq!(cryptsetup_volume_key(&img, &key), vk.as_bytes(), "{cipher}");
    }
}

#[test]
fn format_rejects_bad_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let file = open_rw_create(&dir.path().join("img"));
    let opts = format_opts("aes-xts-plain64", 64, 4096);
    let short_key = SecretKey::random(32).unwrap();
    assert!(matches!(
        Luks2Header::format(&file, &opts, b"p", &short_key, None),
        Err(LuksError::InvalidArgument(_))
    ));
    let vk = SecretKey::random(64).unwrap();
    let e = Luks2Header::format(&file, &opts, b"p", &vk, Some(4096 + 512)).unwrap_err();
    assert!(e.to_string().contains("sector size"), "{e}");
    let mut bad = opts.clone();
    bad.sector_size = 1000;
    assert!(Luks2Header::format(&file, &bad, b"p", &vk, None).is_err());
    let mut bad = opts.clone();
    bad.label = Some("x".repeat(60));
    assert!(Luks2Header::format(&file, &bad, b"p", &vk, None)
        .unwrap_err()
        .to_string()
        .contains("label"));
    // Nothing was written by the refused calls.
    assert_eq!(file.metadata().unwrap().len(), 0);
}

#[test]
fn add_and_remove_keyslots_stay_cryptsetup_compatible() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img");
    let k0 = write_key(dir.path(), "k0", b"zero");
    let k3 = write_key(dir.path(), "k3", b"three");
    let k1 = write_key(dir.path(), "k1", b"one");
    let file = open_rw_create(&img);
    let vk = SecretKey::random(64).unwrap();
    let mut h = Luks2Header::format(
        &file,
        &format_opts("aes-xts-plain64", 64, 4096),
        b"zero",
        &vk,
        Some(1 << 20),
    )
    .unwrap();
    let e0 = epoch(&img);

    assert_eq!(
        h.add_keyslot(
            &file,
            &vk,
            b"three",
            Some(3),
            &cheap_pbkdf2(HashAlg::Sha256)
        )
        .unwrap(),
        3
    );
    assert_eq!(
        h.add_keyslot(&file, &vk, b"one", None, &cheap_argon())
            .unwrap(),
        1
    );
    assert_eq!(h.active_keyslots(), vec![0, 1, 3]);
    assert_eq!(epoch(&img), e0 + 2);
    assert!(test_pass(&img, &k3, Some("3")));
    assert!(test_pass(&img, &k1, Some("1")));

    // Wrong volume key, occupied or out-of-range slots are refused without changing the image.
    let wrong = SecretKey::random(64).unwrap();
    assert!(h
        .add_keyslot(&file, &wrong, b"x", None, &cheap_argon())
        .is_err());
    assert!(h
        .add_keyslot(&file, &vk, b"x", Some(3), &cheap_argon())
        .is_err());
    assert!(h
        .add_keyslot(&file, &vk, b"x", Some(32), &cheap_argon())
        .is_err());
    assert_eq!(epoch(&img), e0 + 2);

    // Keyslot areas must not overlap (cryptsetup validates this too).
    let areas: Vec<(u64, u64)> = h
        .metadata()
        .keyslots
        .values()
        .map(|k| (k.area.offset, k.area.size))
        .collect();
    for (i, a) in areas.iter().enumerate() {
        for b in &areas[i + 1..] {
            assert!(a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0, "{areas:?}");
        }
    }

    let area0 = h.metadata().keyslots["0"].area.clone();
    h.remove_keyslot(&file, 0).unwrap();
    assert_eq!(h.active_keyslots(), vec![1, 3]);
    assert!(
        !test_pass(&img, &k0, None),
        "removed passphrase still opens the image"
    );
    assert!(test_pass(&img, &k3, None));
    assert!(matches!(
        unlock(&img, b"zero"),
        Err(LuksError::WrongPassphrase)
    ));
    assert_eq!(unlock(&img, b"one").unwrap().1.as_bytes(), vk.as_bytes());
    let wiped = read_range(&img, area0.offset, area0.size as usize);
    assert!(
        wiped.iter().all(|&b| b == 0),
        "removed keyslot area not wiped"
    );
    assert!(h.remove_keyslot(&file, 0).is_err());

    // The freed area is reused by the next keyslot.
    assert_eq!(
        h.add_keyslot(&file, &vk, b"zero again", None, &cheap_argon())
            .unwrap(),
        0
    );
    assert_eq!(h.metadata().keyslots["0"].area.offset, area0.offset);
    assert_eq!(unlock(&img, b"zero again").unwrap().0, 0);
    run("cryptsetup", &["luksDump", s(&img)]);
}

#[test]
fn cryptsetup_added_keyslot_after_cryptblk_format() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img");
    let k0 = write_key(dir.path(), "k0", b"zero");
    let k6 = write_key(dir.path(), "k6", b"six");
    let file = open_rw_create(&img);
    let vk = SecretKey::random(64).unwrap();
    Luks2Header::format(
        &file,
        &format_opts("aes-xts-plain64", 64, 4096),
        b"zero",
        &vk,
        Some(1 << 20),
    )
    .unwrap();
    run(
        "cryptsetup",
        &[
            "luksAddKey",
            "--batch-mode",
            "--key-file",
            s(&k0),
            "--key-slot",
            "6",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            s(&img),
            s(&k6),
        ],
    );
    let (slot, got) = unlock(&img, b"six").unwrap();
    assert_eq!((slot, got.as_bytes()), (6, vk.as_bytes()));
}

fn open_rw_create(p: &std::path::Path) -> File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(p)
        .unwrap()
}

/// Without forced costs the digest and keyslot iterations come from a benchmark; the result
/// must still be at least cryptsetup's minimum and open in cryptsetup.
#[test]
fn benchmarked_costs_are_sane() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img");
    let key = write_key(dir.path(), "key", b"pw");
    let file = open_rw_create(&img);
    let vk = SecretKey::random(64).unwrap();
    let mut opts = format_opts("aes-xts-plain64", 64, 4096);
    opts.pbkdf = PbkdfOptions {
        iter_time_ms: 50,
        force_iterations: None,
        ..cheap_pbkdf2(HashAlg::Sha256)
    };
    let h = Luks2Header::format(&file, &opts, b"pw", &vk, Some(1 << 20)).unwrap();
    let d = h.dump();
    assert!(
        d["digests"][0]["iterations"].as_u64().unwrap() >= 1000,
        "{d}"
    );
    assert!(
        d["keyslots"][0]["iterations"].as_u64().unwrap() >= 1000,
        "{d}"
    );
    assert!(test_pass(&img, &key, None));
}
