//! Reencryption through cryptblk alone: init, the digest guarding the metadata, reads across
//! segments, and a write failure injected at every write of a run (a crash at that point)
//! followed by recovery, which must always give back the original plaintext.
use super::*;
use crate::io::HeaderIo;
use crate::luks2::Luks2Header;
use crate::{FormatOptions, PbkdfOptions, UnlockOptions};
use cryptblk_crypto::{default_engine_for, CipherSpec, CryptoPool, Direction, SecretKey};
use std::cell::Cell;
use std::fs::File;
use std::sync::Arc;

const PASS: &[u8] = b"reencrypt me";
const DATA: u64 = 2 << 20;

/// A file whose writes fail once `budget` of them have been done: a crash at that write
/// (the encryption tests inject theirs with it too).
pub(super) struct Crashy {
    pub(super) file: File,
    pub(super) budget: Cell<usize>,
}

impl HeaderIo for Crashy {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        HeaderIo::read_exact_at(&self.file, buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        if self.budget.get() == 0 {
            return Err(std::io::Error::other("injected crash"));
        }
        self.budget.set(self.budget.get() - 1);
        HeaderIo::write_all_at(&self.file, buf, offset)
    }
    fn size(&self) -> std::io::Result<u64> {
        HeaderIo::size(&self.file)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        HeaderIo::set_len(&self.file, len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        Ok(())
    }
}

fn pbkdf() -> PbkdfOptions {
    PbkdfOptions::pbkdf2_iterations(crate::HashAlg::Sha256, 1000)
}

fn pool() -> Arc<CryptoPool> {
    Arc::new(CryptoPool::new(2))
}

/// A 512-byte-sector aes-xts-256 image holding `plain`; returns the file.
fn image(dir: &std::path::Path, plain: &[u8]) -> File {
    let path = dir.join("img");
    let file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .unwrap();
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 32).unwrap();
    let mut opts = FormatOptions::luks2(spec.clone(), 512);
    opts.pbkdf = pbkdf();
    let key = SecretKey::random(32).unwrap();
    let hdr = Luks2Header::format(&file, &opts, PASS, &key, Some(plain.len() as u64)).unwrap();
    let cipher = default_engine_for(&spec)
        .unwrap()
        .new_cipher(&spec, &key, 512)
        .unwrap();
    let mut ct = plain.to_vec();
    cipher.crypt(Direction::Encrypt, 0, &mut ct).unwrap();
    file.set_len(hdr.data_offset() + plain.len() as u64)
        .unwrap();
    HeaderIo::write_all_at(&file, &ct, hdr.data_offset()).unwrap();
    file
}

fn plain() -> Vec<u8> {
    (0..DATA).map(|i| (i * 7 + i / 4093) as u8).collect()
}

fn init(file: &dyn HeaderIo, resilience: ResilienceChoice) {
    let (mut hdr, _) = Luks2Header::read(file).unwrap();
    let params = InitParams {
        cipher: Some(CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap()),
        sector_size: Some(4096),
        resilience,
        pbkdf: pbkdf(),
        keyslot: None,
    };
    hdr.reencrypt_init(file, PASS, &UnlockOptions::default(), &params)
        .unwrap();
}

fn open(file: &dyn HeaderIo) -> crate::Result<Reencryption<'_>> {
    let (hdr, _) = Luks2Header::read(file).unwrap();
    Reencryption::open(file, hdr, PASS, &UnlockOptions::default(), None, pool())
}

fn read_all(r: &Reencryption<'_>) -> Vec<u8> {
    let mut buf = vec![0u8; DATA as usize];
    r.read(0, &mut buf).unwrap();
    buf
}

