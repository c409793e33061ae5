//! Hostile metadata with a *valid* checksum: validation, not the checksum, must refuse it and
//! name the field.
mod luks2_util;

use cryptblk_luks::luks2::binary::compute_checksum;
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{HashAlg, LuksError};
use luks2_util::*;
use std::fs::File;
use std::path::Path;

const HDR: u64 = 16384;

/// Replace the JSON of both copies, re-checksumming them.
fn rewrite_json(img: &Path, edit: &dyn Fn(&str) -> String) {
    for off in [0, HDR] {
        let mut area = read_range(img, off, HDR as usize);
        let end = 4096 + area[4096..].iter().position(|&b| b == 0).unwrap();
        let json = std::str::from_utf8(&area[4096..end]).unwrap().to_string();
        let new = edit(&json);
        assert_ne!(new, json, "edit did not apply");
        area[4096..].fill(0);
        area[4096..4096 + new.len()].copy_from_slice(new.as_bytes());
        let sum = compute_checksum(HashAlg::Sha256, &area).unwrap();
        area[448..448 + 64].copy_from_slice(&sum);
        write_range(img, off, &area);
    }
}

fn base_image(dir: &Path) -> std::path::PathBuf {
    let key = write_key(dir, "key", b"pw");
    cs_format(
        dir,
        20 << 20,
        &key,
        &[
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--sector-size",
            "4096",
        ],
    )
}

fn expect_refused(edit: &dyn Fn(&str) -> String, field: &str) {
    let dir = tempfile::tempdir().unwrap();
    let img = base_image(dir.path());
    rewrite_json(&img, edit);
    match Luks2Header::read(&File::open(&img).unwrap()) {
        Err(LuksError::Corrupt(msg)) => assert!(
            msg.contains(field),
            "error for {field} does not name it: {msg}"
        ),
        other => panic!("{field}: expected Corrupt, got {other:?}"),
    }
}

#[test]
fn rewrite_helper_keeps_a_valid_image_valid() {
    let dir = tempfile::tempdir().unwrap();
    let img = base_image(dir.path());
    rewrite_json(&img, &|j| j.replace("\"tokens\":{}", "\"tokens\":{ }"));
    let (h, warnings) = read(&img);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert!(unlock(&img, b"pw").is_ok());
    assert_eq!(h.active_keyslots(), vec![0]);
}

#[test]
fn keyslot_area_outside_keyslots_area() {
    expect_refused(
        &|j| j.replacen("\"offset\":\"32768\"", "\"offset\":\"4096\"", 1),
        "keyslots.0.area",
    );
    expect_refused(
        &|j| {
            j.replacen(
                "\"size\":\"258048\"",
                "\"size\":\"18446744073709551000\"",
                1,
            )
        },
        "keyslots.0.area",
    );
}

#[test]
fn segment_overlapping_the_header() {
    expect_refused(
        &|j| j.replace("\"offset\":\"16777216\"", "\"offset\":\"0\""),
        "segments.0.offset",
    );
}

#[test]
fn bad_sector_size() {
    expect_refused(
        &|j| j.replace("\"sector_size\":4096", "\"sector_size\":1000"),
        "segments.0.sector_size",
    );
    expect_refused(
        &|j| j.replace("\"sector_size\":4096", "\"sector_size\":8192"),
        "segments.0.sector_size",
    );
}

#[test]
fn bad_base64_and_numbers() {
    expect_refused(
        &|j| j.replacen("\"salt\":\"", "\"salt\":\"!!", 1),
        "keyslots.0.kdf.salt",
    );
    expect_refused(
        &|j| j.replace("\"stripes\":4000", "\"stripes\":400000"),
        "keyslots.0.af.stripes",
    );
    expect_refused(
        &|j| j.replace("\"key_size\":64,\"af\"", "\"key_size\":0,\"af\""),
        "keyslots.0.key_size",
    );
    expect_refused(
        &|j| j.replace("\"keyslots_size\":\"16744448\"", "\"keyslots_size\":\"-1\""),
        "64-bit number",
    );
    expect_refused(
        &|j| j.replace("\"json_size\":\"12288\"", "\"json_size\":\"4096\""),
        "config.json_size",
    );
}

#[test]
fn dangling_references_and_bad_ids() {
    expect_refused(
        &|j| j.replace("\"keyslots\":[\"0\"]", "\"keyslots\":[\"9\"]"),
        "digests.0.keyslots",
    );
    expect_refused(
        &|j| j.replace("\"keyslots\":{\"0\":", "\"keyslots\":{\"99\":"),
        "keyslot id '99'",
    );
    expect_refused(
        &|j| {
            j.replace(
                "\"type\":\"pbkdf2\",\"hash\"",
                "\"type\":\"scrypt\",\"hash\"",
            )
        },
        "keyslots.0.kdf.type",
    );
}

#[test]
fn not_json_at_all() {
    expect_refused(&|_| "{\"keyslots\":".to_string(), "invalid JSON");
}

/// Segments whose sector layout we do not implement are readable (dump works) but refused
/// when the data cipher is asked for, instead of silently decrypting garbage.
#[test]
fn integrity_and_iv_tweak_segments_are_refused_for_data() {
    let dir = tempfile::tempdir().unwrap();
    let img = base_image(dir.path());
    rewrite_json(&img, &|j| {
        j.replace(
            "\"sector_size\":4096",
            "\"sector_size\":4096,\"integrity\":{\"type\":\"hmac(sha256)\",\"journal_encryption\":\"none\",\"journal_integrity\":\"none\"}",
        )
    });
    let (h, _) = read(&img);
    let e = h.cipher_spec().unwrap_err().to_string();
    assert!(e.contains("integrity") && e.contains("hmac(sha256)"), "{e}");
    // Unknown fields are kept when the header is rewritten.
    let (mut h, _) = read(&img);
    let seqid = h.seqid();
    h.remove_keyslot(&open_rw(&img), 0).unwrap();
    let (h, _) = read(&img);
    assert_eq!(h.seqid(), seqid + 1);
    assert!(h.metadata().segments["0"].extra.contains_key("integrity"));

    let dir = tempfile::tempdir().unwrap();
    let img = base_image(dir.path());
    rewrite_json(&img, &|j| {
        j.replace("\"iv_tweak\":\"0\"", "\"iv_tweak\":\"8\"")
    });
    let (h, _) = read(&img);
    assert!(h
        .cipher_spec()
        .unwrap_err()
        .to_string()
        .contains("iv_tweak"));
}

#[test]
fn reencrypt_keyslot_without_area_is_read_only_not_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let img = base_image(dir.path());
    rewrite_json(&img, &|j| {
        j.replacen(
            "\"keyslots\":{",
            "\"keyslots\":{\"1\":{\"type\":\"reencrypt\",\"key_size\":1,\"area\":{\"type\":\"none\",\"offset\":\"0\",\"size\":\"0\"},\"mode\":\"reencrypt\",\"direction\":\"forward\"},",
            1,
        )
        .replace("\"keyslots_size\":\"16744448\"", "\"keyslots_size\":\"16744448\",\"requirements\":{\"mandatory\":[\"online-reencrypt-v2\"]}")
    });
    let (h, _) = read(&img);
    assert!(h
        .read_only_reason()
        .unwrap()
        .contains("online-reencrypt-v2"));
    assert_eq!(h.active_keyslots(), vec![0]);
}
