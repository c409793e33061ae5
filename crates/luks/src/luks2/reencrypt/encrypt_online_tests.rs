//! In-place encryption of a served disk: the image of an `N`-byte plaintext disk is grown by
//! `R` bytes, `encrypt_init` moves its head to the end, and hotzones smaller than the shift
//! run while the volume keeps its `N` bytes (`keep_volume_size`) to the end, a crash at any
//! write included; the finished image is a LUKS2 volume of exactly `N` bytes.
use super::tests::Crashy;
use super::*;
use crate::io::HeaderIo;
use crate::luks2::json::SegmentSize;
use crate::luks2::Luks2Header;
use crate::{FormatOptions, LuksImage, PbkdfOptions, UnlockOptions};
use cryptblk_crypto::{CipherSpec, CryptoPool, Direction};
use std::cell::Cell;
use std::fs::File;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

const PASS: &[u8] = b"encrypt me online";
/// The guest's disk.
const N: u64 = 2 << 20;
/// `--reduce-device-size`: the image grows by it; the shift is half of it.
const R: u64 = 1 << 20;
const S: u64 = R / 2;
/// Smaller than the shift: several hotzones per shift of plaintext.
const HOTZONE: u64 = 128 << 10;

fn params() -> EncryptParams {
    let mut format =
        FormatOptions::luks2(CipherSpec::parse_luks2("aes-xts-plain64", 32).unwrap(), 512);
    format.pbkdf = PbkdfOptions::pbkdf2_iterations(crate::HashAlg::Sha256, 1000);
    EncryptParams { format, reduce: R }
}

fn plain() -> Vec<u8> {
    (0..N).map(|i| (i * 11 + i / 4093) as u8).collect()
}

/// The plaintext disk, grown by `R` as the daemon does before `encrypt_init`.
fn grown_image(dir: &Path, plain: &[u8]) -> File {
    let path = dir.join("disk");
    std::fs::write(&path, plain).unwrap();
    let file = File::options().read(true).write(true).open(&path).unwrap();
    file.set_len(N + R).unwrap();
    file
}

/// The encryption as cryptsetup runs it, without keeping the volume's size.
fn open_as_cryptsetup(file: &dyn HeaderIo) -> crate::Result<Reencryption<'_>> {
    let (hdr, _) = Luks2Header::read(file)?;
    let pool = Arc::new(CryptoPool::new(2));
    Reencryption::open(file, hdr, PASS, &UnlockOptions::default(), None, pool)
}

/// Open the reencryption with the size kept, as the daemon does on every attach.
fn open_kept(file: &dyn HeaderIo) -> crate::Result<Reencryption<'_>> {
    let mut r = open_as_cryptsetup(file)?;
    r.keep_volume_size()?;
    Ok(r)
}

fn read_all(r: &Reencryption<'_>) -> Vec<u8> {
    let mut buf = vec![0u8; N as usize];
    r.read(0, &mut buf).unwrap();
    buf
}

/// The extents cover the volume without gaps, each where this layout puts it: the moved
/// part at the image's end, the plaintext in place, the encrypted top `S` bytes up (IVs
/// counted from the volume's start), `encrypted` bytes of it.
fn check_extents(r: &Reencryption<'_>, encrypted: u64) {
    let ext = r.extents().unwrap();
    let mut pos = 0;
    let mut crypt = 0;
    for e in &ext {
        assert_eq!(e.logical_start, pos, "{ext:?}");
        assert!(!e.in_reencryption, "{ext:?}");
        match &e.cipher {
            ExtentCipher::Plain if e.logical_start == 0 => {
                assert_eq!((e.len, e.device_offset), (S, N + S), "{ext:?}")
            }
            ExtentCipher::Plain => assert_eq!(e.device_offset, e.logical_start, "{ext:?}"),
            ExtentCipher::Crypt {
                role,
                sector_size,
                iv_tweak,
                ..
            } => {
                assert_eq!(*role, KeyRole::New);
                assert_eq!(*sector_size, 512);
                assert_eq!(*iv_tweak, e.logical_start / 512, "{ext:?}");
                assert_eq!(e.device_offset, e.logical_start + S, "{ext:?}");
                crypt += e.len;
            }
        }
        pos = e.end();
    }
    assert_eq!(pos, N, "{ext:?}");
    assert_eq!(crypt, encrypted, "{ext:?}");
    assert_eq!(r.device_size().unwrap(), N);
    assert_eq!(r.done_bytes().unwrap(), encrypted);
}

