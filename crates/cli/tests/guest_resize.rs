//! Guest end-to-end: growing a running VM's encrypted disk. The test guest (see guest_e2e.rs)
//! boots under QEMU on a LUKS2 image served by `cryptblk serve` over vhost-user-blk, and waits
//! for its disk to grow (`resize-grow` in scripts/guest/init.sh). The host runs `cryptblk ctl
//! disk-resize`: the daemon tells QEMU (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG), QEMU raises the
//! virtio config interrupt, and the guest's kernel must report the new capacity in
//! /sys/block/vda/size without a reboot. The guest then writes a crc32c-verified fio pattern
//! over the added sectors; after the daemon stops, `cryptblk convert` decrypts the image on the
//! host and those bytes must hash to what the guest read.

mod common;

use common::guest::{build_guest, host_digest, scripts};
use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Bound on the guest's boot and on its whole run (TCG boots in about 10-15 s).
const BOUND: Duration = Duration::from_secs(300);

#[test]
fn guest_sees_a_grown_luks2_disk_without_a_reboot() {
    let artifacts = build_guest();
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("guest-resize"));
    let img = dir.path().join("disk.luks");
    format_luks2(&img, &key, "32M");
    let control = dir.path().join("ctl.sock");
    let socket = dir.path().join("vub.sock");
    let serve = ServeProcess::start(
        &[
            "--control",
            s(&control),
            "--image",
            s(&img),
            "--key-file",
            s(&key),
            "--name",
            "vm-disk",
            "--vhost-user-blk",
            s(&socket),
        ],
        &socket,
    );
    let console_log = dir.path().join("console.log");
    let (old, new) = (32 * MIB, 48 * MIB);
    let mut guest = Command::new(scripts().join("run-guest.sh"))
        .args(["--vhost-user-blk", s(&socket)])
        .args(["--job", "resize-grow", "--size", &old.to_string()])
        .args(["--timeout", "300", "--artifacts", s(&artifacts)])
        .arg("--log")
        .arg(&console_log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run scripts/guest/run-guest.sh");
    let console = || std::fs::read_to_string(&console_log).unwrap_or_default();

    // The guest has booted on the old size and waits.
    let deadline = Instant::now() + BOUND;
    while !console().contains("guest: waiting for /dev/vda to grow past 65536 sectors") {
        if let Some(status) = guest.try_wait().unwrap() {
            panic!("the guest ended ({status}) before waiting:\n{}", console());
        }
        assert!(
            Instant::now() < deadline,
            "the guest did not boot:\n{}",
            console()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let result = ctl_json(&control, &["disk-resize", "vm-disk", "48M"]);
    assert_eq!(result["old-size"], old, "{result}");
    assert_eq!(result["size"], new, "{result}");
    assert_eq!(result["guest-notified"], true, "{result}");

    let out = guest.wait_with_output().unwrap();
    let console = console();
    assert!(
        out.status.success(),
        "the guest did not pass ({}): {}\n{console}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        console.contains("guest: /dev/vda grew from 65536 to 98304 sectors"),
        "{console}"
    );
    let written = console
        .lines()
        .find_map(|l| l.strip_prefix("GUEST-SHA256: "))
        .map(|d| d.trim().to_string())
        .unwrap_or_else(|| panic!("no GUEST-SHA256 line:\n{console}"));
    assert_eq!(serve.terminate(), 0);

    // The host decrypts the grown image: what the guest wrote past the old end is there.
    let data = cryptblk_decrypt(&img, &key, &dir.path().join("out.raw"));
    assert_eq!(data.len() as u64, new);
    assert_eq!(host_digest(&data[old as usize..]), written);
}
