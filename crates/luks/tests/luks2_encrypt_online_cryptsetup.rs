//! An online-style encryption by cryptblk (the image of an `N`-byte plaintext disk grown by
//! `R`, hotzones smaller than the shift, the volume's size kept) handed over to cryptsetup:
//! stopped between two hotzones, or with a hotzone flagged by a crash inside it (one of the
//! small ones, or the moved part), cryptsetup (2.6, and 2.7 when built) recovers it
//! (`repair`, which completes the run when that was the last hotzone) and finishes it
//! (`reencrypt --resume-only`), and cryptsetup's volume key decrypts the original
//! plaintext. cryptsetup makes the final segment `dynamic` at its last hotzone, so a
//! hand-over ends with a volume of `N + R/2` bytes (the wiped moved copy joins it); a run
//! cryptblk finishes itself keeps `N`, and cryptsetup reads that header too.
mod common_core;

use common_core::*;
use cryptblk_crypto::{default_engine_for, CipherSpec, CryptoPool, Direction, SecretKey};
use cryptblk_luks::luks2::json::SegmentSize;
use cryptblk_luks::luks2::reencrypt::{encrypt_init, EncryptParams, Reencryption};
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{FormatOptions, HashAlg, HeaderIo, UnlockOptions};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

const PASS: &[u8] = b"online encrypt\n";
/// The guest's disk.
const N: u64 = 8 << 20;
/// `--reduce-device-size`: the image grows by it, the shift is half of it.
const R: u64 = 2 << 20;
const S: u64 = R / 2;
/// A quarter of the shift.
const HOTZONE: u64 = 256 << 10;

/// Where cryptblk leaves the encryption for cryptsetup.
#[derive(Debug, Clone, Copy)]
enum Stop {
    /// After this many hotzones, between two of them.
    Between(usize),
    /// Inside the hotzone after this many: its data write torn half-way, its segment flagged.
    InHotzone(usize),
    /// Inside the last hotzone (the moved part, volume `[0, S)`), torn half-way.
    InMovedHotzone,
}

/// A file whose write at `tear_at` stores only the first half and fails: a crash in the
/// middle of writing a hotzone's ciphertext.
struct Torn {
    file: File,
    tear_at: u64,
}

impl HeaderIo for Torn {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        HeaderIo::read_exact_at(&self.file, buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        if offset == self.tear_at {
            HeaderIo::write_all_at(&self.file, &buf[..buf.len() / 2], offset)?;
            return Err(std::io::Error::other("injected crash inside a hotzone"));
        }
        HeaderIo::write_all_at(&self.file, buf, offset)
    }
    fn size(&self) -> std::io::Result<u64> {
        HeaderIo::size(&self.file)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        HeaderIo::set_len(&self.file, len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        HeaderIo::sync_data(&self.file)
    }
}

fn plain() -> Vec<u8> {
    (0..N).map(|i| (i ^ (i >> 9) ^ (i >> 17)) as u8).collect()
}

/// Every cryptsetup to hand over to: 2.6 (required) and 2.7 when it has been built.
fn cryptsetups() -> Vec<PathBuf> {
    let mut all = vec![tool("cryptsetup")];
    let built = std::env::var_os("CRYPTSETUP27")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(cryptblk_testutil::DEFAULT_CRYPTSETUP27));
    if built.is_file() {
        all.push(cryptblk_testutil::cryptsetup27());
    }
    all
}

