//! Live migration and RBD: a disk migrates out of RBD into a file and from a file into RBD
//! (the precopy stream), and a shared image is handed over without copying. Steps of
//! `rbd.rs`'s test.
use super::{qemu_io, refused_as_locked};
use crate::common::*;
use cryptblk_testutil::ceph::Cluster;
use std::path::Path;

/// A disk served from RBD migrates live to a daemon that receives it into a local file (the
/// existing precopy stream, ciphertext only): the destination serves what was written.
pub fn migrates_out_of_rbd_into_a_file(cluster: &Cluster, d: &TestDir, key: &Path) {
    let received = d.path("received.luks");
    migrate_vol(
        d,
        key,
        "out",
        &cluster.name("served"),
        s(&received),
        &["write -P 0x4d 3M 1M"],
        &["read -P 0x4d 3M 1M", "read -P 0x9e 7M 96k"],
    );
}

/// A local LUKS2 disk migrates live into a new RBD image on the other daemon: the destination
/// serves what was written, and librbd's encryption reads it from the image afterwards.
pub fn migrates_from_a_file_into_rbd(cluster: &Cluster, d: &TestDir, key: &Path) {
    let local = d.path("local.luks");
    format_luks2(&local, key, "16M");
    migrate_vol(
        d,
        key,
        "in",
        s(&local),
        &cluster.name("received"),
        &["write -P 0x3c 5M 1M"],
        &["read -P 0x3c 5M 1M", "write -P 0x3d 9M 64k"],
    );
    qemu_io(
        cluster,
        "received",
        "luks2",
        key,
        &["read -P 0x3c 5M 1M", "read -P 0x3d 9M 64k"],
    );
}

/// Two daemons reach one RBD image: `migrate-start --shared` copies nothing and hands the
/// image's exclusive lock over at switchover. The destination serves what the source wrote,
/// its own writes land in the image (librbd's encryption reads both afterwards), and the
/// source can no longer write. A mismatched pair (shared source, copying destination, or the
/// other way round) is refused before anything moves.
pub fn hands_a_shared_image_over_without_copying(cluster: &Cluster, d: &TestDir, key: &Path) {
    let name = cluster.name("shared");
    format_luks2(Path::new(&name), key, "32M");
    let serve = d.serve_as("sh-a").image(&name).name("vol").key(key);
    let mut source = serve.nbd().control().start();
    let mut destination = d.serve_as("sh-b").nbd().control().start();
    source.qemu_io("vol", &["write -P 0x5a 2M 1M", "flush"]);
    // A refused source leaves the destination listening (for the right one): the refusals'
    // listeners get disk names of their own.
    let incoming = |disk: &str, image: &str| {
        let listen = format!("unix:{}", s(&d.path(&format!("sh-{disk}.sock"))));
        destination.ctl_ok(&argv!(
            "migrate-incoming {} --image {} --listen {} --key-file {} --nbd-export",
            disk,
            image,
            &listen,
            key
        ));
        listen
    };
    // A destination that would copy into a new image refuses a shared source...
    let listen = incoming("new-file", s(&d.path("copy.luks")));
    source
        .ctl(&["migrate-start", "vol", "--to", &listen, "--shared"])
        .expect_code(code::OTHER)
        .error_line(&["hands over shared storage", "creates a new image"]);
    // ...and one on the shared image refuses a source that would copy.
    let listen = incoming("copying", &name);
    source
        .ctl(&["migrate-start", "vol", "--to", &listen])
        .expect_code(code::OTHER)
        .error_line(&["takes over the existing image rbd:rbd/shared", "--shared"]);
    assert!(!d.path("copy.luks").exists());
    for refused in ["new-file", "copying"] {
        destination.ctl_ok(&["migrate-cancel", refused]);
    }
    source.qemu_io("vol", &["read -P 0x5a 2M 1M"]);

    let listen = incoming("vol", &name);
    let started = source.ctl_ok(&["migrate-start", "vol", "--to", &listen, "--shared"]);
    assert_eq!(started["shared"], true, "{started}");
    source.ctl_ok(&["migrate-switchover", "vol"]);
    let done = source.wait_migrate("vol", "completed");
    let outgoing = &done["outgoing"];
    assert_eq!(outgoing["bytes-sent"], 0, "nothing is copied: {done}");
    eprintln!("shared hand-off downtime: {} ms", outgoing["downtime-ms"]);
    wait_attached(&destination, "the handed-over disk");
    let io = ["read -P 0x5a 2M 1M", "write -P 0x5b 6M 64k", "flush"];
    destination.qemu_io("vol", &io);
    // The source handed its lock over: it cannot write, and detaching it touches nothing.
    let fenced = source.qemu_io_out("vol", &["write -P 0x66 6M 64k"]);
    assert!(
        fenced.stdout.contains("failed") || fenced.code != 0,
        "the source still wrote after the hand-off: {}",
        fenced.stdout
    );
    source.ctl_ok(&["disk-remove", "vol"]);
    // The destination holds the lock now.
    refused_as_locked(&name, key);
    assert_eq!(destination.terminate(), 0);
    assert_eq!(source.terminate(), 0);
    qemu_io(
        cluster,
        "shared",
        "luks2",
        key,
        &["read -P 0x5a 2M 1M", "read -P 0x5b 6M 64k"],
    );
}

/// Waits (at most 30 s) until the disk "vol" of `daemon` is attached.
fn wait_attached(daemon: &Daemon, what: &str) {
    let bound = std::time::Duration::from_secs(30);
    daemon.wait_ctl(&["disk-list"], &format!("{what} attached"), bound, |list| {
        list["disks"].as_array().is_some_and(|d| {
            d.iter()
                .any(|d| d["name"] == "vol" && d["state"] == "attached")
        })
    });
}

/// Serves `source` as disk "vol" on one daemon, runs `before` on it over NBD, migrates it
/// (precopy, then switchover) into `target` on a second daemon, runs `after` there, and stops
/// both.
fn migrate_vol(
    d: &TestDir,
    key: &Path,
    tag: &str,
    source: &str,
    target: &str,
    before: &[&str],
    after: &[&str],
) {
    let serve = d
        .serve_as(&format!("{tag}-a"))
        .image(source)
        .name("vol")
        .key(key);
    let mut source = serve.nbd().control().start();
    let mut destination = d.serve_as(&format!("{tag}-b")).nbd().control().start();
    let mut before = before.to_vec();
    before.push("flush");
    source.qemu_io("vol", &before);
    let listen = format!("unix:{}", s(&d.path(&format!("{tag}-mig.sock"))));
    destination.ctl_ok(&argv!(
        "migrate-incoming vol --image {} --listen {} --key-file {} --nbd-export",
        target,
        &listen,
        key
    ));
    source.ctl_ok(&["migrate-start", "vol", "--to", &listen]);
    source.ctl_ok(&["migrate-switchover", "vol"]);
    source.wait_migrate("vol", "completed");
    // The received disk is attached (its LUKS volume unlocked) right after the stream ends.
    wait_attached(&destination, "the received disk");
    destination.qemu_io("vol", after);
    assert_eq!(destination.terminate(), 0);
    assert_eq!(source.terminate(), 0);
}
