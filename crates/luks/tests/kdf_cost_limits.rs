//! Hostile KDF costs: a header naming an absurd PBKDF2 iteration count or argon2 cost is
//! refused before the KDF runs, instead of keeping unlock busy for hours.
use cryptblk_crypto::CipherSpec;
use cryptblk_luks::kdf::Argon2Variant;
use cryptblk_luks::luks2::binary::compute_checksum;
use cryptblk_luks::{
    FormatOptions, HashAlg, LuksError, LuksImage, LuksVersion, PbkdfKind, PbkdfOptions,
    UnlockOptions, DEFAULT_MAX_PBKDF2_ITERATIONS,
};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// Far more than a refusal needs, far less than running the hostile KDF would take.
const QUICK: Duration = Duration::from_secs(5);

/// LUKS1 phdr offsets: mk-digest iterations and keyslot i's iterations.
const LUKS1_MK_DIGEST_ITER: u64 = 164;
fn luks1_slot_iterations(slot: u64) -> u64 {
    208 + slot * 48 + 4
}

fn open_rw(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap()
}

fn format(path: &Path, version: LuksVersion, pbkdf: PbkdfOptions) -> LuksImage {
    let opts = FormatOptions {
        version,
        cipher: CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap(),
        hash: HashAlg::Sha256,
        pbkdf,
        sector_size: 512,
        label: None,
        uuid: None,
    };
    LuksImage::format(&open_rw(path), &opts, b"pw", Some(1 << 20))
        .unwrap()
        .0
}

fn argon2_4x32() -> PbkdfOptions {
    PbkdfOptions {
        kind: PbkdfKind::Argon2(Argon2Variant::Argon2id),
        hash: HashAlg::Sha256,
        force_iterations: Some(4),
        memory_kib: 32,
        parallel: 1,
        ..PbkdfOptions::default()
    }
}

fn put_be32(path: &Path, offset: u64, value: u32) {
    open_rw(path)
        .write_all_at(&value.to_be_bytes(), offset)
        .unwrap();
}

/// Edit the LUKS2 JSON of both header copies and re-seal their checksums, so only the
/// unlock-time limits (not the checksum) can refuse the result.
fn edit_luks2_json(path: &Path, edit: &dyn Fn(&mut serde_json::Value)) {
    let f = open_rw(path);
    let mut size = [0u8; 8];
    f.read_exact_at(&mut size, 8).unwrap();
    let hdr_size = u64::from_be_bytes(size);
    for off in [0, hdr_size] {
        let mut area = vec![0u8; hdr_size as usize];
        f.read_exact_at(&mut area, off).unwrap();
        let end = 4096 + area[4096..].iter().position(|&b| b == 0).unwrap();
        let mut json: serde_json::Value = serde_json::from_slice(&area[4096..end]).unwrap();
        edit(&mut json);
        let text = serde_json::to_vec(&json).unwrap();
        area[4096..].fill(0);
        area[4096..4096 + text.len()].copy_from_slice(&text);
        let sum = compute_checksum(HashAlg::Sha256, &area).unwrap();
        area[448..448 + 64].copy_from_slice(&sum);
        f.write_all_at(&area, off).unwrap();
    }
}

fn unlock(path: &Path, pass: &[u8], opts: &UnlockOptions) -> Result<usize, LuksError> {
    let f = File::open(path).unwrap();
    let (img, _) = LuksImage::read(&f).unwrap();
    img.unlock(&f, pass, opts).map(|(slot, _)| slot)
}

/// Unlock must fail fast with a cost-limit error naming `place`; returns (value, limit).
fn expect_cost_limit(path: &Path, opts: &UnlockOptions, place: &str, what: &str) -> (u64, u64) {
    let start = Instant::now();
    let got = unlock(path, b"pw", opts);
    assert!(
        start.elapsed() < QUICK,
        "refusal took {:?}",
        start.elapsed()
    );
    match got {
        Err(e @ LuksError::PbkdfCostLimit { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("--max-"),
                "message says how to raise it: {msg}"
            );
            let LuksError::PbkdfCostLimit {
                place: p,
                what: w,
                value,
                limit,
                ..
            } = e
            else {
                unreachable!()
            };
            assert_eq!(p, place);
            assert!(w.contains(what), "{w}");
            (value, limit)
        }
        other => panic!("expected PbkdfCostLimit for {place}, got {other:?}"),
    }
}