/// The finished image opens as a plain LUKS2 volume with the new layout.
fn check_final(file: &File, plain: &[u8]) {
    let (hdr, _) = Luks2Header::read(file).unwrap();
    assert_eq!(hdr.read_only_reason(), None);
    assert_eq!(hdr.sector_size(), 4096);
    assert_eq!(hdr.active_keyslots().len(), 1);
    let (_, key) = hdr.unlock(file, PASS, &UnlockOptions::default()).unwrap();
    assert_eq!(key.len(), 64);
    let spec = hdr.cipher_spec().unwrap();
    let cipher = default_engine_for(&spec)
        .unwrap()
        .new_cipher(&spec, &key, 4096)
        .unwrap();
    let mut buf = vec![0u8; plain.len()];
    HeaderIo::read_exact_at(file, &mut buf, hdr.data_offset()).unwrap();
    cipher.crypt(Direction::Decrypt, 0, &mut buf).unwrap();
    assert!(buf == plain, "final plaintext differs");
}

#[test]
fn init_read_step_finish() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let file = image(dir.path(), &plain);
    init(&file, ResilienceChoice::Checksum(crate::HashAlg::Sha256));
    let (hdr, _) = Luks2Header::read(&file).unwrap();
    assert!(hdr
        .read_only_reason()
        .unwrap()
        .contains("reencryption is in progress"));
    assert!(hdr.unlock(&file, PASS, &UnlockOptions::default()).is_err());
    let mut r = open(&file).unwrap();
    assert_eq!(r.device_size().unwrap(), DATA);
    assert!(read_all(&r) == plain);
    let rep = r.step(512 << 10).unwrap();
    assert_eq!(rep.done, 512 << 10);
    assert_eq!(r.extents().unwrap().len(), 2);
    assert!(read_all(&r) == plain);
    drop(r);
    let mut r = open(&file).unwrap();
    assert_eq!(r.done_bytes().unwrap(), 512 << 10);
    while r.step(768 << 10).unwrap().done < DATA {}
    assert!(read_all(&r) == plain);
    r.finish().unwrap();
    check_final(&file, &plain);
}

#[test]
fn tampered_metadata_fails_the_digest() {
    let dir = tempfile::tempdir().unwrap();
    let file = image(dir.path(), &plain());
    init(&file, ResilienceChoice::Checksum(crate::HashAlg::Sha256));
    let (mut hdr, _) = Luks2Header::read(&file).unwrap();
    let state = hdr.reencrypt_state().unwrap().unwrap();
    // Pointing the checksums elsewhere (a valid header otherwise) must be caught.
    hdr.meta.keyslots.get_mut(&state.keyslot).unwrap().area.size -= 4096;
    hdr.commit(&file).unwrap();
    match open(&file) {
        Err(crate::LuksError::Corrupt(m)) => assert!(m.contains("reencryption digest"), "{m}"),
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("tampered metadata accepted"),
    }
}

#[test]
fn wrong_passphrase_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = image(dir.path(), &plain());
    init(&file, ResilienceChoice::None);
    let (hdr, _) = Luks2Header::read(&file).unwrap();
    let r = Reencryption::open(&file, hdr, b"nope", &UnlockOptions::default(), None, pool());
    assert!(matches!(r, Err(crate::LuksError::WrongPassphrase)));
}

/// A crash at each write of a checksum run; after reopening (with recovery) the data is intact
/// at every point and the run completes.
#[test]
fn crash_at_every_write_recovers() {
    crash_at_every_write(ResilienceChoice::Checksum(crate::HashAlg::Sha1));
}

#[test]
fn crash_at_every_write_recovers_journal() {
    crash_at_every_write(ResilienceChoice::Journal);
}

/// The same with the offline loop that reads each next hotzone ahead (from a second handle:
/// only the rewrite's writes crash).
#[test]
fn crash_at_every_write_reading_ahead_recovers() {
    crash_at_every_write_with(ResilienceChoice::Checksum(crate::HashAlg::Sha256), true);
}

fn crash_at_every_write(resilience: ResilienceChoice) {
    crash_at_every_write_with(resilience, false);
}

