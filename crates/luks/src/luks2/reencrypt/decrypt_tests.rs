//! Decryption to a detached header through cryptblk alone: init, the shifted hotzones, the
//! moved segment and the end, and a crash injected at every write of a run (header or data)
//! after which the read-only view and then recovery give back the original plaintext.
use super::*;
use crate::io::HeaderIo;
use crate::luks2::Luks2Header;
use crate::{FormatOptions, LuksError, PbkdfOptions, UnlockOptions};
use cryptblk_crypto::{default_engine_for, CipherSpec, CryptoPool, Direction, SecretKey};
use std::cell::Cell;
use std::fs::File;
use std::sync::Arc;

const PASS: &[u8] = b"decrypt me";
/// A small data offset (the data shift), so that the volume spans several hotzones.
const D: u64 = 512 << 10;
/// Four shifted hotzones after the moved segment (512 KiB, the last hotzone 256 KiB; or
/// 256 KiB, all hotzones 512 KiB).
const DATA: u64 = (2 << 20) + (256 << 10);

/// Writes fail once `budget` of them (on either file) have been done: a crash there.
struct Crashing<'a> {
    file: &'a File,
    budget: &'a Cell<usize>,
}

impl HeaderIo for Crashing<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        HeaderIo::read_exact_at(self.file, buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        if self.budget.get() == 0 {
            return Err(std::io::Error::other("injected crash"));
        }
        self.budget.set(self.budget.get() - 1);
        HeaderIo::write_all_at(self.file, buf, offset)
    }
    fn size(&self) -> std::io::Result<u64> {
        HeaderIo::size(self.file)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        HeaderIo::set_len(self.file, len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The `n`th write (on either file) fails, the others succeed: an I/O error at that point.
struct FailOnce<'a> {
    file: &'a File,
    writes: &'a Cell<usize>,
    fail_at: usize,
}

impl HeaderIo for FailOnce<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        HeaderIo::read_exact_at(self.file, buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let n = self.writes.get();
        self.writes.set(n + 1);
        if n == self.fail_at {
            return Err(std::io::Error::other("injected I/O error"));
        }
        HeaderIo::write_all_at(self.file, buf, offset)
    }
    fn size(&self) -> std::io::Result<u64> {
        HeaderIo::size(self.file)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        HeaderIo::set_len(self.file, len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        Ok(())
    }
}

fn pbkdf() -> PbkdfOptions {
    PbkdfOptions::pbkdf2_iterations(crate::HashAlg::Sha256, 1000)
}

fn rw(path: &std::path::Path) -> File {
    File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap()
}

fn plain() -> Vec<u8> {
    (0..DATA).map(|i| (i * 13 + i / 4091) as u8).collect()
}

/// An aes-xts-256 image (4096-byte sectors) with its header in the first `D` bytes and
/// `plain` encrypted behind it.
fn image(path: &std::path::Path, plain: &[u8]) -> File {
    let file = rw(path);
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 32).unwrap();
    let mut opts = FormatOptions::luks2(spec.clone(), 4096);
    opts.pbkdf = pbkdf();
    let key = SecretKey::random(32).unwrap();
    Luks2Header::format_at(&file, &opts, PASS, &key, Some(plain.len() as u64), D).unwrap();
    let mut ct = plain.to_vec();
    default_engine_for(&spec)
        .unwrap()
        .new_cipher(&spec, &key, 4096)
        .unwrap()
        .crypt(Direction::Encrypt, 0, &mut ct)
        .unwrap();
    file.set_len(D + plain.len() as u64).unwrap();
    HeaderIo::write_all_at(&file, &ct, D).unwrap();
    file
}

/// The moved segment: the default (D) with checksums; with a journal, what the keyslots area
/// left by a 512 KiB data offset holds.
fn moved_len(resilience: MovedResilience) -> u64 {
    match resilience {
        MovedResilience::Checksum(_) => D,
        MovedResilience::Journal => 256 << 10,
    }
}

