//! LUKS1 interop with QEMU's `luks` block driver: it opens our images, we open its images.
mod common_core;
use common_core::*;
use cryptblk_crypto::CipherSpec;
use cryptblk_luks::{FormatOptions, HashAlg, LuksImage, LuksVersion, PbkdfOptions, UnlockOptions};

fn qemu_info(img: &std::path::Path, pass: &str) -> std::process::Output {
    std::process::Command::new(tool("qemu-img"))
        .args([
            "info",
            "--output=json",
            "--object",
            &format!("secret,id=s0,data={pass}"),
            "--image-opts",
            &format!("driver=luks,key-secret=s0,file.filename={}", s(img)),
        ])
        .output()
        .unwrap()
}

fn qemu_read(img: &std::path::Path, pass: &str) -> bool {
    std::process::Command::new(tool("qemu-io"))
        .args([
            "--object",
            &format!("secret,id=s0,data={pass}"),
            "--image-opts",
            &format!("driver=luks,key-secret=s0,file.filename={}", s(img)),
            "-c",
            "read 0 4096",
        ])
        .output()
        .unwrap()
        .status
        .success()
}

#[test]
fn qemu_opens_our_luks1_images() {
    let dir = tempfile::tempdir().unwrap();
    for (cipher, key_bytes) in [("aes-xts-plain64", 64), ("aes-cbc-essiv:sha256", 32)] {
        let p = dir.path().join("ours.img");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        let opts = FormatOptions {
            version: LuksVersion::V1,
            cipher: CipherSpec::parse_luks2(cipher, key_bytes).unwrap(),
            hash: HashAlg::Sha256,
            pbkdf: PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000),
            sector_size: 512,
            label: None,
            uuid: None,
        };
        let (img, _) = LuksImage::format(&f, &opts, b"qemu-pass", Some(3 << 20)).unwrap();
        let out = qemu_info(&p, "qemu-pass");
        assert!(
            out.status.success(),
            "qemu-img refused our {cipher} image: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(info["virtual-size"], 3 << 20, "{info}");
        assert_eq!(
            info["format-specific"]["data"]["uuid"],
            img.uuid(),
            "{info}"
        );
        // `qemu-img info` does not unlock; a read through qemu-io does.
        assert!(
            qemu_read(&p, "qemu-pass"),
            "qemu-io could not unlock our {cipher} image"
        );
        assert!(
            !qemu_read(&p, "wrong-pass"),
            "qemu accepted a wrong passphrase"
        );
    }
}

#[test]
fn we_open_qemu_made_luks1_images() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("qemu.img");
    qemu_img_kdf(
        &[
            "create", "-f", "luks", "--object", "secret,id=s0,data=from-qemu", "-o",
            "key-secret=s0,iter-time=100,cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha256",
            s(&p), "4M",
        ],
    );
    let f = open_rw(&p);
    let (img, _) = LuksImage::read(&f).unwrap();
    assert_eq!(img.version(), LuksVersion::V1);
    assert_eq!(
        img.cipher_spec().unwrap().to_luks2_string(),
        "aes-xts-plain64"
    );
    assert_eq!(img.data_size(f.metadata().unwrap().len()).unwrap(), 4 << 20);
    let (_, vk) = img
        .unlock(&f, b"from-qemu", &UnlockOptions::default())
        .unwrap();
    let key = write_key(dir.path(), "k", b"from-qemu");
    assert_eq!(vk.as_bytes(), &cryptsetup_volume_key(&p, &key)[..]);
}