fn crash_at_every_write_with(resilience: ResilienceChoice, read_ahead: bool) {
    let plain = plain();
    let mut crash_at = 0;
    loop {
        let dir = tempfile::tempdir().unwrap();
        let file = image(dir.path(), &plain);
        init(&file, resilience);
        let crashy = Crashy {
            file: file.try_clone().unwrap(),
            budget: Cell::new(crash_at),
        };
        let completed = (|| -> crate::Result<()> {
            let mut r = open(&crashy)?;
            if read_ahead {
                r.run_reading_ahead(256 << 10, &file, |_| true)?;
            } else {
                while r.step(256 << 10)?.done < DATA {}
            }
            r.finish()?;
            Ok(())
        })()
        .is_ok();
        let (hdr, _) = Luks2Header::read(&file).unwrap();
        if hdr.reencrypt_state().unwrap().is_some() {
            // Read-only view of whatever state the crash left, then recovery and completion.
            let mut r = open(&file).unwrap();
            assert!(
                read_all(&r) == plain,
                "crash at write {crash_at}: read-only view differs"
            );
            r.recover().unwrap();
            assert!(
                read_all(&r) == plain,
                "crash at write {crash_at}: after recovery"
            );
            while r.step(1 << 20).unwrap().done < DATA {}
            r.finish().unwrap();
        }
        check_final(&file, &plain);
        if completed {
            break;
        }
        crash_at += 1;
    }
    assert!(crash_at > 20, "only {crash_at} writes");
}

/// With resilience `none` the boundary is only in memory until `checkpoint` (a clean stop),
/// which makes it durable: a new session continues from there.
#[test]
fn none_checkpoint_keeps_the_progress() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let file = image(dir.path(), &plain);
    init(&file, ResilienceChoice::None);
    let mut r = open(&file).unwrap();
    r.step(512 << 10).unwrap();
    r.step(512 << 10).unwrap();
    // Until the checkpoint the header on disk still has the boundary at 0 (cryptsetup's
    // `none`: a crash here loses what was rewritten).
    let (on_disk, _) = Luks2Header::read(&file).unwrap();
    assert_eq!(
        on_disk
            .reencrypt_extents(HeaderIo::size(&file).unwrap())
            .unwrap()
            .unwrap()
            .len(),
        1
    );
    r.checkpoint().unwrap();
    drop(r);
    let mut r = open(&file).unwrap();
    assert_eq!(r.done_bytes().unwrap(), 1 << 20);
    assert!(read_all(&r) == plain);
    while r.step(1 << 20).unwrap().done < DATA {}
    r.finish().unwrap();
    check_final(&file, &plain);
}

/// The read-ahead loop stops when told to after a whole hotzone, with the boundary durable
/// (checksum resilience commits each one), and a new session finishes the work.
#[test]
fn reading_ahead_stops_between_hotzones() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let file = image(dir.path(), &plain);
    init(&file, ResilienceChoice::Checksum(crate::HashAlg::Sha256));
    let mut r = open(&file).unwrap();
    let mut seen = Vec::new();
    let rep = r
        .run_reading_ahead(384 << 10, &file, |rep| {
            seen.push(rep.done);
            seen.len() < 2
        })
        .unwrap();
    assert_eq!(seen, [384 << 10, 768 << 10]);
    assert_eq!(rep.done, 768 << 10);
    assert!(read_all(&r) == plain);
    drop(r);
    let mut r = open(&file).unwrap();
    assert_eq!(r.done_bytes().unwrap(), 768 << 10);
    // The last hotzone is shorter (2 MiB is not a multiple of 384 KiB).
    let rep = r.run_reading_ahead(384 << 10, &file, |_| true).unwrap();
    assert_eq!((rep.done, rep.total), (DATA, DATA));
    r.finish().unwrap();
    check_final(&file, &plain);
}

/// A hotzone that does not begin at the boundary is refused before anything is written.
#[test]
fn a_hotzone_off_the_boundary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let file = image(dir.path(), &plain);
    init(&file, ResilienceChoice::Checksum(crate::HashAlg::Sha256));
    let mut r = open(&file).unwrap();
    let ahead = r.hotzone_at(256 << 10, 256 << 10).unwrap().unwrap();
    let mut buf = vec![0u8; 256 << 10];
    let err = r.rewrite(ahead, &mut buf).unwrap_err();
    assert!(
        err.to_string()
            .contains("does not begin at the reencryption boundary"),
        "{err}"
    );
    assert_eq!(r.done_bytes().unwrap(), 0);
    assert!(read_all(&r) == plain);
}
