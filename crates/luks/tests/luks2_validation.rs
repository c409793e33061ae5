//! Hostile metadata with a *valid* checksum: validation, not the checksum, must refuse it and
//! name the field.
mod common_core;

use common_core::*;
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::LuksError;
use std::fs::File;
use std::path::Path;

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

/// Random edits of the JSON text with a correct checksum (so they reach the parser and the
/// validator, unlike random byte flips): every result is an error or a header whose accessors
/// all work without panicking.
#[test]
fn mutated_json_with_valid_checksum_never_panics() {
    use rand::{Rng, SeedableRng};
    let dir = tempfile::tempdir().unwrap();
    let img = base_image(dir.path());
    let pristine = read_range(&img, 0, 2 * HDR as usize);
    let tokens = [
        "0",
        "9",
        "\"",
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        "-1",
        "null",
        "18446744073709551615",
        "\"dynamic\"",
        "4294967296",
        "\"\"",
        "\"0\"",
        "1e9",
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x1u64 << 40 | 2);
    let (mut accepted, mut refused) = (0, 0);
    for _ in 0..400 {
        write_range(&img, 0, &pristine);
        let pos_frac: f64 = rng.gen();
        let tok = tokens[rng.gen_range(0..tokens.len())];
        let cut = rng.gen_range(0..4usize);
        rewrite_json(&img, &|j| {
            let mut pos = (pos_frac * j.len() as f64) as usize;
            while !j.is_char_boundary(pos) {
                pos -= 1;
            }
            let end = (pos + cut).min(j.len());
            let mut out = String::with_capacity(j.len() + tok.len());
            out.push_str(&j[..pos]);
            out.push_str(tok);
            out.push_str(&j[end..]);
            if out == j {
                out.push(' ');
            }
            out
        });
        match Luks2Header::read(&File::open(&img).unwrap()) {
            Ok((h, _)) => {
                accepted += 1;
                let _ = h.cipher_spec();
                let _ = h.data_size(20 << 20);
                let _ = h.data_size(0);
                let _ = (
                    h.sector_size(),
                    h.data_offset(),
                    h.active_keyslots(),
                    h.read_only_reason(),
                );
                let _ = h.dump().to_string();
            }
            Err(LuksError::Corrupt(_)) => refused += 1,
            Err(e) => panic!("unexpected error kind: {e:?}"),
        }
    }
    // Both outcomes must occur or the mutation is not reaching the validator.
    assert!(
        accepted > 0 && refused > 0,
        "accepted {accepted}, refused {refused}"
    );
}

#[test]
fn truncated_and_fuzzed_headers_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    // cryptsetup's LUKS2 header: both copies in the first 32 KiB (16 KiB metadata areas).
    let img = base_image(dir.path());
    let orig = read_range(&img, 0, 32768);
    let f = dir.path().join("f");
    // Flip every 97th byte of the header area (one at a time): each read must be Ok or Err.
    for off in (0..32768).step_by(97) {
        let mut b = orig.clone();
        b[off] ^= 0xff;
        std::fs::write(&f, &b).unwrap();
        let _ = Luks2Header::read(&File::open(&f).unwrap());
    }
    for len in [0usize, 10, 4096, 10000] {
        std::fs::write(&f, &orig[..len]).unwrap();
        assert!(
            Luks2Header::read(&File::open(&f).unwrap()).is_err(),
            "len {len}"
        );
    }
    // The primary alone is enough to read the header, but not to use the data.
    for len in [16384usize, 20000] {
        std::fs::write(&f, &orig[..len]).unwrap();
        let (h, warnings) = Luks2Header::read(&File::open(&f).unwrap()).unwrap();
        assert!(
            warnings[0].starts_with("secondary header damaged"),
            "{warnings:?}"
        );
        assert!(matches!(
            h.data_size(len as u64),
            Err(LuksError::Truncated(_))
        ));
    }
}
