//! Damaged header copies and interrupted updates: the image stays usable from the good copy,
//! and the reader says which copy it used and why.
mod common_core;

use common_core::*;
use cryptblk_crypto::SecretKey;
use cryptblk_luks::luks2::binary::HeaderCopy;
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::LuksError;
use std::path::{Path, PathBuf};

const HDR: u64 = 16384;

fn formatted(dir: &Path) -> (PathBuf, SecretKey) {
    let img = dir.join("img");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&img)
        .unwrap();
    let vk = SecretKey::random(64).unwrap();
    Luks2Header::format(
        &file,
        &format_opts("aes-xts-plain64", 64, 4096),
        b"old",
        &vk,
        Some(1 << 20),
    )
    .unwrap();
    (img, vk)
}

#[test]
fn damaged_primary_json_falls_back_to_secondary() {
    let dir = tempfile::tempdir().unwrap();
    let (img, vk) = formatted(dir.path());
    flip(&img, 4096 + 20);
    let (h, warnings) = read(&img);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("primary header damaged (checksum mismatch)"),
        "{warnings:?}"
    );
    assert!(warnings[0].contains("secondary copy"), "{warnings:?}");
    assert_eq!(unlock(&img, b"old").unwrap().1.as_bytes(), vk.as_bytes());

    // The next update rewrites both copies, repairing the primary.
    let mut h = h;
    h.add_keyslot(&open_rw(&img), &vk, b"new", None, &cheap_argon())
        .unwrap();
    let (_, warnings) = read(&img);
    assert!(warnings.is_empty(), "{warnings:?}");
    run("cryptsetup", &["luksDump", s(&img)]);
}

#[test]
fn destroyed_primary_magic_finds_secondary_by_probing() {
    let dir = tempfile::tempdir().unwrap();
    let (img, vk) = formatted(dir.path());
    write_range(&img, 0, &[0u8; 4096]);
    let (_, warnings) = read(&img);
    assert!(
        warnings[0].contains("primary header damaged"),
        "{warnings:?}"
    );
    assert_eq!(unlock(&img, b"old").unwrap().1.as_bytes(), vk.as_bytes());
}

#[test]
fn damaged_secondary_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = formatted(dir.path());
    flip(&img, HDR + 4096 + 30);
    let (_, warnings) = read(&img);
    assert_eq!(
        warnings,
        vec!["secondary header damaged (checksum mismatch), using the primary copy".to_string()]
    );
}