fn cs(bin: &Path, args: &[&str]) -> String {
    let out = Command::new(bin).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{} {args:?} failed ({}):\n{}{}",
        bin.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The grown plaintext image, in encryption: cryptblk's `encrypt_init`, then hotzones of
/// `HOTZONE` bytes with the size kept until `stop`.
fn cryptblk_run(dir: &Path, plain: &[u8], stop: Option<Stop>) -> PathBuf {
    let img = dir.join("disk");
    std::fs::write(&img, plain).unwrap();
    let file = open_rw(&img);
    file.set_len(N + R).unwrap();
    let mut format =
        FormatOptions::luks2(CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap(), 512);
    format.pbkdf = cheap_pbkdf2(HashAlg::Sha256);
    encrypt_init(&file, PASS, &EncryptParams { format, reduce: R }).unwrap();
    // A hotzone at volume offset v is written S bytes up.
    let tear_at = match stop {
        Some(Stop::InHotzone(k)) => N - (k as u64 + 1) * HOTZONE + S,
        Some(Stop::InMovedHotzone) => S,
        _ => u64::MAX,
    };
    let io = Torn {
        file: file.try_clone().unwrap(),
        tear_at,
    };
    let (hdr, _) = Luks2Header::read(&io).unwrap();
    let pool = Arc::new(CryptoPool::new(2));
    let mut r = Reencryption::open(&io, hdr, PASS, &UnlockOptions::default(), None, pool).unwrap();
    r.keep_volume_size().unwrap();
    let mut steps = 0;
    loop {
        if let Some(Stop::Between(k)) = stop {
            if steps == k {
                break;
            }
        }
        match r.step(HOTZONE) {
            Ok(rep) if rep.done >= rep.total => {
                assert!(stop.is_none(), "the run ended before {stop:?}");
                r.finish().unwrap();
                break;
            }
            Ok(_) => steps += 1,
            Err(e) => {
                assert!(e.to_string().contains("injected crash"), "{e}");
                break;
            }
        }
        assert_eq!(r.device_size().unwrap(), N);
    }
    img
}

/// The first `len` bytes of the finished volume, decrypted with the key cryptsetup recovers.
fn decrypt_by_cryptsetup_key(img: &Path, key: &Path, len: u64) -> Vec<u8> {
    let vk = SecretKey::new(cryptsetup_volume_key(img, key));
    let (h, _) = read(img);
    assert_eq!(h.data_offset(), S);
    let spec = h.cipher_spec().unwrap();
    let mut out = read_range(img, S, len as usize);
    default_engine_for(&spec)
        .unwrap()
        .new_cipher(&spec, &vk, 512)
        .unwrap()
        .crypt(Direction::Decrypt, 0, &mut out)
        .unwrap();
    out
}

fn hand_over(stop: Stop) {
    let plain = plain();
    for bin in cryptsetups() {
        let dir = tempfile::tempdir().unwrap();
        let key = write_key(dir.path(), "key", PASS);
        let img = cryptblk_run(dir.path(), &plain, Some(stop));
        let (h, _) = read(&img);
        let state = h.reencrypt_state().unwrap().unwrap();
        let flagged = state
            .hot_segment
            .as_ref()
            .map(|id| h.metadata().segments[id].size);
        match stop {
            Stop::Between(_) => assert_eq!(flagged, None),
            Stop::InHotzone(_) => assert_eq!(flagged, Some(SegmentSize::Fixed(HOTZONE))),
            Stop::InMovedHotzone => assert_eq!(flagged, Some(SegmentSize::Fixed(S))),
        }
        let what = format!("{stop:?} by {}", bin.display());
        if flagged.is_some() {
            // cryptsetup recovers a flagged hotzone only when asked to (`repair`), by the size
            // of its segment. Recovering the last one (the moved part) completes the run.
            cs(
                &bin,
                &["repair", "--batch-mode", "--key-file", s(&key), s(&img)],
            );
        }
        let (h, _) = read(&img);
        match (h.reencrypt_state().unwrap(), stop) {
            (None, Stop::InMovedHotzone) => {}
            (None, _) => panic!("{what}: finished before it was resumed"),
            (Some(state), _) => {
                assert_eq!(state.hot_segment, None, "{what}: still flagged");
                // cryptblk reads the state cryptsetup recovered (or cryptblk left).
                let file = File::open(&img).unwrap();
                let pool = Arc::new(CryptoPool::new(2));
                let r = Reencryption::open(&file, h, PASS, &UnlockOptions::default(), None, pool)
                    .unwrap();
                assert_eq!(r.device_size().unwrap(), N, "{what}");
                let mut buf = vec![0u8; N as usize];
                r.read(0, &mut buf).unwrap();
                assert!(buf == plain, "{what}: the volume reads back differently");
                drop(r);
                cs(
                    &bin,
                    &[
                        "reencrypt",
                        "--resume-only",
                        "--force-offline-reencrypt",
                        "--batch-mode",
                        "--key-file",
                        s(&key),
                        s(&img),
                    ],
                );
            }
        }
        let (h, _) = read(&img);
        assert!(
            h.reencrypt_state().unwrap().is_none(),
            "{what}: not finished"
        );
        // cryptsetup's last hotzone makes the volume run to the image's end.
        let seg = &h.metadata().segments["0"];
        assert_eq!(seg.size, SegmentSize::Dynamic, "{what}");
        let len = std::fs::metadata(&img).unwrap().len();
        assert_eq!(len, N + R, "{what}: the image changed size");
        assert_eq!(h.data_size(len).unwrap(), N + S, "{what}");
        let out = decrypt_by_cryptsetup_key(&img, &key, N);
        assert!(out == plain, "{what}: decrypted volume differs");
    }
}

#[test]
fn cryptsetup_finishes_a_run_stopped_between_small_hotzones() {
    hand_over(Stop::Between(5));
}

#[test]
fn cryptsetup_recovers_a_small_flagged_hotzone_and_finishes() {
    hand_over(Stop::InHotzone(5));
}

#[test]
fn cryptsetup_recovers_the_flagged_moved_hotzone_and_finishes() {
    hand_over(Stop::InMovedHotzone);
}

/// A run cryptblk finishes keeps the volume's `N` bytes: the image is cut to the header plus
/// `N` and its segment is `dynamic`, as luksFormat's; cryptsetup reads that header, sees a
/// volume of `N` bytes and its key decrypts the plaintext.
#[test]
fn cryptsetup_reads_the_image_cryptblk_leaves() {
    let plain = plain();
    let dir = tempfile::tempdir().unwrap();
    let key = write_key(dir.path(), "key", PASS);
    let img = cryptblk_run(dir.path(), &plain, None);
    assert_eq!(std::fs::metadata(&img).unwrap().len(), S + N);
    for bin in cryptsetups() {
        let dump = cs(&bin, &["luksDump", s(&img)]);
        assert!(
            dump.contains("length: (whole device)")
                && dump.contains(&format!("offset: {S} [bytes]")),
            "{}: {dump}",
            bin.display()
        );
        assert!(
            Command::new(&bin)
                .args(["open", "--test-passphrase", "--key-file", s(&key), s(&img)])
                .status()
                .unwrap()
                .success(),
            "{}: the passphrase does not open the finished image",
            bin.display()
        );
    }
    let (h, _) = read(&img);
    assert_eq!(h.data_size(S + N).unwrap(), N);
    assert!(decrypt_by_cryptsetup_key(&img, &key, N) == plain);
}
