//! LUKS volumes made and checked by the real tools: QEMU's luks driver (LUKS1) and cryptsetup
//! (LUKS2 with 4096-byte sectors).
// The block crate's test helpers (QEMU tools, the aio harness), one copy for both crates.
#[path = "../../block/tests/common/mod.rs"]
mod common;

use common::{assert_same, cryptsetup_format, qemu_img, run};
use cryptblk_block::{BlockDevice, BlockErrorKind};
use cryptblk_volume::{open_luks_volume, VolumeError, VolumeOptions};
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::process::{Command, Stdio};

const PW: &[u8] = b"correct horse";

fn rw() -> VolumeOptions {
    VolumeOptions {
        writable: true,
        ..Default::default()
    }
}

fn qemu_secret() -> String {
    format!("secret,id=sec0,data={}", std::str::from_utf8(PW).unwrap())
}

fn qemu_opts(img: &Path) -> String {
    format!(
        "driver=luks,key-secret=sec0,file.filename={}",
        img.display()
    )
}

/// The plaintext as QEMU's luks driver decrypts it.
fn qemu_plain(img: &Path, dir: &Path) -> Vec<u8> {
    let out = dir.join("qemu-plain.raw");
    let _ = std::fs::remove_file(&out);
    let secret = qemu_secret();
    let opts = qemu_opts(img);
    qemu_img(&[
        "convert",
        "--object",
        &secret,
        "--image-opts",
        &opts,
        "-O",
        "raw",
        out.to_str().unwrap(),
    ]);
    std::fs::read(out).unwrap()
}

#[test]
fn luks1_interop_with_qemu_both_directions() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("q.luks");
    let secret = qemu_secret();
    // LUKS1 from cryptsetup (2 MiB header), then read and written by QEMU's luks driver.
    cryptsetup_format(&img, "luks1", 512, (2 + 8) << 20, PW);
    let opts = qemu_opts(&img);
    run(
        "qemu-io",
        &[
            "--object",
            &secret,
            "--image-opts",
            &opts,
            "-c",
            "write -P 0xab 4096 64k",
            "-c",
            "write -P 0x3c 7000k 333k",
        ],
    );

    // QEMU wrote, cryptblk reads.
    let expected = qemu_plain(&img, dir.path());
    {
        let vol = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap();
        assert_eq!(vol.size() as usize, expected.len());
        assert_eq!(vol.logical_block_size(), 512);
        assert!(vol.read_only());
        let err = vol.write_at(&[0u8; 512], 0).unwrap_err();
        assert_eq!(err.kind(), BlockErrorKind::ReadOnly);
        assert!(err.to_string().starts_with(img.to_str().unwrap()), "{err}");
        assert_same(
            &common::read_all(&vol, 100_000),
            &expected,
            "cryptblk read of qemu-written LUKS1",
        );
    }

    // cryptblk writes (aligned and unaligned), QEMU reads.
    let mut model = expected;
    {
        let vol = open_luks_volume(&img, PW, &rw()).unwrap();
        assert_eq!(vol.keyslot(), Some(0));
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for _ in 0..60 {
            let len = rng.gen_range(1..200_000usize);
            let off = rng.gen_range(0..model.len() - len);
            let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            vol.write_at(&data, off as u64).unwrap();
            model[off..off + len].copy_from_slice(&data);
        }
        vol.flush().unwrap();
    }
    assert_same(
        &qemu_plain(&img, dir.path()),
        &model,
        "qemu read of cryptblk-written LUKS1",
    );
}

