//! Guest end-to-end: growing a running VM's encrypted disk. The test guest (see guest_e2e.rs)
//! boots under QEMU on a LUKS2 image served by `cryptblk serve` over vhost-user-blk, and waits
//! for its disk to grow (`resize-grow` in scripts/guest/init.sh). The host runs `cryptblk ctl
//! disk-resize`: the daemon tells QEMU (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG), QEMU raises the
//! virtio config interrupt, and the guest's kernel must report the new capacity in
//! /sys/block/vda/size without a reboot. The guest then writes a crc32c-verified fio pattern
//! over the added sectors; after the daemon stops, `cryptblk convert` decrypts the image on the
//! host and those bytes must hash to what the guest read.

mod common;

use common::*;
use std::time::Duration;

/// Bound on the guest's boot (TCG boots in about 10-15 s).
const BOOT: Duration = Duration::from_secs(300);

#[test]
fn guest_sees_a_grown_luks2_disk_without_a_reboot() {
    let t = TestDir::new();
    let img = t.luks2("disk.luks", "32M", &t.key("key"));
    let serve = t.serve().control().disk(&img).name("vm-disk");
    let mut daemon = serve.vhost_user().start();
    let (old, new) = (32 * MIB, 48 * MIB);
    let vm = VmConfig::vhost_user(daemon.vhost_socket()).job("resize-grow", old);
    let mut guest = vm.timeout(300).boot(t.root(), "guest");

    // The guest has booted on the old size and waits.
    let waiting = "guest: waiting for /dev/vda to grow past 65536 sectors";
    guest.wait_for_console(waiting, "the guest did not boot", BOOT);
    let result = daemon.ctl_ok(&["disk-resize", "vm-disk", "48M"]);
    assert_eq!(result["old-size"], old, "{result}");
    assert_eq!(result["size"], new, "{result}");
    assert_eq!(result["guest-notified"], true, "{result}");

    let console = guest.wait_passed();
    assert!(
        console.contains("guest: /dev/vda grew from 65536 to 98304 sectors"),
        "{console}"
    );
    let written = guest_digest(&console);
    assert_eq!(daemon.terminate(), 0);

    // The host decrypts the grown image: what the guest wrote past the old end is there.
    let data = img.decrypt(&t.path("out.raw"));
    assert_eq!(data.len() as u64, new);
    assert_eq!(host_digest(&data[old as usize..]), written);
}