/// The finished image is a plain LUKS2 volume of exactly `N` bytes holding the plaintext: a
/// `dynamic` segment on an image cut to the header plus `N` (a finish run to its end), or
/// still the fixed segment of `N` (a crash before the last commit of the finish).
fn check_final(file: &File, plain: &[u8]) {
    let (hdr, _) = Luks2Header::read(file).unwrap();
    assert!(hdr.reencrypt_state().unwrap().is_none());
    assert_eq!(hdr.read_only_reason(), None);
    assert_eq!(hdr.data_offset(), S);
    let (_, seg) = hdr.segment().unwrap();
    let len = HeaderIo::size(file).unwrap();
    match seg.size {
        SegmentSize::Dynamic => assert_eq!(len, S + N, "a dynamic segment on a longer image"),
        SegmentSize::Fixed(n) => assert_eq!(n, N),
    }
    assert_eq!(hdr.data_size(len).unwrap(), N);
    let (img, _) = LuksImage::read(file).unwrap();
    assert_eq!(img.data_size(len).unwrap(), N);
    let (_, key) = hdr.unlock(file, PASS, &UnlockOptions::default()).unwrap();
    let spec = hdr.cipher_spec().unwrap();
    let cipher = cryptblk_crypto::default_engine_for(&spec)
        .unwrap()
        .new_cipher(&spec, &key, 512)
        .unwrap();
    let mut buf = vec![0u8; N as usize];
    HeaderIo::read_exact_at(file, &mut buf, S).unwrap();
    cipher.crypt(Direction::Decrypt, 0, &mut buf).unwrap();
    assert!(buf == plain, "decrypted volume differs");
}

/// The hotzones a run of `HOTZONE`-byte steps takes: the plaintext in place from the top
/// down, then the moved part whole.
fn expected_hotzones() -> Vec<Range<u64>> {
    let mut zones: Vec<Range<u64>> = (1..=(N - S) / HOTZONE)
        .map(|i| N - i * HOTZONE..N - (i - 1) * HOTZONE)
        .collect();
    zones.push(0..S);
    zones
}

#[test]
fn online_run_keeps_the_volume_size() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let file = grown_image(dir.path(), &plain);
    encrypt_init(&file, PASS, &params()).unwrap();
    let mut r = open_kept(&file).unwrap();
    r.ensure_servable().unwrap();
    assert!(r.cipher_of(KeyRole::Old).is_none());
    assert!(r.cipher_of(KeyRole::New).is_some());
    check_extents(&r, 0);
    assert!(read_all(&r) == plain);

    let mut zones = Vec::new();
    while let Some(zone) = r.next_hotzone(HOTZONE).unwrap() {
        let rep = r.step(HOTZONE).unwrap();
        assert_eq!((rep.done, rep.total), (N - zone.start, N), "{zone:?}");
        check_extents(&r, rep.done);
        assert!(read_all(&r) == plain, "after hotzone {zone:?}");
        zones.push(zone);
        if zones.len() == 5 {
            // A restart between hotzones: the header alone says where the run is.
            drop(r);
            r = open_kept(&file).unwrap();
            check_extents(&r, rep.done);
        }
    }
    assert_eq!(zones, expected_hotzones());
    // After the last hotzone: one encrypted segment of the volume's size, not `dynamic`.
    let live = r.live_segments();
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].size, SegmentSize::Fixed(N));
    assert_eq!(r.step(HOTZONE).unwrap(), StepReport { done: N, total: N });
    r.finish().unwrap();
    drop(r);
    assert_eq!(HeaderIo::size(&file).unwrap(), S + N);
    // Cut to its end, the image is an ordinary one: its segment `dynamic` again.
    let (hdr, _) = Luks2Header::read(&file).unwrap();
    assert_eq!(hdr.segment().unwrap().1.size, SegmentSize::Dynamic);
    check_final(&file, &plain);
}

/// Without `keep_volume_size` the run is cryptsetup's: the last hotzone makes the volume run
/// to the image's end (the moved copy's `S` bytes, wiped, join it) and the image keeps its
/// length.
#[test]
fn without_keeping_the_size_the_volume_grows_as_cryptsetups_does() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let file = grown_image(dir.path(), &plain);
    encrypt_init(&file, PASS, &params()).unwrap();
    let mut r = open_as_cryptsetup(&file).unwrap();
    while r.step(HOTZONE).unwrap().done < N {
        assert_eq!(r.device_size().unwrap(), N);
    }
    assert_eq!(r.live_segments()[0].size, SegmentSize::Dynamic);
    assert_eq!(r.device_size().unwrap(), N + S);
    r.finish().unwrap();
    drop(r);
    let (hdr, _) = Luks2Header::read(&file).unwrap();
    assert_eq!(hdr.segment().unwrap().1.size, SegmentSize::Dynamic);
    assert_eq!(HeaderIo::size(&file).unwrap(), N + R);
    assert_eq!(hdr.data_size(N + R).unwrap(), N + S);
}

