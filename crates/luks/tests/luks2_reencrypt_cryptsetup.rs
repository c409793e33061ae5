//! A reencryption cryptsetup 2.6 left mid-way (SIGKILL inside a checksum hotzone) reads back
//! the original plaintext through cryptblk, read-only before any recovery (each block of the
//! hotzone from the old or the new key as its checksum says) and after recovery.
mod common_core;

use common_core::*;
use cryptblk_crypto::{default_engine_for, CipherSpec, CryptoPool, Direction};
use cryptblk_luks::luks2::reencrypt::Reencryption;
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::UnlockOptions;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DATA: u64 = 32 << 20;
const PASS: &[u8] = b"midway\n";

fn seqid(img: &std::path::Path) -> u64 {
    u64::from_be_bytes(read_range(img, 16, 8).try_into().unwrap())
}

#[test]
fn cryptsetup_killed_in_a_hotzone_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let key = write_key(dir.path(), "key", PASS);
    let img = cs_format(
        dir.path(),
        DATA + (16 << 20),
        &key,
        &[
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--sector-size",
            "512",
            "--key-size",
            "256",
        ],
    );
    let vk = cryptblk_crypto::SecretKey::new(cryptsetup_volume_key(&img, &key));
    let plain: Vec<u8> = (0..DATA).map(|i| (i ^ (i >> 11)) as u8).collect();
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 32).unwrap();
    let mut ct = plain.clone();
    default_engine_for(&spec)
        .unwrap()
        .new_cipher(&spec, &vk, 512)
        .unwrap()
        .crypt(Direction::Encrypt, 0, &mut ct)
        .unwrap();
    open_rw(&img).write_all_at(&ct, 16 << 20).unwrap();
    let pristine = std::fs::read(&img).unwrap();

    // Kill cryptsetup inside a hotzone: once it is well under way, stop it (SIGSTOP), look at
    // the metadata, and kill it only if a hotzone is flagged; otherwise let it go on and look
    // again. On a loaded machine a blind kill landed between hotzones eight times in a row.
    let mut interrupted = false;
    for _ in 0..8 {
        std::fs::write(&img, &pristine).unwrap();
        let start = seqid(&img);
        let mut child = Command::new(tool("cryptsetup"))
            .args([
                "reencrypt",
                "--force-offline-reencrypt",
                "--batch-mode",
                "--key-file",
                s(&key),
            ])
            .args([
                "--pbkdf",
                "pbkdf2",
                "--pbkdf-force-iterations",
                "1000",
                "--hotzone-size",
                "64K",
            ])
            .args(["--sector-size", "4096", "--key-size", "512", s(&img)])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = libc::pid_t::try_from(child.id()).unwrap();
        let signal = |sig| {
            // SAFETY: kill(2) on our own child, which is not reaped until `wait` below.
            assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(
                child.try_wait().unwrap().is_none(),
                "cryptsetup finished before the kill"
            );
            assert!(Instant::now() < deadline, "no progress");
            if seqid(&img) >= start + 30 {
                signal(libc::SIGSTOP);
                let (h, _) = read(&img);
                if h.reencrypt_state().unwrap().unwrap().hot_segment.is_some() {
                    interrupted = true;
                    break;
                }
                signal(libc::SIGCONT);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        if interrupted {
            break;
        }
    }
    assert!(interrupted, "no kill landed inside a hotzone in 8 tries");

    let pool = Arc::new(CryptoPool::new(2));
    let ro = File::open(&img).unwrap();
    let (h, _) = Luks2Header::read(&ro).unwrap();
    let r =
        Reencryption::open(&ro, h, PASS, &UnlockOptions::default(), None, pool.clone()).unwrap();
    assert!(r.is_interrupted());
    assert_eq!(r.device_size().unwrap(), DATA);
    let done = r.done_bytes().unwrap();
    assert!(done > 0 && done < DATA, "done {done}");
    let mut buf = vec![0u8; DATA as usize];
    r.read(0, &mut buf).unwrap();
    assert!(
        buf == plain,
        "read-only view of cryptsetup's interrupted reencryption differs"
    );
    drop(r);

    let rw = open_rw(&img);
    let (h, _) = Luks2Header::read(&rw).unwrap();
    let mut r = Reencryption::open(&rw, h, PASS, &UnlockOptions::default(), None, pool).unwrap();
    r.recover().unwrap();
    assert!(!r.is_interrupted());
    buf.fill(0);
    r.read(0, &mut buf).unwrap();
    assert!(buf == plain, "after recovery");
    drop(r);
    // cryptsetup accepts the recovered state and finishes it.
    run(
        "cryptsetup",
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
    let vk = cryptsetup_volume_key(&img, &key);
    let (h, _) = read(&img);
    let spec = h.cipher_spec().unwrap();
    let mut out = read_range(&img, h.data_offset(), DATA as usize);
    default_engine_for(&spec)
        .unwrap()
        .new_cipher(&spec, &cryptblk_crypto::SecretKey::new(vk), 4096)
        .unwrap()
        .crypt(Direction::Decrypt, 0, &mut out)
        .unwrap();
    assert!(out == plain, "after cryptsetup finished");
}
