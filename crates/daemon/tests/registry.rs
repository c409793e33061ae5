//! The disk registry: names and sockets are unique, a failed attach leaves nothing behind
//! (no name, no export, no lock on the image) and the other disks untouched.
mod common;

use common::*;
use cryptblk_control::api::{DiskState, ErrorKind};

#[test]
fn attach_list_stats_and_detach() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon();
    let info = d
        .add_disk(disk("a", &raw_image(dir.path(), "a.raw", 1 << 20)))
        .unwrap();
    let attached = info.attached.unwrap();
    assert_eq!((attached.format.as_str(), attached.size), ("raw", 1 << 20));
    assert!(attached.nbd_export);
    let err = d
        .add_disk(disk("a", &raw_image(dir.path(), "b.raw", 1 << 20)))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    let list = d.list();
    assert_eq!(list.disks.len(), 1);
    assert_eq!(list.disks[0].state, DiskState::Attached);
    assert_eq!(d.stats(Some("a")).unwrap().disks.len(), 1);
    assert_eq!(
        d.stats(Some("x")).unwrap_err().kind(),
        ErrorKind::NoSuchDisk
    );
    d.remove_disk("a", false).unwrap();
    assert_eq!(
        d.remove_disk("a", false).unwrap_err().kind(),
        ErrorKind::NoSuchDisk
    );
    assert!(d.list().disks.is_empty());
}

#[test]
fn a_failed_attach_rolls_back_and_leaves_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon();
    d.add_disk(disk("keep", &raw_image(dir.path(), "keep.raw", 1 << 20)))
        .unwrap();

    // Unlock fails: the name is free again and the image is not left locked.
    let image = luks_image(dir.path(), "v.luks");
    let mut wrong = disk("v", &image);
    wrong.key_file = Some(key_file(dir.path(), "wrong", b"not it"));
    let err = d.add_disk(wrong).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WrongPassphrase);
    assert_eq!(d.list().disks.len(), 1);

    // The export fails after the unlock (the socket path is a regular file): rolled back too.
    let mut bad_socket = disk("v", &image);
    bad_socket.key_file = Some(key_file(dir.path(), "right", PASSPHRASE));
    let not_a_socket = dir.path().join("not-a-socket");
    std::fs::write(&not_a_socket, b"x").unwrap();
    bad_socket.vhost_user_blk = Some(not_a_socket.clone());
    let err = d.add_disk(bad_socket.clone()).unwrap_err();
    assert!(
        cryptblk_daemon::chain(&err).contains("not a socket"),
        "{}",
        cryptblk_daemon::chain(&err)
    );
    assert_eq!(std::fs::read(&not_a_socket).unwrap(), b"x");
    assert_eq!(d.list().disks.len(), 1);

    // Nothing of either attempt remains: the same disk attaches now.
    bad_socket.vhost_user_blk = None;
    let info = d.add_disk(bad_socket).unwrap();
    assert_eq!(info.attached.unwrap().format, "luks");
    assert_eq!(d.list().disks.len(), 2);
    d.shutdown().unwrap();
    assert!(d.list().disks.is_empty());
}

#[test]
fn configuration_is_checked_before_anything_opens() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon();
    let mut c = disk("q", &raw_image(dir.path(), "q.raw", 1 << 20));
    c.queue_size = 100;
    let err = d.add_disk(c).unwrap_err();
    assert!(err.to_string().contains("queue-size 100"), "{err}");
    let mut c = disk("n", &raw_image(dir.path(), "n.raw", 1 << 20));
    c.nbd_export = Some(false);
    let err = d.add_disk(c).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Conflict);
    assert!(err.to_string().contains("no export"), "{err}");
    assert!(d.list().disks.is_empty());
}

/// The daemon opens every disk through the volume's door: a raw image given a key is refused
/// (serving it plain when the user meant it encrypted is the worse mistake) and left unlocked,
/// a qcow2 file is refused before it is opened, and a LUKS image with no key source and no
/// clevis token asks for one.
#[test]
fn the_format_decides_what_a_key_means() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon();
    let raw = raw_image(dir.path(), "plain.raw", 1 << 20);
    let mut keyed = disk("plain", &raw);
    keyed.key_file = Some(key_file(dir.path(), "k", PASSPHRASE));
    let err = d.add_disk(keyed).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Usage);
    assert_eq!(
        err.to_string(),
        format!(
            "a key file is given, but {} is raw, not LUKS",
            raw.display()
        )
    );
    assert!(d.list().disks.is_empty());
    let info = d.add_disk(disk("plain", &raw)).unwrap();
    assert_eq!(info.attached.unwrap().format, "raw");

    let qcow2 = dir.path().join("q.qcow2");
    let mut header = vec![0u8; 4096];
    header[..4].copy_from_slice(b"QFI\xfb");
    std::fs::write(&qcow2, &header).unwrap();
    let err = d.add_disk(disk("q", &qcow2)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Usage);
    assert!(err.to_string().contains("is qcow2"), "{err}");

    let luks = luks_image(dir.path(), "v.luks");
    let err = d.add_disk(disk("v", &luks)).unwrap_err();
    assert!(
        cryptblk_daemon::chain(&err).contains("give a key-file"),
        "{}",
        cryptblk_daemon::chain(&err)
    );
    assert_eq!(d.list().disks.len(), 1);
    d.shutdown().unwrap();
}