#[test]
fn both_copies_damaged_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = formatted(dir.path());
    flip(&img, 4096 + 20);
    flip(&img, HDR + 4096 + 20);
    match Luks2Header::read(&std::fs::File::open(&img).unwrap()) {
        Err(LuksError::Corrupt(msg)) => {
            assert!(msg.contains("primary header: checksum mismatch"), "{msg}");
            assert!(msg.contains("secondary header: checksum mismatch"), "{msg}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

#[test]
fn not_luks_and_luks1_are_not_called_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let zero = dir.path().join("zero");
    std::fs::write(&zero, vec![0u8; 1 << 20]).unwrap();
    assert!(matches!(
        Luks2Header::read(&std::fs::File::open(&zero).unwrap()),
        Err(LuksError::NotLuks(_))
    ));
    let key = write_key(dir.path(), "key", b"pw");
    let img = dir.path().join("img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    run(
        "cryptsetup",
        &[
            "luksFormat",
            "--type",
            "luks1",
            "--batch-mode",
            "--key-file",
            s(&key),
            "--iter-time",
            "1",
            s(&img),
        ],
    );
    match Luks2Header::read(&std::fs::File::open(&img).unwrap()) {
        Err(LuksError::NotLuks(msg)) => assert!(msg.contains("version 1"), "{msg}"),
        other => panic!("expected NotLuks, got {other:?}"),
    }
}

/// Crash after the primary copy of an update was written but before the secondary: the new
/// state wins (higher seqid) and both passphrases work.
#[test]
fn crash_between_primary_and_secondary_write_keeps_new_state() {
    let dir = tempfile::tempdir().unwrap();
    let (img, vk) = formatted(dir.path());
    let old_secondary = read_range(&img, HDR, HDR as usize);
    let (mut h, _) = read(&img);
    h.add_keyslot(&open_rw(&img), &vk, b"new", Some(4), &cheap_argon())
        .unwrap();
    write_range(&img, HDR, &old_secondary);

    let (h2, warnings) = read(&img);
    assert!(
        warnings[0].contains("secondary header is older"),
        "{warnings:?}"
    );
    assert_eq!(h2.active_keyslots(), vec![0, 4]);
    assert_eq!(unlock(&img, b"new").unwrap().0, 4);
    assert_eq!(unlock(&img, b"old").unwrap().0, 0);
    let k = write_key(dir.path(), "k", b"new");
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
}

/// Crash while the primary copy was being written (torn, checksum fails), secondary still old:
/// the old state is used; the half-added keyslot is simply not there.
#[test]
fn torn_primary_write_keeps_old_state() {
    let dir = tempfile::tempdir().unwrap();
    let (img, vk) = formatted(dir.path());
    let old_primary = read_range(&img, 0, HDR as usize);
    let old_secondary = read_range(&img, HDR, HDR as usize);
    let (mut h, _) = read(&img);
    h.add_keyslot(&open_rw(&img), &vk, b"new", Some(4), &cheap_argon())
        .unwrap();
    let new_primary = read_range(&img, 0, HDR as usize);
    // First 4 KiB of the new primary reached the disk, the rest is still the old copy.
    let mut torn = old_primary.clone();
    torn[..4096].copy_from_slice(&new_primary[..4096]);
    write_range(&img, 0, &torn);
    write_range(&img, HDR, &old_secondary);

    let (h2, warnings) = read(&img);
    assert!(
        warnings[0].contains("primary header damaged (checksum mismatch)"),
        "{warnings:?}"
    );
    assert_eq!(h2.active_keyslots(), vec![0]);
    assert_eq!(unlock(&img, b"old").unwrap().1.as_bytes(), vk.as_bytes());
    assert!(matches!(
        unlock(&img, b"new"),
        Err(LuksError::WrongPassphrase)
    ));
}

/// The test-only hook writes exactly one copy, as an interrupted commit would leave it.
#[test]
fn single_copy_write_hook_matches_commit_order() {
    let dir = tempfile::tempdir().unwrap();
    let (img, _) = formatted(dir.path());
    let (h, _) = read(&img);
    let before = read_range(&img, HDR, HDR as usize);
    h.write_copy(&open_rw(&img), HeaderCopy::Primary).unwrap();
    assert_eq!(
        read_range(&img, HDR, HDR as usize),
        before,
        "secondary touched by a primary-only write"
    );
    let (h2, warnings) = read(&img);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(h2.seqid(), h.seqid());
}

/// A secondary copy left over from another header must not override the primary even with a
/// higher seqid.
#[test]
fn foreign_secondary_never_wins() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = formatted(dir.path());
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    let (b, vk_b) = formatted(&other);
    // Give b a higher seqid, then plant b's secondary into a.
    let (mut hb, _) = read(&b);
    hb.add_keyslot(&open_rw(&b), &vk_b, b"x", None, &cheap_argon())
        .unwrap();
    write_range(&a, HDR, &read_range(&b, HDR, HDR as usize));
    let (ha, warnings) = read(&a);
    assert!(
        warnings[0].contains("belongs to another header"),
        "{warnings:?}"
    );
    assert_eq!(ha.active_keyslots(), vec![0]);
    assert_ne!(ha.uuid(), hb.uuid());
}

/// Crash after a new keyslot's material was written but before the header named it: the image
/// is unchanged for readers, and the area is simply reused by the next keyslot.
#[test]
fn crash_before_header_leaves_only_unreferenced_material() {
    let dir = tempfile::tempdir().unwrap();
    let (img, vk) = formatted(dir.path());
    let (mut h, _) = read(&img);
    let a0 = h.metadata().keyslots["0"].area.clone();
    let next = a0.offset + a0.size;
    write_range(&img, next, &vec![0xa5u8; 258048]);
    let seqid = h.seqid();
    let (h2, warnings) = read(&img);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!((h2.seqid(), h2.active_keyslots()), (seqid, vec![0]));
    assert_eq!(
        h.add_keyslot(&open_rw(&img), &vk, b"new", None, &cheap_argon())
            .unwrap(),
        1
    );
    assert_eq!(h.metadata().keyslots["1"].area.offset, next);
    assert_eq!(unlock(&img, b"new").unwrap().0, 1);
}

/// Crash during removal after the header was committed but before the area was wiped: the
/// removed passphrase no longer opens anything, because no header references the area.
#[test]
fn crash_before_wipe_still_removes_the_keyslot() {
    let dir = tempfile::tempdir().unwrap();
    let (img, vk) = formatted(dir.path());
    let (mut h, _) = read(&img);
    h.add_keyslot(&open_rw(&img), &vk, b"second", Some(2), &cheap_argon())
        .unwrap();
    let area = h.metadata().keyslots["2"].area.clone();
    let material = read_range(&img, area.offset, area.size as usize);
    h.remove_keyslot(&open_rw(&img), 2).unwrap();
    write_range(&img, area.offset, &material);
    assert!(matches!(
        unlock(&img, b"second"),
        Err(LuksError::WrongPassphrase)
    ));
    assert_eq!(unlock(&img, b"old").unwrap().0, 0);
}