/// Once a run that kept the size has committed its last hotzone, the fixed segment itself
/// says so: a session without the option finishes at `N` too.
#[test]
fn a_kept_size_survives_a_session_without_the_option() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let file = grown_image(dir.path(), &plain);
    encrypt_init(&file, PASS, &params()).unwrap();
    let mut r = open_kept(&file).unwrap();
    while r.step(HOTZONE).unwrap().done < N {}
    drop(r);
    let mut r = open_as_cryptsetup(&file).unwrap();
    assert_eq!(r.device_size().unwrap(), N);
    r.finish().unwrap();
    drop(r);
    assert_eq!(HeaderIo::size(&file).unwrap(), S + N);
    check_final(&file, &plain);
}

/// Asking to keep the size once the last hotzone has made the volume run to the image's end
/// changes nothing: the volume is not shrunk under data a guest may have seen.
#[test]
fn keeping_the_size_too_late_does_not_shrink_the_volume() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let file = grown_image(dir.path(), &plain);
    encrypt_init(&file, PASS, &params()).unwrap();
    let mut r = open_as_cryptsetup(&file).unwrap();
    while r.step(HOTZONE).unwrap().done < N {}
    drop(r);
    let mut r = open_kept(&file).unwrap();
    assert_eq!(r.device_size().unwrap(), N + S);
    r.finish().unwrap();
    drop(r);
    let (hdr, _) = Luks2Header::read(&file).unwrap();
    assert_eq!(hdr.segment().unwrap().1.size, SegmentSize::Dynamic);
    assert_eq!(HeaderIo::size(&file).unwrap(), N + R);
}

/// Hotzone sizes below the alignment are refused before anything is written; the moved part
/// is one hotzone whatever the size asked.
#[test]
fn hotzone_sizes_are_aligned_and_capped_by_the_shift() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let file = grown_image(dir.path(), &plain);
    encrypt_init(&file, PASS, &params()).unwrap();
    let mut r = open_kept(&file).unwrap();
    let align = r.alignment();
    let e = r.step(align - 512).unwrap_err();
    assert!(matches!(e, LuksError::InvalidArgument(_)), "{e}");
    assert_eq!(r.done_bytes().unwrap(), 0);
    // Rounded down to the alignment.
    assert_eq!(r.next_hotzone(align + 512).unwrap(), Some(N - align..N));
    // Never more than the shift.
    assert_eq!(r.next_hotzone(u64::MAX).unwrap(), Some(N - S..N));
    while r.done_bytes().unwrap() < N - S {
        r.step(u64::MAX).unwrap();
    }
    assert_eq!(r.next_hotzone(align).unwrap(), Some(0..S));
    assert_eq!(r.step(align).unwrap().done, N);
    assert_eq!(r.next_hotzone(align).unwrap(), None);
}

/// A served encryption passes `ensure_servable` but is not two segments.
#[test]
fn an_encryption_is_served_by_extents() {
    let dir = tempfile::tempdir().unwrap();
    let file = grown_image(dir.path(), &plain());
    encrypt_init(&file, PASS, &params()).unwrap();
    let r = open_kept(&file).unwrap();
    r.ensure_servable().unwrap();
    let e = r.online_segments().err().unwrap();
    assert!(e.to_string().contains("extents()"), "{e}");
}

/// The header is made before the image is touched (the daemon derives the keyslot's key
/// before it fences anything off), for the length the image will have; `apply` checks it.
#[test]
fn prepare_touches_nothing_and_apply_checks_the_length() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let path = dir.path().join("disk");
    std::fs::write(&path, &plain).unwrap();
    let file = File::options().read(true).write(true).open(&path).unwrap();
    let prepared = encrypt_prepare(N + R, PASS, &params()).unwrap();
    assert!(std::fs::read(&path).unwrap() == plain);
    let spec = prepared.header().final_cipher_spec(32).unwrap();
    assert_eq!(spec.to_luks2_string(), "aes-xts-plain64");
    let e = prepared.apply(&file).unwrap_err();
    assert!(matches!(e, LuksError::InvalidArgument(_)), "{e}");
    assert!(std::fs::read(&path).unwrap() == plain);

    file.set_len(N + R).unwrap();
    let hdr = encrypt_prepare(N + R, PASS, &params())
        .unwrap()
        .apply(&file)
        .unwrap();
    assert_eq!(hdr.final_cipher_spec(32).unwrap(), spec);
    let mut r = open_kept(&file).unwrap();
    r.step(HOTZONE).unwrap();
    // The live encrypted segment starts its IVs mid-volume; the final cipher is the same.
    assert_eq!(r.header().final_cipher_spec(32).unwrap(), spec);
    assert!(read_all(&r) == plain);
}

