//! Guest end-to-end: a real Linux guest (Debian 12's kernel and an initramfs built from Debian
//! packages by `scripts/guest/build-initramfs.sh`: busybox-static, fio, the virtio modules) boots
//! under qemu-system-x86_64 (`scripts/guest/run-guest.sh`), and fio writes a crc32c-verified
//! pattern to its virtio-blk disk and reads it back. The host then checks the disk itself: every
//! block carries fio's verify header for its own offset, and the bytes hash to what the guest
//! read. A second boot verifies the pattern again from a cold guest.
//!
//! The same guest then runs on a fresh LUKS2 image exported by `cryptblk serve` over
//! vhost-user-blk with 2 queues (guest RAM a shared memfd): write-verify, a reconnect with a
//! new guest for read-verify, SIGTERM, and on the host `cryptblk convert -O raw` must give back
//! fio's pattern with the digest both guests read.
//!
//! A LUKS1 image made by QEMU (`qemu-img create -f luks`, aes-xts-plain64) is served the same
//! way; after the guest's write-verify, `qemu-img convert` (QEMU's own LUKS driver) must decrypt
//! it on the host to the pattern the guest wrote.
//!
//! A LUKS2 disk in Ceph RBD (a throwaway single-node cluster) is served the same way; librbd's
//! own encryption then decrypts it on the host to what the guest wrote.
//!
//! The kernel and initramfs are cached under the cargo target dir by a content key, so only the
//! first run pays for building them (about 10 s); each boot takes about 10-15 s under TCG.

mod common;

use common::*;
use std::process::Command;

/// fio's block size for the jobs (run-guest.sh's default).
const BS: u64 = 64 * 1024;
/// The start of fio's verify header (fio 3.33, `struct verify_header`): magic, type, len.
const FIO_VERIFY_MAGIC: u16 = 0xacca;

/// Boots the guest on `disk` with `job` over the first `size` bytes; returns the console.
/// Panics with the console's tail unless the guest passed.
fn boot(t: &TestDir, disk: VmConfig, job: &str, size: u64) -> String {
    let vm = disk.job(job, size).bs(BS).timeout(300);
    vm.run(t.root(), job)
}

/// Every `BS` block of `data` starts with fio's verify header for its own offset.
fn assert_fio_pattern(data: &[u8]) {
    assert!(data.iter().any(|&b| b != 0), "the disk is still all zeros");
    for (i, block) in data.chunks(BS as usize).enumerate() {
        let offset = i as u64 * BS;
        let magic = u16::from_le_bytes(block[0..2].try_into().unwrap());
        let len = u32::from_le_bytes(block[4..8].try_into().unwrap());
        let hdr_offset = u64::from_le_bytes(block[16..24].try_into().unwrap());
        assert_eq!(
            (magic, u64::from(len), hdr_offset),
            (FIO_VERIFY_MAGIC, BS, offset),
            "block at offset {offset} does not carry fio's verify header for that offset"
        );
    }
}

#[test]
fn guest_fio_write_verify_on_raw_virtio_disk() {
    let t = TestDir::new();
    let disk_size = 64 * MIB;
    let size = 32 * MIB;
    let disk = t.raw("disk.raw", disk_size);

    let console = boot(&t, VmConfig::raw_disk(&disk), "write-verify", size);
    let data = std::fs::read(&disk).unwrap();
    assert_eq!(data.len() as u64, disk_size);
    assert_fio_pattern(&data[..size as usize]);
    assert!(
        data[size as usize..].iter().all(|&b| b == 0),
        "fio wrote beyond --size"
    );
    assert_eq!(guest_digest(&console), host_digest(&data[..size as usize]));

    // A fresh guest verifies the pattern from the disk alone.
    let console = boot(&t, VmConfig::raw_disk(&disk), "read-verify", size);
    assert_eq!(guest_digest(&console), host_digest(&data[..size as usize]));
}

#[test]
fn guest_fio_on_luks2_over_vhost_user_blk_two_queues() {
    let t = TestDir::new();
    let img = t.luks2("img.luks", "64M", &t.key("key"));
    let size = 32 * MIB;
    let serve = t
        .serve()
        .vhost_user()
        .disk(&img)
        .args(&["--num-queues", "2"]);
    let mut daemon = serve.log_level("info").start();
    let disk = VmConfig::vhost_user(daemon.vhost_socket()).queues(2);

    let console = boot(&t, disk.clone(), "write-verify", size);
    assert!(
        console.contains("2 queue(s)"),
        "the guest did not get 2 queues:\n{console}"
    );
    let written = guest_digest(&console);
    // QEMU is gone; the daemon takes the next guest, which verifies the pattern again.
    let console = boot(&t, disk, "read-verify", size);
    assert_eq!(guest_digest(&console), written);
    assert_eq!(daemon.terminate(), 0, "cryptblk serve:\n{}", daemon.log());

    // The image decrypts on the host to exactly what the guests wrote and read.
    let data = img.decrypt(&t.path("out.raw"));
    assert!(data.len() as u64 >= size);
    assert_fio_pattern(&data[..size as usize]);
    assert_eq!(host_digest(&data[..size as usize]), written);
}

