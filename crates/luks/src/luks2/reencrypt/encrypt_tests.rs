//! In-place encryption through cryptblk alone, with a crash injected at every write of a run
//! (init, each hotzone, the final wipe and commit): whatever the crash point, the image is
//! either still the untouched plaintext (no header yet) or resumes to a LUKS2 volume whose
//! first `size - reduce` bytes are the original plaintext.
use super::tests::Crashy;
use super::*;
use crate::io::HeaderIo;
use crate::luks2::Luks2Header;
use crate::{FormatOptions, LuksImage, PbkdfOptions, UnlockOptions};
use cryptblk_crypto::{CipherSpec, CryptoPool};
use std::cell::Cell;
use std::fs::File;
use std::sync::Arc;

const PASS: &[u8] = b"encrypt me";
const SIZE: u64 = 3 << 20;
const REDUCE: u64 = 1 << 20;
/// The offline CLI's default `--hotzone-size`, above the shift: cryptsetup's hotzones of
/// exactly the shift (`encrypt_online_tests.rs` runs smaller ones).
const CLI_HOTZONE: u64 = 64 << 20;

fn params_with(reduce: u64) -> EncryptParams {
    EncryptParams { reduce, ..params() }
}

fn params() -> EncryptParams {
    let mut format =
        FormatOptions::luks2(CipherSpec::parse_luks2("aes-xts-plain64", 32).unwrap(), 512);
    format.pbkdf = PbkdfOptions::pbkdf2_iterations(crate::HashAlg::Sha256, 1000);
    EncryptParams {
        format,
        reduce: REDUCE,
    }
}

fn plain() -> Vec<u8> {
    (0..SIZE).map(|i| (i * 13 + i / 4091) as u8).collect()
}

/// Resume (recovering a flagged hotzone) and run to the end.
fn run_to_end(file: &dyn HeaderIo) -> crate::Result<()> {
    let (hdr, _) = Luks2Header::read(file)?;
    if hdr.reencrypt_state()?.is_none() {
        return Ok(());
    }
    let pool = Arc::new(CryptoPool::new(2));
    let mut r = Reencryption::open(file, hdr, PASS, &UnlockOptions::default(), None, pool)?;
    if r.is_interrupted() {
        r.recover()?;
    }
    loop {
        let rep = r.step(CLI_HOTZONE)?;
        if rep.done >= rep.total {
            break;
        }
    }
    r.finish()?;
    Ok(())
}

fn check_encrypted(file: &File, plain: &[u8], reduce: u64) {
    let (hdr, _) = Luks2Header::read(file).unwrap();
    assert!(hdr.reencrypt_state().unwrap().is_none());
    assert_eq!(hdr.data_offset(), reduce / 2);
    let (_, key) = hdr.unlock(file, PASS, &UnlockOptions::default()).unwrap();
    let spec = hdr.cipher_spec().unwrap();
    let cipher = cryptblk_crypto::default_engine_for(&spec)
        .unwrap()
        .new_cipher(&spec, &key, 512)
        .unwrap();
    let kept = (SIZE - reduce) as usize;
    let mut buf = vec![0u8; kept];
    HeaderIo::read_exact_at(file, &mut buf, reduce / 2).unwrap();
    cipher
        .crypt(cryptblk_crypto::Direction::Decrypt, 0, &mut buf)
        .unwrap();
    assert!(buf == plain[..kept], "decrypted payload differs");
    let mut tail = vec![0u8; (reduce / 2) as usize];
    HeaderIo::read_exact_at(file, &mut tail, SIZE - reduce / 2).unwrap();
    assert!(tail != plain[..tail.len()], "moved plaintext left behind");
}

#[test]
fn a_crash_at_any_write_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let plain = plain();
    let mut completed = false;
    for budget in 0..200 {
        let path = dir.path().join("img");
        std::fs::write(&path, &plain).unwrap();
        let file = File::options().read(true).write(true).open(&path).unwrap();
        let crashy = Crashy {
            file: file.try_clone().unwrap(),
            budget: Cell::new(budget),
        };
        let outcome = encrypt_init(&crashy, PASS, &params())
            .map(|_| ())
            .and_then(|()| run_to_end(&crashy));
        if !LuksImage::probe(&file).unwrap() {
            // Crashed before the header was written: the plaintext is untouched below the
            // area given up at the end.
            let keep = (SIZE - REDUCE / 2) as usize;
            let now = std::fs::read(&path).unwrap();
            assert!(
                now[..keep] == plain[..keep],
                "budget {budget}: plaintext changed"
            );
            assert!(outcome.is_err());
            continue;
        }
        run_to_end(&file).unwrap_or_else(|e| panic!("budget {budget}: resume failed: {e}"));
        check_encrypted(&file, &plain, REDUCE);
        if outcome.is_ok() {
            completed = true;
            break;
        }
    }
    assert!(
        completed,
        "the run never completed within the write budgets tried"
    );
}

#[test]
fn reduce_limits_are_checked_before_any_write() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img");
    let plain = plain();
    std::fs::write(&path, &plain).unwrap();
    let file = File::options().read(true).write(true).open(&path).unwrap();
    for reduce in [min_reduce(32) - 1024, (1 << 20) + 512, MAX_REDUCE * 2] {
        let mut p = params();
        p.reduce = reduce;
        let e = encrypt_init(&file, PASS, &p).unwrap_err();
        assert!(matches!(e, LuksError::InvalidArgument(_)), "{reduce}: {e}");
    }
    // Nothing of the plaintext would be left.
    let mut p = params();
    p.reduce = 3 << 20;
    let e = encrypt_init(&file, PASS, &p).unwrap_err();
    assert!(e.to_string().contains("too small"), "{e}");
    assert!(std::fs::read(&path).unwrap() == plain);
}

/// Less plaintext left than the shift (cryptsetup allows it): all of it is moved, and the
/// single hotzone reads it from right after where it is written.
#[test]
fn less_plaintext_than_the_shift() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img");
    let plain = plain();
    std::fs::write(&path, &plain).unwrap();
    let file = File::options().read(true).write(true).open(&path).unwrap();
    let reduce = 5 << 19;
    encrypt_init(&file, PASS, &params_with(reduce)).unwrap();
    run_to_end(&file).unwrap();
    check_encrypted(&file, &plain, reduce);
}