/// A file whose write at offset `at` stores its first half and fails (a torn write).
struct TornAt {
    file: File,
    at: u64,
}

impl HeaderIo for TornAt {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        HeaderIo::read_exact_at(&self.file, buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        if offset == self.at && buf.len() > 1 {
            HeaderIo::write_all_at(&self.file, &buf[..buf.len() / 2], offset)?;
            return Err(std::io::Error::other("torn write"));
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
        Ok(())
    }
}

/// A torn write of the header leaves the disk's plaintext where it was (put back from the
/// copy in memory), not a head that is neither plaintext nor LUKS2.
#[test]
fn a_torn_header_write_puts_the_plaintext_back() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let file = grown_image(dir.path(), &plain);
    let torn = TornAt {
        file: file.try_clone().unwrap(),
        at: 0,
    };
    let e = encrypt_init(&torn, PASS, &params()).unwrap_err();
    assert!(e.to_string().contains("torn write"), "{e}");
    assert!(!LuksImage::probe(&file).unwrap());
    let now = std::fs::read(dir.path().join("disk")).unwrap();
    assert!(
        now[..N as usize] == plain[..],
        "the plaintext was not put back"
    );
}

/// A crash at each write of an online run (init, every hotzone's two commits and its data,
/// the wipe, the final commit): reopened with the size kept, the volume reads back (a flagged
/// hotzone from its plaintext source) as the original `N` bytes, recovery and the rest of the
/// run end with a LUKS2 volume of exactly `N` bytes.
#[test]
fn online_run_crash_at_every_write() {
    let plain = plain();
    let mut crash_at = 0;
    let mut flagged = 0;
    loop {
        let dir = tempfile::tempdir().unwrap();
        let file = grown_image(dir.path(), &plain);
        let crashy = Crashy {
            file: file.try_clone().unwrap(),
            budget: Cell::new(crash_at),
        };
        let completed = (|| -> crate::Result<()> {
            encrypt_init(&crashy, PASS, &params())?;
            let mut r = open_kept(&crashy)?;
            while r.step(HOTZONE)?.done < N {}
            r.finish()?;
            Ok(())
        })()
        .is_ok();
        if !LuksImage::probe(&file).unwrap() {
            // Before the header: the disk is untouched (its head was only copied beyond N).
            let now = std::fs::read(dir.path().join("disk")).unwrap();
            assert_eq!(now.len() as u64, N + R);
            assert!(
                now[..N as usize] == plain[..],
                "crash at write {crash_at}: plaintext changed"
            );
            assert!(!completed);
            crash_at += 1;
            continue;
        }
        let (hdr, _) = Luks2Header::read(&file).unwrap();
        if hdr.reencrypt_state().unwrap().is_some() {
            let mut r = open_kept(&file).unwrap();
            assert_eq!(r.device_size().unwrap(), N, "crash at write {crash_at}");
            assert!(
                read_all(&r) == plain,
                "crash at write {crash_at}: read-only view differs"
            );
            if r.is_interrupted() {
                flagged += 1;
                r.recover().unwrap();
                assert!(!r.is_interrupted());
                assert!(
                    read_all(&r) == plain,
                    "crash at write {crash_at}: recovered"
                );
            }
            check_extents(&r, r.done_bytes().unwrap());
            while r.step(HOTZONE).unwrap().done < N {
                assert_eq!(r.device_size().unwrap(), N);
            }
            r.finish().unwrap();
        }
        check_final(&file, &plain);
        if completed {
            assert_eq!(HeaderIo::size(&file).unwrap(), S + N);
            break;
        }
        crash_at += 1;
    }
    let hotzones = expected_hotzones().len();
    assert!(
        crash_at > 2 * hotzones && flagged >= hotzones,
        "{crash_at} writes, {flagged} crashes inside a hotzone"
    );
}
