//! A decryption cryptsetup 2.7 started (`reencrypt --decrypt --header FILE --init-only`): the
//! exported header opens as a detached header only, its reencryption digest (version 3)
//! verifies with the passphrase, the volume reads back through the header and the image, and
//! reencryption metadata edited behind the digest's back (with valid header checksums) is
//! refused.
mod common_core;

use common_core::*;
use cryptblk_crypto::{default_engine_for, CipherSpec, CryptoPool, Direction, SecretKey};
use cryptblk_luks::luks2::reencrypt::{
    ReencryptDirection, ReencryptMode, Reencryption, Resilience,
};
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{HashAlg, LuksError, UnlockOptions};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

const PASS: &[u8] = b"decrypt me";
/// cryptsetup's default data offset: the header and keyslots area of the image.
const D: u64 = 16 << 20;
const IMAGE: u64 = 64 << 20;

/// A LUKS2 image (4096-byte sectors, aes-xts 512 bits) whose volume holds `plain`.
fn image(dir: &Path, key: &Path, plain: &[u8]) -> PathBuf {
    let img = cs_format(
        dir,
        IMAGE,
        key,
        &[
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--sector-size",
            "4096",
            "--key-size",
            "512",
        ],
    );
    let vk = SecretKey::new(cryptsetup_volume_key(&img, key));
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    let mut ct = plain.to_vec();
    default_engine_for(&spec)
        .unwrap()
        .new_cipher(&spec, &vk, 4096)
        .unwrap()
        .crypt(Direction::Encrypt, 0, &mut ct)
        .unwrap();
    open_rw(&img).write_all_at(&ct, D).unwrap();
    img
}

/// `cryptsetup reencrypt --decrypt --header HDR --init-only` by 2.7: returns the header file.
fn init_by_cryptsetup27(dir: &Path, key: &Path, img: &Path, extra: &[&str]) -> PathBuf {
    let hdr = dir.join("img.hdr");
    let out = Command::new(cryptblk_testutil::cryptsetup27())
        .args(["reencrypt", "--decrypt", "--header", s(&hdr)])
        .args(["--force-offline-reencrypt", "--init-only", "--batch-mode"])
        .args(extra)
        .args(["--key-file", s(key), s(img)])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cryptsetup 2.7 --init-only failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    hdr
}

fn open<'a>(hdr_file: &'a File, img: &'a File) -> cryptblk_luks::Result<Reencryption<'a>> {
    let (h, _) = Luks2Header::read_detached(hdr_file)?;
    Reencryption::open_detached(
        hdr_file,
        img,
        h,
        PASS,
        &UnlockOptions::default(),
        None,
        Arc::new(CryptoPool::new(2)),
    )
}

#[test]
fn cryptsetup27_init_only_header_opens_detached_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let key = write_key(dir.path(), "key", PASS);
    let plain: Vec<u8> = (0..IMAGE - D).map(|i| (i ^ (i >> 13)) as u8).collect();
    let img = image(dir.path(), &key, &plain);
    let hdr = init_by_cryptsetup27(dir.path(), &key, &img, &[]);
    let hdr_file = File::open(&hdr).unwrap();

    // Read as an attached header it is refused, and the error says what it is.
    match Luks2Header::read(&hdr_file) {
        Err(LuksError::Corrupt(msg)) => assert!(
            msg.contains("segments.0.offset") && msg.contains("detached header"),
            "the attached read's refusal does not say the header is detached: {msg}"
        ),
        other => panic!("a detached header read as attached: {other:?}"),
    }

    let (h, _) = Luks2Header::read_detached(&hdr_file).unwrap();
    assert!(h.is_detached());
    let st = h.reencrypt_state().unwrap().unwrap();
    assert_eq!(st.version, 3);
    assert_eq!(st.mode, ReencryptMode::Decrypt);
    assert_eq!(st.direction, ReencryptDirection::Forward);
    assert_eq!(
        st.resilience,
        Resilience::DatashiftChecksum {
            shift: D,
            hash: HashAlg::Sha256,
            block_size: 4096
        }
    );
    assert!(st.segment_moved.is_some());
    assert!(st.digest_new.is_none(), "a decryption has no new key");

    // The digest verifies with the passphrase, and the volume reads back: its first
    // moved_len bytes from the copy at offset 0, the rest from where they were.
    let img_ro = File::open(&img).unwrap();
    let r = open(&hdr_file, &img_ro).unwrap();
    assert_eq!(r.device_size().unwrap(), IMAGE - D);
    assert_eq!(r.done_bytes().unwrap(), 0);
    let mut buf = vec![0u8; plain.len()];
    r.read(0, &mut buf).unwrap();
    assert!(
        buf == plain,
        "the volume read through the detached header differs"
    );
    drop(r);

    // An attached open of the detached header is refused (its offsets are not the header
    // file's).
    let (h, _) = Luks2Header::read_detached(&hdr_file).unwrap();
    assert!(matches!(
        Reencryption::open(
            &hdr_file,
            h,
            PASS,
            &UnlockOptions::default(),
            None,
            Arc::new(CryptoPool::new(1))
        ),
        Err(LuksError::InvalidArgument(_))
    ));

    // A wrong passphrase opens nothing.
    let (h, _) = Luks2Header::read_detached(&hdr_file).unwrap();
    let wrong = Reencryption::open_detached(
        &hdr_file,
        &img_ro,
        h,
        b"not it",
        &UnlockOptions::default(),
        None,
        Arc::new(CryptoPool::new(1)),
    );
    assert!(
        matches!(wrong, Err(LuksError::WrongPassphrase)),
        "{:?}",
        wrong.err()
    );
}