#[test]
fn luks1_huge_keyslot_iterations_are_refused_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("v1.img");
    format(
        &img,
        LuksVersion::V1,
        PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000),
    );
    put_be32(&img, luks1_slot_iterations(0), u32::MAX);
    let (value, limit) = expect_cost_limit(&img, &UnlockOptions::default(), "keyslot 0", "PBKDF2");
    assert_eq!(value, u64::from(u32::MAX));
    assert_eq!(limit, u64::from(DEFAULT_MAX_PBKDF2_ITERATIONS));
}

#[test]
fn luks1_limit_is_inclusive_and_other_keyslots_still_open() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("v1.img");
    let mut h = format(
        &img,
        LuksVersion::V1,
        PbkdfOptions {
            force_iterations: Some(2000),
            ..PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000)
        },
    );
    let f = open_rw(&img);
    let (_, vk) = h.unlock(&f, b"pw", &UnlockOptions::default()).unwrap();
    // Slot 1 (and the digest, with forced costs) need 1000 iterations, slot 0 needs 2000.
    assert_eq!(
        h.add_keyslot(
            &f,
            &vk,
            b"other",
            Some(1),
            &PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000)
        )
        .unwrap(),
        1
    );

    let at = |n| UnlockOptions {
        max_pbkdf2_iterations: n,
        ..UnlockOptions::default()
    };
    assert_eq!(unlock(&img, b"pw", &at(2000)).unwrap(), 0);
    let (value, limit) = expect_cost_limit(&img, &at(1999), "keyslot 0", "PBKDF2");
    assert_eq!((value, limit), (2000, 1999));
    // The refused slot does not block the others.
    assert_eq!(unlock(&img, b"other", &at(1999)).unwrap(), 1);
}

#[test]
fn luks1_huge_digest_iterations_are_refused_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("v1.img");
    format(
        &img,
        LuksVersion::V1,
        PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000),
    );
    put_be32(&img, LUKS1_MK_DIGEST_ITER, u32::MAX);
    expect_cost_limit(
        &img,
        &UnlockOptions::default(),
        "volume-key digest",
        "PBKDF2",
    );
}

#[test]
fn luks2_huge_pbkdf2_iterations_are_refused_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("v2.img");
    format(
        &img,
        LuksVersion::V2,
        PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000),
    );
    edit_luks2_json(&img, &|j| {
        j["keyslots"]["0"]["kdf"]["iterations"] = u32::MAX.into();
    });
    let (value, _) = expect_cost_limit(&img, &UnlockOptions::default(), "keyslot 0", "PBKDF2");
    assert_eq!(value, u64::from(u32::MAX));

    // Set back to a sane count, the same edit path yields an image that opens.
    edit_luks2_json(&img, &|j| {
        j["keyslots"]["0"]["kdf"]["iterations"] = 1000.into();
    });
    assert_eq!(unlock(&img, b"pw", &UnlockOptions::default()).unwrap(), 0);
}

#[test]
fn luks2_huge_digest_iterations_are_refused_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("v2.img");
    format(
        &img,
        LuksVersion::V2,
        PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000),
    );
    edit_luks2_json(&img, &|j| {
        j["digests"]["0"]["iterations"] = u32::MAX.into();
    });
    expect_cost_limit(
        &img,
        &UnlockOptions::default(),
        "keyslot 0 digest",
        "PBKDF2",
    );
}

#[test]
fn luks2_huge_argon2_time_is_refused_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("v2.img");
    format(&img, LuksVersion::V2, argon2_4x32());
    // 32 KiB x 4 passes = 128 KiB filled: the limit is on that product, inclusive.
    let at = |n| UnlockOptions {
        max_argon2_work_kib: n,
        ..UnlockOptions::default()
    };
    assert_eq!(unlock(&img, b"pw", &at(128)).unwrap(), 0);
    let (value, limit) = expect_cost_limit(&img, &at(127), "keyslot 0", "argon2");
    assert_eq!((value, limit), (128, 127));

    edit_luks2_json(&img, &|j| {
        j["keyslots"]["0"]["kdf"]["time"] = u32::MAX.into();
    });
    let (value, _) = expect_cost_limit(&img, &UnlockOptions::default(), "keyslot 0", "argon2");
    assert_eq!(value, u64::from(u32::MAX) * 32);
}