fn params(resilience: MovedResilience) -> DecryptParams {
    DecryptParams {
        resilience,
        moved_len: Some(moved_len(resilience)).filter(|&m| m != D),
        keyslot: None,
        pbkdf: pbkdf(),
    }
}

fn open<'a>(hdr: &'a dyn HeaderIo, img: &'a dyn HeaderIo) -> Result<Reencryption<'a>> {
    let (h, _) = Luks2Header::read_detached(hdr)?;
    Reencryption::open_detached(
        hdr,
        img,
        h,
        PASS,
        &UnlockOptions::default(),
        None,
        Arc::new(CryptoPool::new(2)),
    )
}

fn run_to_end(r: &mut Reencryption<'_>) -> Result<()> {
    while r.step(u64::MAX)?.done < DATA {}
    r.finish().map(drop)
}

/// The image holds `plain` at offset 0 and random bytes where its last `D` were; the header
/// is the final one (one linear segment, no keyslots or requirement).
fn check_final(hdr: &File, img: &File, plain: &[u8], ciphertext_tail: &[u8]) {
    let mut buf = vec![0u8; plain.len()];
    HeaderIo::read_exact_at(img, &mut buf, 0).unwrap();
    assert!(buf == plain, "the plaintext at offset 0 differs");
    let mut tail = vec![0u8; D as usize];
    HeaderIo::read_exact_at(img, &mut tail, DATA).unwrap();
    assert!(
        tail != ciphertext_tail,
        "the image's last D bytes were not wiped"
    );
    let (h, _) = Luks2Header::read_detached(hdr).unwrap();
    let meta = h.metadata();
    assert!(meta.keyslots.is_empty() && meta.digests.is_empty());
    assert!(meta.config.requirements.is_none());
    assert_eq!(meta.segments.len(), 1);
    assert_eq!(meta.segments["0"].kind, "linear");
    assert_eq!(meta.segments["0"].offset, 0);
}

const RESILIENCES: [MovedResilience; 2] = [
    MovedResilience::Checksum(crate::HashAlg::Sha256),
    MovedResilience::Journal,
];

#[test]
fn init_steps_and_finish() {
    for resilience in RESILIENCES {
        init_steps_and_finish_with(resilience);
    }
}

fn init_steps_and_finish_with(resilience: MovedResilience) {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let img = image(&dir.path().join("img"), &plain);
    let mut tail = vec![0u8; D as usize];
    HeaderIo::read_exact_at(&img, &mut tail, DATA).unwrap();
    let hdr = rw(&dir.path().join("hdr"));

    // A wrong passphrase writes nothing.
    let before = std::fs::read(dir.path().join("img")).unwrap();
    assert!(matches!(
        decrypt_init(
            &img,
            &hdr,
            b"wrong",
            &UnlockOptions::default(),
            &params(resilience)
        ),
        Err(LuksError::WrongPassphrase)
    ));
    assert_eq!(HeaderIo::size(&hdr).unwrap(), 0);
    assert!(std::fs::read(dir.path().join("img")).unwrap() == before);

    let h = decrypt_init(
        &img,
        &hdr,
        PASS,
        &UnlockOptions::default(),
        &params(resilience),
    )
    .unwrap();
    assert!(h.is_detached());
    assert!(Luks2Header::read(&img).is_err(), "the image is still LUKS");
    let st = h.reencrypt_state().unwrap().unwrap();
    assert_eq!(st.version, 3);
    let kind = match resilience {
        MovedResilience::Checksum(_) => "datashift-checksum",
        MovedResilience::Journal => "datashift-journal",
    };
    assert_eq!(st.resilience.name(), kind);
    let mut r = open(&hdr, &img).unwrap();
    assert_eq!(r.device_size().unwrap(), DATA);
    let mut buf = vec![0u8; DATA as usize];
    r.read(0, &mut buf).unwrap();
    assert!(buf == plain, "read after init");
    let mut dones = Vec::new();
    loop {
        let rep = r.step(u64::MAX).unwrap();
        r.read(0, &mut buf).unwrap();
        assert!(buf == plain, "read after the step to {}", rep.done);
        dones.push(rep.done);
        if rep.done >= rep.total {
            break;
        }
    }
    // Four shifted hotzones, then the moved segment.
    assert_eq!(
        dones,
        [D, 2 * D, 3 * D, DATA - moved_len(resilience), DATA],
        "progress after each hotzone"
    );
    r.finish().unwrap();
    check_final(&hdr, &img, &plain, &tail);
}