#[test]
fn guest_fio_on_qemu_made_luks1_over_vhost_user_blk() {
    let t = TestDir::new();
    let key = t.key("key");
    let out = t.path("out.raw");
    // QEMU writes LUKS1: AES-256-XTS (512-bit key), plain64 IVs, a cheap PBKDF2 keyslot.
    let cipher = "cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,iter-time=10";
    let img = t.luks1_by_qemu("img.luks1", "64M", &key, cipher);
    let size = 32 * MIB;
    let mut daemon = t.serve().vhost_user().disk(&img).log_level("info").start();
    let vm = VmConfig::vhost_user(daemon.vhost_socket());
    let written = guest_digest(&boot(&t, vm, "write-verify", size));
    let output = daemon.log();
    assert!(output.contains("(luks"), "not served as LUKS: {output}");
    assert_eq!(daemon.terminate(), 0, "cryptblk serve:\n{output}");

    // QEMU's LUKS driver decrypts the image on the host to exactly what the guest wrote.
    let secret = format!("secret,id=sec0,file={}", s(&key));
    let os = std::ffi::OsStr::new;
    let image_opts = format!(
        "driver=luks,key-secret=sec0,file.driver=file,file.filename={}",
        img.display()
    );
    tool(
        "qemu-img",
        argv!(
            "{} {} {} {} {} {} {} {}",
            os("convert"),
            os("--object"),
            std::ffi::OsStr::new(&secret),
            os("--image-opts"),
            std::ffi::OsStr::new(&image_opts),
            os("-O"),
            os("raw"),
            out.as_os_str()
        ),
    )
    .ok();
    let data = std::fs::read(&out).unwrap();
    assert_eq!(data.len() as u64, 64 * MIB);
    assert_fio_pattern(&data[..size as usize]);
    assert_eq!(host_digest(&data[..size as usize]), written);
    // And the image itself holds ciphertext, not the pattern.
    let raw = std::fs::read(&img).unwrap();
    assert!(!raw.windows(64).any(|w| w == &data[..64]));
}

/// A guest on a LUKS2 disk that lives in Ceph RBD (a throwaway single-node cluster), served
/// over vhost-user-blk: fio write-verify in the guest, then librbd's own encryption (QEMU's rbd
/// driver with `encrypt.format=luks2`) decrypts the image on the host to the pattern and digest
/// the guest read.
#[test]
fn guest_fio_on_luks2_in_rbd_over_vhost_user_blk() {
    let Some(cluster) = cryptblk_testutil::ceph::start() else {
        return;
    };
    let t = TestDir::new();
    let key = t.key("key");
    let out = t.path("out.raw");
    let image = cluster.name("guest");
    format_luks2(std::path::Path::new(&image), &key, "32M");
    let size = 32 * MIB;
    let mut daemon = t.serve().vhost_user().image(&image).key(&key).start();
    let vm = VmConfig::vhost_user(daemon.vhost_socket());
    let written = guest_digest(&boot(&t, vm, "write-verify", size));
    assert_eq!(daemon.terminate(), 0, "cryptblk serve:\n{}", daemon.log());

    let opts = format!(
        "if=driver=rbd,pool=rbd,image=guest,conf={},encrypt.format=luks2,encrypt.key-secret=s0",
        cluster.conf.display()
    );
    let qemu = Command::new("qemu-img")
        .args(["dd", "--object"])
        .arg(format!("secret,id=s0,file={}", key.display()))
        .args(["--image-opts", "-O", "raw", "bs=1M", &opts])
        .arg(format!("of={}", out.display()))
        .output()
        .unwrap();
    assert!(
        qemu.status.success(),
        "qemu-img dd: {}",
        String::from_utf8_lossy(&qemu.stderr)
    );
    let data = std::fs::read(&out).unwrap();
    assert_eq!(data.len() as u64, size);
    assert_fio_pattern(&data);
    assert_eq!(host_digest(&data), written);
}
