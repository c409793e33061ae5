//! A vhost-user-blk socket handed to another user, as libvirt needs (its QEMU runs as
//! `libvirt-qemu` and cannot connect to a root-owned 0755 socket): `serve --socket-owner
//! --socket-mode`, the same keys through `ctl disk-add`, and an unknown user refused before
//! anything is bound.
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};

use cryptblk_testutil::wait_for_path as wait_for;

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
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("raw.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let (vm1, vm2, control) = (
        dir.path().join("vm1.sock"),
        dir.path().join("vm2.sock"),
        dir.path().join("control.sock"),
    );
    let nobody = id("-u", "nobody");
    let nogroup = id("-g", "nobody");
    let mut serve = Command::new(env!("CARGO_BIN_EXE_cryptblk"))
        .arg("serve")
        .arg("--image")
        .arg(&image)
        .arg("--vhost-user-blk")
        .arg(&vm1)
        .args([
            "--socket-owner",
            &format!("nobody:{nogroup}"),
            "--socket-mode",
            "0660",
        ])
        .arg("--control")
        .arg(&control)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(&control, &mut serve);
    assert_eq!(owner_and_mode(&vm1), (nobody, nogroup, 0o660));

    // The same through the control socket, on a second disk (a copy: the first holds the lock).
    let image2 = dir.path().join("raw2.img");
    std::fs::copy(&image, &image2).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_cryptblk"))
        .arg("ctl")
        .arg("-s")
        .arg(&control)
        .args(["disk-add", "vm2", "--image"])
        .arg(&image2)
        .arg("--vhost-user-blk")
        .arg(&vm2)
        .args(["--socket-owner", ":nogroup", "--socket-mode", "0600"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(owner_and_mode(&vm2), (0, nogroup, 0o600));

    // An unknown user: a usage error naming it, and no socket.
    let vm3 = dir.path().join("vm3.sock");
    let out = Command::new(env!("CARGO_BIN_EXE_cryptblk"))
        .arg("ctl")
        .arg("-s")
        .arg(&control)
        .args(["disk-add", "vm3", "--image"])
        .arg(&image2)
        .arg("--vhost-user-blk")
        .arg(&vm3)
        .args(["--socket-owner", "no-such-user-cryptblk"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no user \"no-such-user-cryptblk\""),
        "{stderr}"
    );
    assert!(!vm3.exists());

    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
    assert!(serve.wait().unwrap().success());

    let out = Command::new(env!("CARGO_BIN_EXE_cryptblk"))
        .arg("serve")
        .arg("--image")
        .arg(&image)
        .arg("--vhost-user-blk")
        .arg(&vm1)
        .args(["--socket-mode", "rw-rw----"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("octal"), "{stderr}");
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