#[test]
fn wrong_passphrase_and_locking_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("w.luks");
    // LUKS1 from cryptsetup (2 MiB header), then read and written by QEMU's luks driver.
    cryptsetup_format(&img, "luks1", 512, (2 + 1) << 20, PW);

    let err = open_luks_volume(&img, b"nope", &VolumeOptions::default()).unwrap_err();
    assert!(err.is_wrong_passphrase(), "{err}");
    assert!(err.to_string().contains("w.luks"), "{err}");

    let writer = open_luks_volume(&img, PW, &rw()).unwrap();
    for opts in [rw(), VolumeOptions::default()] {
        match open_luks_volume(&img, PW, &opts).unwrap_err() {
            VolumeError::Block(e) => assert_eq!(e.kind(), BlockErrorKind::Locked, "{e}"),
            other => panic!("expected a lock error, got {other}"),
        }
    }
    drop(writer);
    let _r1 = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap();
    let _r2 = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap();

    // Not a LUKS image at all.
    let plain = dir.path().join("plain.raw");
    std::fs::write(&plain, vec![0u8; 1 << 20]).unwrap();
    let err = open_luks_volume(&plain, PW, &VolumeOptions::default()).unwrap_err();
    assert!(matches!(err, VolumeError::Luks { .. }), "{err}");
}

#[test]
fn luks2_4k_sectors_from_cryptsetup_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("c.luks2");
    cryptsetup_format(&img, "luks2", 4096, 24 << 20, PW);

    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let size;
    let mut model;
    {
        let vol = open_luks_volume(&img, PW, &rw()).unwrap();
        assert_eq!(vol.logical_block_size(), 4096);
        size = vol.size() as usize;
        assert_eq!(
            size,
            8 << 20,
            "24 MiB file minus cryptsetup's 16 MiB header"
        );
        model = vec![0u8; size];
        vol.write_at(&model, 0).unwrap();
        for _ in 0..80 {
            let len = rng.gen_range(1..100_000usize);
            let off = rng.gen_range(0..size - len);
            let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            vol.write_at(&data, off as u64).unwrap();
            model[off..off + len].copy_from_slice(&data);
        }
        vol.flush().unwrap();
    }
    // cryptsetup still accepts the header and passphrase after our writes.
    let mut child = Command::new(common::tool("cryptsetup"))
        .args([
            "open",
            "--test-passphrase",
            "--key-file",
            "-",
            img.to_str().unwrap(),
        ])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), PW).unwrap();
    drop(child.stdin.take());
    assert!(
        child.wait().unwrap().success(),
        "cryptsetup no longer opens the image"
    );

    let vol = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap();
    assert_same(&common::read_all(&vol, 777_777), &model, "LUKS2 4K reopen");
}

#[test]
fn from_unlocked_after_format_then_reopen_with_passphrase() {
    use cryptblk_block::{OpenOptions, RawFile};
    use cryptblk_crypto::CryptoPool;
    use cryptblk_volume::LuksVolume;
    use std::sync::Arc;

    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("f.luks2");
    let payload = 2u64 << 20;
    let (header, key) = cryptblk_testutil::luks::cheap_luks2(&img, PW, payload, 4096);

    let data: Vec<u8> = (0..payload).map(|i| (i * 31 % 253) as u8).collect();
    {
        let raw = Arc::new(
            RawFile::open(
                &img,
                OpenOptions {
                    writable: true,
                    lock: true,
                },
            )
            .unwrap(),
        );
        let vol =
            LuksVolume::from_unlocked(raw, header, 0, &key, Arc::new(CryptoPool::new(2))).unwrap();
        assert_eq!(vol.size(), payload);
        assert!(!vol.read_only());
        vol.write_at(&data, 0).unwrap();
        vol.flush().unwrap();

        // A second opener is refused, and the lock error is findable in the error chain.
        let err = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap_err();
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&err);
        let mut kinds = Vec::new();
        while let Some(c) = cause {
            if let Some(b) = c.downcast_ref::<cryptblk_block::BlockError>() {
                kinds.push(b.kind());
            }
            cause = c.source();
        }
        assert_eq!(kinds, vec![BlockErrorKind::Locked], "{err}");
    }
    let vol = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap();
    assert_same(
        &common::read_all(&vol, 1 << 20),
        &data,
        "reopened after from_unlocked",
    );
}
