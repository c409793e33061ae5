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

use common::guest::{build_guest, host_digest, scripts, Serve};
use common::MIB;
use std::path::Path;
use std::process::{Command, Stdio};
/// fio's block size for the jobs (run-guest.sh's default).
const BS: u64 = 64 * 1024;
/// The start of fio's verify header (fio 3.33, `struct verify_header`): magic, type, len.
const FIO_VERIFY_MAGIC: u16 = 0xacca;

/// Boots the guest on `disk` (run-guest.sh's disk arguments) with `job` over the first `size`
/// bytes; returns the console. Panics with the console's tail unless the guest passed.
fn boot(artifacts: &Path, disk: &[&str], job: &str, size: u64, log: &Path) -> String {
    let out = Command::new(scripts().join("run-guest.sh"))
        .args(disk)
        .args(["--job", job, "--size", &size.to_string()])
        .args(["--bs", &BS.to_string(), "--timeout", "300"])
        .arg("--artifacts")
        .arg(artifacts)
        .arg("--log")
        .arg(log)
        .stdin(Stdio::null())
        .output()
        .expect("run scripts/guest/run-guest.sh");
    let console = std::fs::read_to_string(log).unwrap_or_default();
    if !out.status.success() {
        let tail: Vec<&str> = console.lines().rev().take(40).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        panic!(
            "guest {job} did not pass ({}):\n{}\n--- console tail ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            tail.join("\n")
        );
    }
    assert!(
        console.lines().any(|l| l == "GUEST-RESULT: PASS"),
        "{console}"
    );
    console
}

/// The "GUEST-SHA256: <hex>" digest the guest printed of the bytes it read back.
fn guest_digest(console: &str) -> String {
    console
        .lines()
        .find_map(|l| l.strip_prefix("GUEST-SHA256: "))
        .map(|d| d.trim().to_string())
        .unwrap_or_else(|| panic!("no GUEST-SHA256 line in the console:\n{console}"))
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
    let artifacts = build_guest();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.raw");
    let disk_size = 64 * MIB;
    let size = 32 * MIB;
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(disk_size)
        .unwrap();
    let disk_arg = disk.to_str().unwrap();

    let console = boot(
        &artifacts,
        &["--disk-raw", disk_arg],
        "write-verify",
        size,
        &dir.path().join("write.log"),
    );
    let data = std::fs::read(&disk).unwrap();
    assert_eq!(data.len() as u64, disk_size);
    assert_fio_pattern(&data[..size as usize]);
    assert!(
        data[size as usize..].iter().all(|&b| b == 0),
        "fio wrote beyond --size"
    );
    assert_eq!(guest_digest(&console), host_digest(&data[..size as usize]));

    // A fresh guest verifies the pattern from the disk alone.
    let console = boot(
        &artifacts,
        &["--disk-raw", disk_arg],
        "read-verify",
        size,
        &dir.path().join("read.log"),
    );
    assert_eq!(guest_digest(&console), host_digest(&data[..size as usize]));
}

