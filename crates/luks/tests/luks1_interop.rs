//! LUKS1 against the real cryptsetup: images it makes unlock here with the same volume key,
//! and images made here are accepted by it.
mod common_core;
use common_core::*;
use cryptblk_crypto::{CipherSpec, SecretKey};
use cryptblk_luks::luks1::Luks1Header;
use cryptblk_luks::{FormatOptions, HashAlg, LuksError, LuksVersion, PbkdfOptions, UnlockOptions};

fn cs_format(
    dir: &std::path::Path,
    cipher: &str,
    bits: &str,
    hash: &str,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let img = dir.join(format!("{cipher}-{bits}-{hash}.img"));
    std::fs::File::create(&img)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let key = write_key(dir, "k0", b"first passphrase");
    run(
        "cryptsetup",
        &[
            "luksFormat",
            "--type",
            "luks1",
            "--batch-mode",
            "--pbkdf-force-iterations",
            "1000",
            "-c",
            cipher,
            "-s",
            bits,
            "-h",
            hash,
            "--key-file",
            s(&key),
            s(&img),
        ],
    );
    (img, key)
}

#[test]
fn cryptsetup_images_unlock_with_matching_volume_key() {
    let dir = tempfile::tempdir().unwrap();
    for (cipher, bits, hash) in [
        ("aes-xts-plain64", "512", "sha256"),
        ("aes-xts-plain64", "256", "sha1"),
        ("aes-xts-plain64", "512", "sha512"),
        ("aes-cbc-essiv:sha256", "256", "sha256"),
        ("aes-cbc-plain64", "128", "sha1"),
    ] {
        let (img, key) = cs_format(dir.path(), cipher, bits, hash);
        let f = open_rw(&img);
        let (hdr, _) = Luks1Header::read(&f).unwrap();
        assert_eq!(hdr.cipher_spec().unwrap().to_luks2_string(), cipher);
        assert_eq!(
            hdr.cipher_spec().unwrap().key_bytes() * 8,
            bits.parse::<usize>().unwrap()
        );
        let (slot, vk) = hdr
            .unlock(&f, b"first passphrase", &UnlockOptions::default())
            .unwrap();
        assert_eq!(slot, 0);
        assert_eq!(
            vk.as_bytes(),
            &cryptsetup_volume_key(&img, &key)[..],
            "{cipher} {bits} {hash}"
        );
        // Our own format of the same cipher must lay the header out exactly like cryptsetup.
        let ours_path = dir.path().join("ours-layout.img");
        let ours = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&ours_path)
            .unwrap();
        let opts = FormatOptions {
            version: LuksVersion::V1,
            cipher: hdr.cipher_spec().unwrap(),
            hash: HashAlg::parse(hash).unwrap(),
            pbkdf: PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000),
            sector_size: 512,
            label: None,
            uuid: None,
        };
        let mine = Luks1Header::format(&ours, &opts, b"x", &vk, None).unwrap();
        assert_eq!(mine.data_offset(), hdr.data_offset(), "{cipher} {bits}");
        for i in 0..8 {
            assert_eq!(
                mine.dump()["keyslots"][i]["key_material_offset_sectors"],
                hdr.dump()["keyslots"][i]["key_material_offset_sectors"],
                "{cipher} {bits} slot {i}"
            );
        }
        assert!(matches!(
            hdr.unlock(&f, b"first passphrasf", &UnlockOptions::default()),
            Err(LuksError::WrongPassphrase)
        ));
    }
}

#[test]
fn keyslot_gaps_from_cryptsetup() {
    let dir = tempfile::tempdir().unwrap();
    let (img, k0) = cs_format(dir.path(), "aes-xts-plain64", "256", "sha256");
    let k5 = write_key(dir.path(), "k5", b"slot five");
    let k2 = write_key(dir.path(), "k2", b"slot two");
    let it = ["--pbkdf-force-iterations", "1000", "--batch-mode"];
    let mut args = vec![
        "luksAddKey",
        "--key-slot",
        "5",
        "--key-file",
        s(&k0),
        s(&img),
        s(&k5),
    ];
    args.extend(it);
    run("cryptsetup", &args);
    let mut args = vec![
        "luksAddKey",
        "--key-slot",
        "2",
        "--key-file",
        s(&k0),
        s(&img),
        s(&k2),
    ];
    args.extend(it);
    run("cryptsetup", &args);
    run(
        "cryptsetup",
        &["luksKillSlot", "--batch-mode", s(&img), "0"],
    );
    let f = open_rw(&img);
    let (hdr, _) = Luks1Header::read(&f).unwrap();
    assert_eq!(hdr.active_keyslots(), vec![2, 5]);
    let o = UnlockOptions::default();
    assert_eq!(hdr.unlock(&f, b"slot five", &o).unwrap().0, 5);
    assert_eq!(hdr.unlock(&f, b"slot two", &o).unwrap().0, 2);
    assert!(matches!(
        hdr.unlock(&f, b"first passphrase", &o),
        Err(LuksError::WrongPassphrase)
    ));
    let vk = hdr.unlock(&f, b"slot five", &o).unwrap().1;
    assert_eq!(vk.as_bytes(), &cryptsetup_volume_key(&img, &k5)[..]);
}

