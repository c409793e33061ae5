//! Images made by the real `cryptsetup luksFormat --type luks2` unlock with cryptblk, giving
//! the volume key cryptsetup itself reports.
mod common_core;

use common_core::*;
use cryptblk_luks::{LuksError, UnlockOptions};
use std::fs::File;

const SIZE: u64 = 32 << 20;

fn check(extra: &[&str], cipher: &str, key_bytes: usize, sector: u32) {
    let dir = tempfile::tempdir().unwrap();
    let key = write_key(dir.path(), "key", b"correct horse\n");
    let img = cs_format(dir.path(), SIZE, &key, extra);
    let expected = cryptsetup_volume_key(&img, &key);

    let (h, warnings) = read(&img);
    assert!(warnings.is_empty(), "{warnings:?}");
    let (slot, vk) = unlock(&img, b"correct horse\n").unwrap_or_else(|e| panic!("{extra:?}: {e}"));
    assert_eq!(slot, 0);
    assert_eq!(vk.as_bytes(), &expected[..], "{extra:?}");
    h.verify_volume_key(&vk).unwrap();

    let spec = h.cipher_spec().unwrap();
    assert_eq!(spec.to_luks2_string(), cipher);
    assert_eq!(spec.key_bytes(), key_bytes);
    assert_eq!(h.sector_size(), sector);
    assert_eq!(h.data_offset(), 16 << 20);
    assert_eq!(h.data_size(SIZE).unwrap(), SIZE - (16 << 20));
    assert!(matches!(h.data_size(1 << 20), Err(LuksError::Truncated(_))));
    assert_eq!(h.active_keyslots(), vec![0]);
    assert_eq!(h.read_only_reason(), None);

    // A trailing-newline difference is a different passphrase.
    assert!(matches!(
        unlock(&img, b"correct horse"),
        Err(LuksError::WrongPassphrase)
    ));
}

#[test]
fn argon2id_sector_4096_xts_512() {
    check(
        &[
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "32",
            "--pbkdf-force-iterations",
            "4",
            "--sector-size",
            "4096",
        ],
        "aes-xts-plain64",
        64,
        4096,
    );
}

#[test]
fn argon2i_sector_512() {
    check(
        &[
            "--pbkdf",
            "argon2i",
            "--pbkdf-memory",
            "64",
            "--pbkdf-force-iterations",
            "4",
            "--sector-size",
            "512",
        ],
        "aes-xts-plain64",
        64,
        512,
    );
}

#[test]
fn pbkdf2_hashes() {
    for hash in ["sha1", "sha256", "sha512"] {
        check(
            &[
                "--pbkdf",
                "pbkdf2",
                "--pbkdf-force-iterations",
                "1000",
                "--hash",
                hash,
                "--sector-size",
                "4096",
            ],
            "aes-xts-plain64",
            64,
            4096,
        );
    }
}

#[test]
fn xts_256_bit_key() {
    check(
        &[
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-size",
            "256",
            "--sector-size",
            "512",
        ],
        "aes-xts-plain64",
        32,
        512,
    );
}

#[test]
fn cbc_essiv() {
    check(
        &[
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--cipher",
            "aes-cbc-essiv:sha256",
            "--key-size",
            "256",
            "--sector-size",
            "512",
        ],
        "aes-cbc-essiv:sha256",
        32,
        512,
    );
}

#[test]
fn keyslots_with_gaps_and_unbound_slot() {
    let dir = tempfile::tempdir().unwrap();
    let k1 = write_key(dir.path(), "k1", b"first");
    let k5 = write_key(dir.path(), "k5", b"fifth");
    let k7 = write_key(dir.path(), "k7", b"seventh");
    let ku = write_key(dir.path(), "ku", b"unbound");
    let cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
    let img = cs_format(dir.path(), SIZE, &k1, &cheap);
    for (slot, k) in [("5", &k5), ("7", &k7)] {
        let mut args = vec![
            "luksAddKey",
            "--batch-mode",
            "--key-file",
            s(&k1),
            "--key-slot",
            slot,
        ];
        args.extend_from_slice(&cheap);
        args.extend_from_slice(&[s(&img), s(k)]);
        run("cryptsetup", &args);
    }
    let mut args = vec![
        "luksAddKey",
        "--batch-mode",
        "--unbound",
        "--key-size",
        "512",
    ];
    args.extend_from_slice(&cheap);
    args.extend_from_slice(&[s(&img), s(&ku)]);
    run("cryptsetup", &args);

    let expected = cryptsetup_volume_key(&img, &k1);
    let (h, _) = read(&img);
    assert_eq!(h.active_keyslots(), vec![0, 1, 5, 7]);
    for (pass, slot) in [(&b"first"[..], 0), (b"fifth", 5), (b"seventh", 7)] {
        let (got, vk) = unlock(&img, pass).unwrap();
        assert_eq!(got, slot);
        assert_eq!(vk.as_bytes(), &expected[..]);
    }
    // The unbound slot (1) holds some other key: it must not unlock the data segment.
    assert!(matches!(
        unlock(&img, b"unbound"),
        Err(LuksError::WrongPassphrase)
    ));
}