fn cryptblk_ok(args: &[&std::ffi::OsStr]) {
    let out = Command::new(env!("CARGO_BIN_EXE_cryptblk"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cryptblk {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn guest_fio_on_luks2_over_vhost_user_blk_two_queues() {
    let artifacts = build_guest();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let (key, img, socket, out) = (
        path("key"),
        path("img.luks"),
        path("vub.sock"),
        path("out.raw"),
    );
    std::fs::write(&key, b"guest end-to-end passphrase").unwrap();
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    cryptblk_ok(&[
        os("format"),
        os("--type"),
        os("luks2"),
        os("--pbkdf"),
        os("pbkdf2"),
        os("--pbkdf-force-iterations"),
        os("1000"),
        os("--key-file"),
        key.as_os_str(),
        img.as_os_str(),
        os("64M"),
    ]);
    let size = 32 * MIB;
    let daemon = Serve::start(
        Path::new(env!("CARGO_BIN_EXE_cryptblk")),
        &[
            os("--vhost-user-blk"),
            socket.as_os_str(),
            os("--image"),
            img.as_os_str(),
            os("--key-file"),
            key.as_os_str(),
            os("--num-queues"),
            os("2"),
        ],
        &socket,
        path("serve.log"),
    );
    let disk = [
        "--vhost-user-blk",
        socket.to_str().unwrap(),
        "--queues",
        "2",
    ];

    let console = boot(&artifacts, &disk, "write-verify", size, &path("write.log"));
    assert!(
        console.contains("2 queue(s)"),
        "the guest did not get 2 queues:\n{console}"
    );
    let written = guest_digest(&console);
    // QEMU is gone; the daemon takes the next guest, which verifies the pattern again.
    let console = boot(&artifacts, &disk, "read-verify", size, &path("read.log"));
    assert_eq!(guest_digest(&console), written);
    let output = daemon.output();
    let status = daemon.terminate();
    assert!(status.success(), "cryptblk serve: {status}\n{output}");

    // The image decrypts on the host to exactly what the guests wrote and read.
    cryptblk_ok(&[
        os("convert"),
        os("-O"),
        os("raw"),
        os("--source-key-file"),
        key.as_os_str(),
        img.as_os_str(),
        out.as_os_str(),
    ]);
    let data = std::fs::read(&out).unwrap();
    assert!(data.len() as u64 >= size);
    assert_fio_pattern(&data[..size as usize]);
    assert_eq!(host_digest(&data[..size as usize]), written);
}

#[test]
fn guest_fio_on_qemu_made_luks1_over_vhost_user_blk() {
    let artifacts = build_guest();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let (key, img, socket, out) = (
        path("key"),
        path("img.luks1"),
        path("vub.sock"),
        path("out.raw"),
    );
    std::fs::write(&key, b"guest end-to-end luks1 passphrase").unwrap();
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    let secret = format!("secret,id=sec0,file={}", key.display());
    // QEMU writes LUKS1: AES-256-XTS (512-bit key), plain64 IVs, a cheap PBKDF2 keyslot.
    common::qemu_img_kdf([
        os("create"),
        os("-q"),
        os("-f"),
        os("luks"),
        os("--object"),
        std::ffi::OsStr::new(&secret),
        os("-o"),
        os("key-secret=sec0,cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,iter-time=10"),
        img.as_os_str(),
        os("64M"),
    ])
    .ok();
    let size = 32 * MIB;
    let daemon = Serve::start(
        Path::new(env!("CARGO_BIN_EXE_cryptblk")),
        &[
            os("--vhost-user-blk"),
            socket.as_os_str(),
            os("--image"),
            img.as_os_str(),
            os("--key-file"),
            key.as_os_str(),
        ],
        &socket,
        path("serve.log"),
    );
    let disk = ["--vhost-user-blk", socket.to_str().unwrap()];
    let console = boot(&artifacts, &disk, "write-verify", size, &path("write.log"));
    let written = guest_digest(&console);
    let output = daemon.output();
    assert!(output.contains("(luks"), "not served as LUKS: {output}");
    let status = daemon.terminate();
    assert!(status.success(), "cryptblk serve: {status}\n{output}");

    // QEMU's LUKS driver decrypts the image on the host to exactly what the guest wrote.
    let image_opts = format!(
        "driver=luks,key-secret=sec0,file.driver=file,file.filename={}",
        img.display()
    );
    common::tool(
        "qemu-img",
        [
            os("convert"),
            os("--object"),
            std::ffi::OsStr::new(&secret),
            os("--image-opts"),
            std::ffi::OsStr::new(&image_opts),
            os("-O"),
            os("raw"),
            out.as_os_str(),
        ],
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
    let artifacts = build_guest();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let (key, socket, out) = (path("key"), path("vub.sock"), path("out.raw"));
    std::fs::write(&key, b"guest on rbd passphrase").unwrap();
    let image = cluster.name("guest");
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    cryptblk_ok(&[
        os("format"),
        os("--pbkdf"),
        os("pbkdf2"),
        os("--pbkdf-force-iterations"),
        os("1000"),
        os("--key-file"),
        key.as_os_str(),
        std::ffi::OsStr::new(&image),
        os("32M"),
    ]);
    let size = 32 * MIB;
    let daemon = Serve::start(
        Path::new(env!("CARGO_BIN_EXE_cryptblk")),
        &[
            os("--vhost-user-blk"),
            socket.as_os_str(),
            os("--image"),
            std::ffi::OsStr::new(&image),
            os("--key-file"),
            key.as_os_str(),
        ],
        &socket,
        path("serve.log"),
    );
    let disk = ["--vhost-user-blk", socket.to_str().unwrap()];
    let console = boot(&artifacts, &disk, "write-verify", size, &path("write.log"));
    let written = guest_digest(&console);
    let output = daemon.output();
    let status = daemon.terminate();
    assert!(status.success(), "cryptblk serve: {status}\n{output}");

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
