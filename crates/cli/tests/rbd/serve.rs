//! `cryptblk serve` on RBD images: over NBD under the image's exclusive lock, restarted after
//! `kill -9` with its flushed writes, and a paused OSD stalling only its own disk. Steps of
//! `rbd.rs`'s test.
use super::{qemu_io, refused_as_locked};
use crate::common::*;
use cryptblk_testutil::ceph::Cluster;
use std::path::Path;

/// `serve --image rbd:...` over NBD: QEMU's NBD client writes and reads, librbd then reads
/// the same data; while served, the image's exclusive lock keeps other writers out.
pub fn serve_over_nbd_under_the_exclusive_lock(cluster: &Cluster, d: &TestDir, key: &Path) {
    let name = cluster.name("served");
    format_luks2(Path::new(&name), key, "32M");
    let mut daemon = d.serve().image(&name).key(key).nbd().start();
    let uri = daemon.nbd_uri("served");
    let io = [
        "write -P 0x6b 4M 256k",
        "read -P 0x6b 4M 256k",
        "read -P 0 0 64k",
    ];
    daemon.qemu_io("served", &io);
    // Block status: what was never written reads as zeros, and NBD clients are told so (QEMU's
    // mirror and backup jobs, qemu-img convert, skip it); what was written is data.
    let map = tool("qemu-img", ["map", "--output=json", "-f", "raw", &uri]);
    map.ok();
    let extents: Vec<serde_json::Value> = serde_json::from_str(&map.stdout).unwrap();
    let data: Vec<(u64, u64)> = extents
        .iter()
        .filter(|e| e["data"] == true)
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(data, [(4 * MIB, 256 << 10)], "{}", map.stdout);
    // A second writer is refused while the daemon holds the lock, naming the reason.
    refused_as_locked(&name, key);
    // So is a second daemon: two daemons never write one image.
    d.serve_as("other")
        .image(&name)
        .key(key)
        .nbd()
        .run()
        .expect_code(code::IN_USE)
        .error_line(&["rbd/served", "locked by"]);
    assert_eq!(daemon.terminate(), 0);
    qemu_io(
        cluster,
        "served",
        "luks2",
        key,
        &["read -P 0x6b 4M 256k", "read -P 0 0 64k"],
    );
}

/// `kill -9` of the daemon after a flushed write: a new daemon takes the image's lock (the
/// cluster breaks the dead client's) and the write is there.
pub fn kill_9_keeps_flushed_writes(cluster: &Cluster, d: &TestDir, key: &Path) {
    let serve = d.serve_as("k9").image(cluster.name("served")).key(key);
    let mut daemon = serve.nbd().start();
    daemon.qemu_io("served", &["write -P 0x9e 7M 96k", "flush"]);
    daemon.kill9();
    // The lock of a dead client is broken once the cluster notices it is gone (measured: ~3 s
    // here); until then a restart is refused as "in use", and systemd's Restart= retries it.
    let start = std::time::Instant::now();
    while let Err(refused) = daemon.try_restart() {
        assert_eq!(refused.code, code::IN_USE, "restart failed: {refused}");
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "the dead daemon's lock was not broken within 60 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    daemon.qemu_io("served", &["read -P 0x9e 7M 96k"]);
    daemon.kill9();
}

/// An OSD that stops answering mid-I/O: the RBD disk's requests wait (librados' OSD op
/// timeout is 30 s) and complete when it answers again; the daemon's other disk (a local
/// file) keeps serving meanwhile.
pub fn a_paused_osd_stalls_only_its_disk(cluster: &Cluster, d: &TestDir, key: &Path) {
    let local = d.path("local.raw");
    random_file(&local, 4 * MIB, 9);
    let config = d.path("two.toml");
    std::fs::write(
        &config,
        format!(
            "[[disk]]\nname = \"remote\"\nimage = \"{}\"\nkey-file = \"{}\"\nnbd = true\n\n\
             [[disk]]\nname = \"local\"\nimage = \"{}\"\nnbd = true\n",
            cluster.name("served"),
            s(key),
            s(&local)
        ),
    )
    .unwrap();
    let mut daemon = d.serve_as("two").config(&config).nbd().start();
    daemon.qemu_io("remote", &["read -P 0x9e 7M 96k"]);
    let paused = cluster.pause_osd();
    let io = ["write -P 0x2f 1M 128k", "flush", "read -P 0x2f 1M 128k"];
    let stalled = {
        let target = argv!(
            "{} {} {}",
            "-f".to_string(),
            "raw".to_string(),
            daemon.nbd_uri("remote")
        );
        std::thread::spawn(move || qemu_io_out(&target, &io))
    };
    std::thread::sleep(std::time::Duration::from_secs(1));
    let started = std::time::Instant::now();
    let out = daemon.qemu_io_out("local", &["read -v 0 16"]);
    out.ok();
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "the local disk waited for the paused OSD"
    );
    let first: Vec<String> = read(&local)[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dumped: String = out.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        dumped.contains(&first.join(" ")),
        "local read {}: want {first:?}",
        out.stdout
    );
    assert!(
        !stalled.is_finished(),
        "the RBD request finished with its OSD stopped"
    );
    std::thread::sleep(std::time::Duration::from_secs(2));
    drop(paused);
    assert_io_ok(&stalled.join().unwrap(), &io);
    assert_eq!(daemon.terminate(), 0);
}