#[test]
fn our_images_are_accepted_by_cryptsetup() {
    let dir = tempfile::tempdir().unwrap();
    for (cipher, key_bytes, hash) in [
        ("aes-xts-plain64", 64, HashAlg::Sha256),
        ("aes-cbc-essiv:sha256", 32, HashAlg::Sha1),
        ("aes-xts-plain64", 32, HashAlg::Sha512),
    ] {
        let img = dir.path().join(format!("ours-{cipher}-{key_bytes}.img"));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&img)
            .unwrap();
        let opts = FormatOptions {
            version: LuksVersion::V1,
            cipher: CipherSpec::parse_luks2(cipher, key_bytes).unwrap(),
            hash,
            pbkdf: PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000),
            sector_size: 512,
            label: None,
            uuid: None,
        };
        let vk = SecretKey::random(key_bytes).unwrap();
        let mut hdr = Luks1Header::format(&f, &opts, b"ours", &vk, Some(1 << 20)).unwrap();
        assert_eq!(f.metadata().unwrap().len(), hdr.data_offset() + (1 << 20));
        let k = write_key(dir.path(), "ours.key", b"ours");
        let dump = run("cryptsetup", &["luksDump", s(&img)]);
        assert!(
            dump.contains(&format!("Hash spec:     \t{}", hash.name())),
            "{dump}"
        );
        assert!(
            dump.contains(&format!("UUID:          \t{}", hdr.uuid())),
            "{dump}"
        );
        assert!(succeeds(
            "cryptsetup",
            &[
                "luksOpen",
                "--test-passphrase",
                "--key-file",
                s(&k),
                s(&img)
            ]
        ));
        assert_eq!(cryptsetup_volume_key(&img, &k), vk.as_bytes());

        // A second slot in a gap, then remove the first: cryptsetup must follow both changes.
        assert_eq!(
            hdr.add_keyslot(
                &f,
                &vk,
                b"second",
                Some(3),
                &PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000)
            )
            .unwrap(),
            3
        );
        hdr.remove_keyslot(&f, 0).unwrap();
        let k2 = write_key(dir.path(), "second.key", b"second");
        assert!(succeeds(
            "cryptsetup",
            &[
                "luksOpen",
                "--test-passphrase",
                "--key-slot",
                "3",
                "--key-file",
                s(&k2),
                s(&img)
            ]
        ));
        assert!(!succeeds(
            "cryptsetup",
            &[
                "luksOpen",
                "--test-passphrase",
                "--key-file",
                s(&k),
                s(&img)
            ]
        ));
        let dump = run("cryptsetup", &["luksDump", s(&img)]);
        assert!(
            dump.contains("Key Slot 0: DISABLED") && dump.contains("Key Slot 3: ENABLED"),
            "{dump}"
        );
        // Our reader agrees with what we wrote, and the removed slot's area is wiped.
        let (again, _) = Luks1Header::read(&f).unwrap();
        assert_eq!(again.active_keyslots(), vec![3]);
        assert_eq!(again.dump(), hdr.dump());
        let slot0 = &again.dump()["keyslots"][0];
        let offset = slot0["key_material_offset_sectors"].as_u64().unwrap() * 512;
        let area_len = (key_bytes * 4000) as u64;
        let mut area = vec![1u8; area_len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut area, offset).unwrap();
        assert!(
            area.iter().all(|&b| b == 0),
            "removed keyslot material must be wiped"
        );
    }
}

#[test]
fn our_dump_text_matches_cryptsetup_layout() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = cs_format(dir.path(), "aes-xts-plain64", "512", "sha256");
    let (hdr, _) = Luks1Header::read(&open_rw(&img)).unwrap();
    let ours = hdr.dump_text();
    let theirs = run("cryptsetup", &["luksDump", s(&img)]);
    // Everything after the first line (which names the file) is identical.
    let skip_first = |t: &str| {
        t.lines()
            .skip(1)
            .map(str::trim_end)
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(skip_first(&ours).trim(), skip_first(&theirs).trim());
}

#[test]
fn refuses_argon2_and_wrong_volume_key() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = cs_format(dir.path(), "aes-xts-plain64", "256", "sha256");
    let f = open_rw(&img);
    let (mut hdr, _) = Luks1Header::read(&f).unwrap();
    let argon = PbkdfOptions {
        force_iterations: Some(4),
        memory_kib: 32,
        parallel: 1,
        ..PbkdfOptions::default()
    };
    let vk = hdr
        .unlock(&f, b"first passphrase", &UnlockOptions::default())
        .unwrap()
        .1;
    let e = hdr
        .add_keyslot(&f, &vk, b"x", None, &argon)
        .unwrap_err()
        .to_string();
    assert!(e.contains("PBKDF2"), "{e}");
    let e = hdr
        .add_keyslot(
            &f,
            &SecretKey::random(32).unwrap(),
            b"x",
            None,
            &PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000),
        )
        .unwrap_err();
    assert!(matches!(e, LuksError::InvalidArgument(_)), "{e}");
    assert!(
        hdr.add_keyslot(
            &f,
            &vk,
            b"x",
            Some(0),
            &PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000)
        )
        .is_err(),
        "slot 0 is in use"
    );
    assert!(hdr
        .add_keyslot(
            &f,
            &vk,
            b"x",
            Some(8),
            &PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000)
        )
        .is_err());
    assert_eq!(hdr.active_keyslots(), vec![0]);
}

#[test]
fn truncated_image_reports_truncation_not_wrong_passphrase() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = cs_format(dir.path(), "aes-xts-plain64", "256", "sha256");
    let passphrase = std::fs::read(&key).unwrap();
    let f = open_rw(&img);
    // The header stays whole; the keyslot material it points at is cut off.
    f.set_len(4096).unwrap();
    let (hdr, _) = Luks1Header::read(&f).unwrap();
    let e = hdr
        .unlock(&f, &passphrase, &UnlockOptions::default())
        .unwrap_err();
    assert!(matches!(e, LuksError::Truncated(_)), "{e}");
    f.set_len(300).unwrap();
    assert!(matches!(
        Luks1Header::read(&f),
        Err(LuksError::Truncated(_))
    ));
}