#[test]
fn edited_reencryption_metadata_fails_the_v3_digest() {
    let dir = tempfile::tempdir().unwrap();
    let key = write_key(dir.path(), "key", PASS);
    let plain = vec![0x5au8; (IMAGE - D) as usize];
    let img = image(dir.path(), &key, &plain);
    let hdr = init_by_cryptsetup27(dir.path(), &key, &img, &[]);
    let img_ro = File::open(&img).unwrap();
    let pristine = std::fs::read(&hdr).unwrap();

    // A smaller data shift (which would read the wrong ciphertext), and the requirement
    // version the digest covers (v2 instead of v3): both keep valid header checksums.
    let edits: [(&str, &str); 2] = [
        ("\"shift_size\":\"16777216\"", "\"shift_size\":\"8388608\""),
        ("online-reencrypt-v3", "online-reencrypt-v2"),
    ];
    for (from, to) in edits {
        std::fs::write(&hdr, &pristine).unwrap();
        rewrite_json(&hdr, &|j| j.replace(from, to));
        let hdr_file = File::open(&hdr).unwrap();
        match open(&hdr_file, &img_ro) {
            Err(LuksError::Corrupt(msg)) => assert!(
                msg.contains("reencryption digest does not match"),
                "{to}: the refusal does not name the digest: {msg}"
            ),
            Err(other) => panic!("{to}: refused for another reason: {other}"),
            Ok(_) => panic!("{to}: edited reencryption metadata was accepted"),
        }
    }
}

#[test]
fn cryptsetup27_journal_header_opens_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let key = write_key(dir.path(), "key", PASS);
    let plain: Vec<u8> = (0..IMAGE - D).map(|i| (i * 3 + (i >> 17)) as u8).collect();
    let img = image(dir.path(), &key, &plain);
    // The journal holds the moved segment itself: with the default 16 MiB data offset the
    // free keyslots area is a little short of it, so 2.7 (like cryptblk) needs a smaller one.
    let hdr = init_by_cryptsetup27(
        dir.path(),
        &key,
        &img,
        &["--resilience", "journal", "--hotzone-size", "8M"],
    );
    let hdr_file = File::open(&hdr).unwrap();
    let (h, _) = Luks2Header::read_detached(&hdr_file).unwrap();
    let st = h.reencrypt_state().unwrap().unwrap();
    assert_eq!(st.resilience, Resilience::DatashiftJournal { shift: D });
    let img_ro = File::open(&img).unwrap();
    let r = open(&hdr_file, &img_ro).unwrap();
    let mut buf = vec![0u8; plain.len()];
    r.read(0, &mut buf).unwrap();
    assert!(
        buf == plain,
        "the volume read through 2.7's journal header differs"
    );
}
