//! cryptsetup's own LUKS2 test images: valid, odd and deliberately unsupported headers.
mod common_core;

use common_core::*;
use cryptblk_luks::{LuksError, UnlockOptions};
use cryptblk_testutil::corpus::Corpus;
use std::fs::File;

#[test]
fn compatimage2_unlocks_with_cryptsetups_volume_key() {
    let Some(corpus) = Corpus::find_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = corpus.unpack(dir.path(), "compatimage2.img.xz");
    let key = write_key(dir.path(), "key", b"compatkey");
    let expected = cryptsetup_volume_key(&img, &key);
    let (h, warnings) = read(&img);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        h.cipher_spec().unwrap().to_luks2_string(),
        "aes-cbc-essiv:sha256"
    );
    assert_eq!(h.cipher_spec().unwrap().key_bytes(), 16);
    let (slot, vk) = unlock(&img, b"compatkey").unwrap();
    assert_eq!(slot, 0);
    assert_eq!(vk.as_bytes(), &expected[..]);

    // Slot 1 is argon2id with 64 MiB: with slot 0 failing, the memory limit is what we report.
    let limit = UnlockOptions {
        max_pbkdf_memory_kib: 1024,
        ..UnlockOptions::default()
    };
    match h.unlock(&File::open(&img).unwrap(), b"not it", &limit) {
        Err(LuksError::PbkdfMemoryLimit {
            slot: 1,
            needed_kib: 65536,
            ..
        }) => {}
        other => panic!("expected the memory limit on slot 1, got {other:?}"),
    }
}

#[test]
fn valid_hdr_parses_with_eight_keyslots() {
    let Some(corpus) = Corpus::find_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = corpus.unpack(dir.path(), "luks2_valid_hdr.img.xz");
    let (h, warnings) = read(&img);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(h.active_keyslots(), (0..8).collect::<Vec<_>>());
    assert_eq!(h.data_offset(), 4194304);
    assert_eq!(h.sector_size(), 512);
    assert_eq!(
        h.cipher_spec().unwrap().to_luks2_string(),
        "aes-xts-plain64"
    );
    // Legacy "argon2" kdf type (= argon2i) is understood.
    assert_eq!(h.dump()["keyslots"][0]["pbkdf"], "argon2");
    assert_eq!(h.dump()["keyslots"].as_array().unwrap().len(), 8);
    assert!(matches!(
        unlock(&img, b"wrong"),
        Err(LuksError::WrongPassphrase)
    ));
}

#[test]
fn unassigned_keyslot_cannot_unlock_the_segment() {
    let Some(corpus) = Corpus::find_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = corpus.unpack(dir.path(), "luks2_keyslot_unassigned.img.xz");
    let (h, _) = read(&img);
    assert_eq!(h.active_keyslots(), vec![0, 1]);
    let d = h.dump();
    let digests = d["digests"].as_array().unwrap();
    let unbound = digests.iter().find(|d| d["keyslots"][0] == "1").unwrap();
    assert_eq!(unbound["segments"].as_array().unwrap().len(), 0);
    assert!(matches!(
        unlock(&img, b"wrong"),
        Err(LuksError::WrongPassphrase)
    ));
}

#[test]
fn invalid_cipher_is_refused_by_name() {
    let Some(corpus) = Corpus::find_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = corpus.unpack(dir.path(), "luks2_invalid_cipher.img.xz");
    let (h, _) = read(&img);
    let e = h.cipher_spec().unwrap_err();
    assert!(matches!(e, LuksError::Unsupported { .. }), "{e:?}");
    assert!(
        e.to_string().contains("capi:xts(ecb(aes-generic))-plain64"),
        "{e}"
    );
    // Adding a keyslot needs the segment cipher for the area and must fail the same way.
    let (mut h, _) = read(&img);
    let vk = cryptblk_crypto::SecretKey::random(32).unwrap();
    assert!(h
        .add_keyslot(&open_rw(&img), &vk, b"x", None, &cheap_argon())
        .is_err());
}

#[test]
fn unknown_requirements_make_the_image_read_only() {
    let Some(corpus) = Corpus::find_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = corpus.unpack(dir.path(), "luks2_header_requirements.tar.xz");
    let (mut h, _) = read(&img);
    let reason = h.read_only_reason().expect("requirements must be reported");
    assert!(
        reason.contains("req0") && reason.contains("req1"),
        "{reason}"
    );
    assert_eq!(h.dump()["requirements"][1], "req1");
    assert_eq!(h.dump()["tokens"].as_array().map(Vec::len), Some(3));
    let file = open_rw(&img);
    let before = read_range(&img, 0, 1 << 16);
    let unlock_err = h
        .unlock(&file, b"anything", &UnlockOptions::default())
        .unwrap_err();
    assert!(unlock_err.to_string().contains("req0"), "{unlock_err}");
    let vk = cryptblk_crypto::SecretKey::random(32).unwrap();
    assert!(h
        .add_keyslot(&file, &vk, b"x", None, &cheap_argon())
        .unwrap_err()
        .to_string()
        .contains("req0"));
    assert!(h
        .remove_keyslot(&file, 0)
        .unwrap_err()
        .to_string()
        .contains("req0"));
    assert_eq!(
        read_range(&img, 0, 1 << 16),
        before,
        "a refused operation wrote to the image"
    );

    let free = dir.path().join("luks2_header_requirements_free");
    let (h, _) = read(&free);
    assert_eq!(h.read_only_reason(), None);
    // Header-only image: the data segment starts exactly at the end of the file.
    assert_eq!(h.data_size(4194304).unwrap(), 0);
}

#[test]
fn tokens_and_unknown_fields_survive_a_rewrite() {
    let Some(corpus) = Corpus::find_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    corpus.unpack(dir.path(), "luks2_header_requirements.tar.xz");
    let free = dir.path().join("luks2_header_requirements_free");
    let (before, _) = read(&free);
    assert_eq!(before.metadata().tokens.len(), 3);
    // Removing keyslot 0 drops it from the tokens that named it, and keeps the tokens.
    let (mut h, _) = read(&free);
    h.remove_keyslot(&open_rw(&free), 0).unwrap();
    let (after, warnings) = read(&free);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(after.seqid(), before.seqid() + 1);
    let toks = &after.metadata().tokens;
    assert_eq!(toks.len(), 3);
    assert_eq!(toks["1"]["key_description"], "cs_token_test:test_key0");
    assert_eq!(toks["1"]["keyslots"].as_array().unwrap().len(), 0);
    assert!(after.active_keyslots().is_empty());
    run("cryptsetup", &["luksDump", s(&free)]);
}
