//! A vhost-user-blk socket handed to another user, as libvirt needs (its QEMU runs as
//! `libvirt-qemu` and cannot connect to a root-owned 0755 socket): `serve --socket-owner
//! --socket-mode`, the same keys through `ctl disk-add`, and an unknown user refused before
//! anything is bound.
mod common;

use common::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

fn owner_and_mode(path: &Path) -> (u32, u32, u32) {
    let m = std::fs::symlink_metadata(path).unwrap();
    (m.uid(), m.gid(), m.permissions().mode() & 0o777)
}

fn id(flag: &str, name: &str) -> u32 {
    let out = Command::new("id").args([flag, name]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[test]
fn sockets_get_the_owner_and_mode_asked_for() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        cryptblk_testutil::skip("changing a socket's owner needs root");
        return;
    }
    let t = TestDir::new();
    let image = t.raw("raw.img", 4 << 20);
    let (vm1, vm2, vm3) = (t.path("vm1.sock"), t.path("vm2.sock"), t.path("vm3.sock"));
    let nobody = id("-u", "nobody");
    let nogroup = id("-g", "nobody");
    let owner = format!("nobody:{nogroup}");
    let access = ["--socket-owner", &owner, "--socket-mode", "0660"];
    let serve = t.serve().disk(&image).vhost_user_at(&vm1).args(&access);
    let mut daemon = serve.control().start();
    assert_eq!(owner_and_mode(&vm1), (nobody, nogroup, 0o660));

    // The same through the control socket, on a second disk (a copy: the first holds the lock).
    let image2 = t.path("raw2.img");
    std::fs::copy(&image, &image2).unwrap();
    let control = s(daemon.control());
    cryptblk(argv!("ctl -s {} disk-add vm2 --image {} --vhost-user-blk {} --socket-owner :nogroup --socket-mode 0600", control, image2, vm2))
    .ok();
    assert_eq!(owner_and_mode(&vm2), (0, nogroup, 0o600));

    // An unknown user: a usage error naming it, and no socket.
    let out = cryptblk(argv!("ctl -s {} disk-add vm3 --image {} --vhost-user-blk {} --socket-owner no-such-user-cryptblk", control, image2, vm3));
    out.expect_code(code::USAGE);
    assert!(
        out.stderr.contains("no user \"no-such-user-cryptblk\""),
        "{}",
        out.stderr
    );
    assert!(!vm3.exists());
    assert_eq!(daemon.terminate(), 0);

    let mode = ["--socket-mode", "rw-rw----"];
    let out = t.serve().disk(&image).vhost_user_at(&vm1).args(&mode).run();
    out.expect_code(code::USAGE);
    assert!(out.stderr.contains("octal"), "{}", out.stderr);
    assert!(!vm1.exists());
}

/// The documented libvirt domain (contrib/libvirt) is valid for libvirt's schema.
#[test]
fn libvirt_domain_xml_validates() {
    if Command::new("virt-xml-validate")
        .arg("--help")
        .output()
        .is_err()
    {
        cryptblk_testutil::skip(
            "virt-xml-validate is not installed (apt install libvirt-clients libxml2-utils)",
        );
        return;
    }
    let xml = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/libvirt/cryptblk-vm.xml");
    let out = Command::new("virt-xml-validate")
        .arg(&xml)
        .arg("domain")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&xml).unwrap();
    for needed in [
        "type='vhostuser'",
        "<source type='memfd'/>",
        "<access mode='shared'/>",
        "<reconnect enabled='yes' timeout='1'/>",
    ] {
        assert!(text.contains(needed), "the example lacks {needed}");
    }
}