#[test]
fn a_crash_at_any_write_reads_back_and_recovers() {
    for resilience in RESILIENCES {
        a_crash_at_any_write_with(resilience);
    }
}

fn a_crash_at_any_write_with(resilience: MovedResilience) {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let img_path = dir.path().join("img");
    let hdr_path = dir.path().join("hdr");
    let img = image(&img_path, &plain);
    let mut tail = vec![0u8; D as usize];
    HeaderIo::read_exact_at(&img, &mut tail, DATA).unwrap();
    let hdr = rw(&hdr_path);
    decrypt_init(
        &img,
        &hdr,
        PASS,
        &UnlockOptions::default(),
        &params(resilience),
    )
    .unwrap();
    let pristine_img = std::fs::read(&img_path).unwrap();
    let pristine_hdr = std::fs::read(&hdr_path).unwrap();

    let mut crashes = 0;
    for budget in 0.. {
        std::fs::write(&img_path, &pristine_img).unwrap();
        std::fs::write(&hdr_path, &pristine_hdr).unwrap();
        let (img, hdr) = (rw(&img_path), rw(&hdr_path));
        let left = Cell::new(budget);
        let crashed = {
            let (cimg, chdr) = (
                Crashing {
                    file: &img,
                    budget: &left,
                },
                Crashing {
                    file: &hdr,
                    budget: &left,
                },
            );
            let mut r = open(&chdr, &cimg).unwrap();
            run_to_end(&mut r).is_err()
        };
        if !crashed {
            check_final(&hdr, &img, &plain, &tail);
            break;
        }
        crashes += 1;
        let (h, _) = Luks2Header::read_detached(&hdr).unwrap();
        if h.reencrypt_state().unwrap().is_none() {
            // The crash came after the final commit: the data is plaintext already.
            check_final(&hdr, &img, &plain, &tail);
            continue;
        }
        // Read-only, before recovery: whatever the crash left, the volume reads back.
        let mut r = open(&hdr, &img).unwrap();
        let mut buf = vec![0u8; DATA as usize];
        r.read(0, &mut buf).unwrap();
        assert!(
            buf == plain,
            "read-only view after a crash at write {budget}"
        );
        run_to_end(&mut r).unwrap();
        check_final(&hdr, &img, &plain, &tail);
    }
    assert!(crashes > 20, "only {crashes} writes were crash points");
}

#[test]
fn an_init_that_fails_puts_the_image_back() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let img_path = dir.path().join("img");
    let hdr_path = dir.path().join("hdr");
    drop(image(&img_path, &plain));
    let pristine = std::fs::read(&img_path).unwrap();
    let mut failures = 0;
    for fail_at in 0.. {
        std::fs::write(&img_path, &pristine).unwrap();
        std::fs::write(&hdr_path, b"").unwrap();
        let (img, hdr) = (rw(&img_path), rw(&hdr_path));
        let writes = Cell::new(0);
        let fimg = FailOnce {
            file: &img,
            writes: &writes,
            fail_at,
        };
        let fhdr = FailOnce {
            file: &hdr,
            writes: &writes,
            fail_at,
        };
        let params = params(RESILIENCES[0]);
        if decrypt_init(&fimg, &fhdr, PASS, &UnlockOptions::default(), &params).is_ok() {
            break;
        }
        failures += 1;
        assert!(
            std::fs::read(&img_path).unwrap() == pristine,
            "an init failing at write {fail_at} left the image changed"
        );
    }
    assert!(failures >= 5, "only {failures} writes could fail");
}
