//! LUKS disks that live in a real (single-node, throwaway) Ceph cluster, checked against
//! librbd's own encryption through the real `rbd` CLI and QEMU's rbd driver with
//! `encrypt.format=`: images either side made open in the other, byte for byte, including
//! never-written areas (zeros through both); serve over NBD; the exclusive lock; format, dump
//! and key changes on `rbd:` names; and the errors a user meets.
//!
//! One test runs every step on one cluster, in order, because later steps use the images and
//! data earlier ones left: the errors step decrypts `lib2` and converts onto `ours2`;
//! `kill -9` restarts on `served`, the image the serving step made; the paused-OSD and
//! migration steps read what `kill -9` wrote there. The steps: `rbd/images.rs` (images made
//! and read by either side, `format`, `dump`, `key add`, the errors), `rbd/serve.rs` (serving
//! under the exclusive lock, `kill -9`, a paused OSD), `rbd/migrate.rs` (live migration into
//! and out of RBD, the hand-off of a shared image).
mod common;
// A test's root finds `mod x;` at tests/x.rs, another test's file: the steps live in rbd/.
#[path = "rbd/images.rs"]
mod images;
#[path = "rbd/migrate.rs"]
mod migrate;
#[path = "rbd/serve.rs"]
mod serve;

use common::*;
use cryptblk_testutil::ceph::{self, Cluster};
use std::path::Path;

/// QEMU's rbd driver on `image` with librbd's encryption loaded (`format`: luks or luks2).
fn qemu_rbd_opts(cluster: &Cluster, image: &str, format: &str) -> String {
    format!(
        "driver=rbd,pool=rbd,image={image},conf={},encrypt.format={format},encrypt.key-secret=s0",
        cluster.conf.display()
    )
}

fn secret(key: &Path) -> String {
    format!("secret,id=s0,file={}", s(key))
}

fn qemu_io(cluster: &Cluster, image: &str, format: &str, key: &Path, cmds: &[&str]) {
    let opts = qemu_rbd_opts(cluster, image, format);
    qemu_io_cmds(&["--object", &secret(key), "--image-opts", &opts], cmds);
}

#[test]
fn luks_on_rbd_against_librbd_and_qemu() {
    let Some(cluster) = ceph::start() else {
        return;
    };
    let t = TestDir::new();
    let d = &t;
    let key = t.key("key");

    images::made_by_librbd_opens_in_cryptblk(&cluster, d, &key);
    images::made_by_cryptblk_opens_in_librbd(&cluster, d, &key);
    images::raw_images_both_ways(&cluster, d);
    images::cryptsetup_made_and_rbd_imported(&cluster, d, &key);
    serve::serve_over_nbd_under_the_exclusive_lock(&cluster, d, &key);
    serve::kill_9_keeps_flushed_writes(&cluster, d, &key);
    serve::a_paused_osd_stalls_only_its_disk(&cluster, d, &key);
    migrate::migrates_out_of_rbd_into_a_file(&cluster, d, &key);
    migrate::migrates_from_a_file_into_rbd(&cluster, d, &key);
    migrate::hands_a_shared_image_over_without_copying(&cluster, d, &key);
    images::format_dump_and_key_change(&cluster, d, &key);
    images::errors_name_the_problem(&cluster, d, &key);
}

/// Another writer (`cryptblk key add`) is refused on `name`: a daemon holds its lock.
fn refused_as_locked(name: &str, key: &Path) {
    cryptblk(argv!(
        "key add --key-file {} --new-key-file {} {}",
        key,
        key,
        name
    ))
    .expect_code(code::IN_USE)
    .error_line(&["locked"]);
}