#[test]
fn argon2_memory_limit_is_enforced_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let key = write_key(dir.path(), "key", b"pw");
    let img = cs_format(
        dir.path(),
        SIZE,
        &key,
        &[
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "65536",
            "--pbkdf-force-iterations",
            "4",
        ],
    );
    let (h, _) = read(&img);
    let limit = UnlockOptions {
        max_pbkdf_memory_kib: 1024,
        ..UnlockOptions::default()
    };
    match h.unlock(&File::open(&img).unwrap(), b"pw", &limit) {
        Err(LuksError::PbkdfMemoryLimit {
            slot: 0,
            needed_kib: 65536,
            limit_kib: 1024,
        }) => {}
        other => panic!("expected a memory-limit error, got {other:?}"),
    }
    assert!(h
        .unlock(&File::open(&img).unwrap(), b"pw", &UnlockOptions::default())
        .is_ok());
}

#[test]
fn dump_describes_the_header_without_key_material() {
    let dir = tempfile::tempdir().unwrap();
    let key = write_key(dir.path(), "key", b"pw");
    let img = cs_format(
        dir.path(),
        SIZE,
        &key,
        &[
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--label",
            "mylabel",
            "--sector-size",
            "4096",
        ],
    );
    let vk = cryptsetup_volume_key(&img, &key);
    let (h, _) = read(&img);
    assert_eq!(h.label(), Some("mylabel"));
    let d = h.dump();
    assert_eq!(d["version"], 2);
    assert_eq!(d["label"], "mylabel");
    assert_eq!(d["uuid"], h.uuid());
    assert_eq!(d["metadata_area"], 16384);
    assert_eq!(d["keyslots_area"], 16744448);
    assert_eq!(d["segments"][0]["cipher"], "aes-xts-plain64");
    assert_eq!(d["segments"][0]["sector_size"], 4096);
    assert_eq!(d["keyslots"][0]["key_bits"], 512);
    assert_eq!(d["keyslots"][0]["pbkdf"], "pbkdf2");
    assert_eq!(d["keyslots"][0]["iterations"], 1000);
    assert_eq!(d["keyslots"][0]["af_stripes"], 4000);
    assert_eq!(d["keyslots"][0]["area_offset"], 32768);
    assert_eq!(d["keyslots"][0]["area_length"], 258048);
    assert_eq!(d["digests"][0]["keyslots"][0], "0");
    assert_eq!(d["tokens"], serde_json::json!([]));
    let text = d.to_string().to_ascii_lowercase();
    let vk_hex: String = vk.iter().map(|b| format!("{b:02x}")).collect();
    assert!(!text.contains(&vk_hex[..16]), "dump leaks the volume key");
}

#[test]
fn larger_metadata_area_and_keyslot_priorities() {
    let dir = tempfile::tempdir().unwrap();
    let k0 = write_key(dir.path(), "k0", b"zero");
    let k2 = write_key(dir.path(), "k2", b"two");
    let cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
    let mut extra = vec![
        "--luks2-metadata-size",
        "64k",
        "--luks2-keyslots-size",
        "2m",
    ];
    extra.extend_from_slice(&cheap);
    let img = cs_format(dir.path(), SIZE, &k0, &extra);
    let mut args = vec![
        "luksAddKey",
        "--batch-mode",
        "--key-file",
        s(&k0),
        "--key-slot",
        "2",
    ];
    args.extend_from_slice(&cheap);
    args.extend_from_slice(&[s(&img), s(&k2)]);
    run("cryptsetup", &args);
    run(
        "cryptsetup",
        &["config", "--priority", "ignore", "--key-slot", "0", s(&img)],
    );
    run(
        "cryptsetup",
        &["config", "--priority", "prefer", "--key-slot", "2", s(&img)],
    );
    // cryptsetup itself skips "ignored" slots unless asked for one by number.
    let expected = cryptsetup_volume_key(&img, &k2);

    let (mut h, warnings) = read(&img);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(h.hdr_size(), 65536);
    assert_eq!(h.data_offset(), 3 << 20);
    assert_eq!(h.dump()["keyslots"][0]["priority"], "ignored");
    assert_eq!(h.dump()["keyslots"][1]["priority"], "preferred");
    // An "ignored" slot is still tried, last.
    assert_eq!(
        unlock(&img, b"zero").unwrap(),
        (0, cryptblk_crypto::SecretKey::new(expected.clone()))
    );
    assert_eq!(unlock(&img, b"two").unwrap().0, 2);

    // Modifying keeps the 64 KiB copies and the priorities; cryptsetup still agrees.
    let file = open_rw(&img);
    let vk = cryptblk_crypto::SecretKey::new(expected.clone());
    let id = h
        .add_keyslot(&file, &vk, b"new", None, &cheap_argon())
        .unwrap();
    assert_eq!(id, 1);
    let dump = run("cryptsetup", &["luksDump", s(&img)]);
    assert!(dump.contains("Metadata area: \t65536"), "{dump}");
    assert!(dump.contains("Priority:   ignored"), "{dump}");
    let k1 = write_key(dir.path(), "k1", b"new");
    assert_eq!(cryptsetup_volume_key(&img, &k1), expected);

    // With the primary destroyed the 64 KiB secondary is found by probing.
    write_range(&img, 0, &[0u8; 4096]);
    let (h2, warnings) = read(&img);
    assert!(
        warnings[0].contains("primary header damaged"),
        "{warnings:?}"
    );
    assert_eq!(h2.active_keyslots(), vec![0, 1, 2]);
}
