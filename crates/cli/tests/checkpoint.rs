//! Checkpoints of a served disk (`ctl checkpoint-add/-list/-remove`), as a backup tool uses
//! them: the changed ranges of the image file a checkpoint lists are every range written
//! since it was added, also after the daemon was killed with SIGKILL and restarted, and after
//! `ctl upgrade` handed the disk to a new daemon.
mod common;

use common::backup::{checkpoint_extents, covers};
use common::*;

#[test]
fn checkpoints_list_every_write_since_them_across_a_kill_9_and_an_upgrade() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", "64M", &key);
    let mut daemon = t.serve().disk(&img).name("vol").nbd().control().start();
    let none = daemon.ctl_ok(&["checkpoint-list", "vol"]);
    assert_eq!(none["checkpoints"], serde_json::json!([]), "{none}");
    assert_eq!(none["granularity"], 65536);

    let added = daemon.ctl_ok(&["checkpoint-add", "vol", "c1"]);
    assert_eq!(added["checkpoint"], "c1");
    // Nothing written yet: only the LUKS header (which changes outside the log) is listed.
    let header = checkpoint_extents(&daemon, "vol", "c1");
    assert_eq!(header.len(), 1, "{header:?}");
    let (zero, payload) = header[0];
    assert_eq!(zero, 0);
    assert!(
        payload >= MIB,
        "the LUKS2 header is at least 1 MiB: {payload}"
    );
    assert_eq!(
        daemon.ctl_ok(&["checkpoint-list", "vol"])["checkpoints"][0]["dirty-bytes"],
        payload
    );

    // Written before the kill, not flushed: the log recorded them before they were submitted.
    daemon.qemu_io("vol", &["write -P 0x5a 1M 64k", "write -P 0x11 40M 4k"]);
    daemon.ctl_ok(&["checkpoint-add", "vol", "c2"]);
    daemon.qemu_io("vol", &["write -P 0x22 20M 8k", "write -z 30M 128k"]);
    daemon.kill9();
    daemon.restart();
    // Before anything asks for the checkpoints: the restarted daemon records from the start.
    daemon.qemu_io("vol", &["write -P 0x33 50M 4k"]);

    let c1 = checkpoint_extents(&daemon, "vol", "c1");
    let c2 = checkpoint_extents(&daemon, "vol", "c2");
    for (offset, len) in [
        (MIB, 64 * 1024),
        (40 * MIB, 4096),
        (20 * MIB, 8192),
        (30 * MIB, 128 * 1024),
    ] {
        assert!(
            covers(&c1, payload + offset, len),
            "c1 misses {offset}: {c1:?}"
        );
    }
    for (offset, len) in [(20 * MIB, 8192), (30 * MIB, 128 * 1024)] {
        assert!(
            covers(&c2, payload + offset, len),
            "c2 misses {offset}: {c2:?}"
        );
    }
    assert!(
        !covers(&c2, payload + MIB, 4096),
        "c2 lists a write before it: {c2:?}"
    );
    assert!(
        covers(&c2, payload + 50 * MIB, 4096),
        "c2 misses 50M: {c2:?}"
    );
    assert!(
        !covers(&c1, payload + 55 * MIB, 4096),
        "c1 lists what nobody wrote: {c1:?}"
    );

    // So does its successor after an upgrade.
    daemon.upgrade();
    daemon.qemu_io("vol", &["write -P 0x44 60M 4k"]);
    let c2 = checkpoint_extents(&daemon, "vol", "c2");
    assert!(covers(&c2, payload + 50 * MIB, 4096), "{c2:?}");
    assert!(covers(&c2, payload + 60 * MIB, 4096), "{c2:?}");

    // Removing the newest: what changed since it stays listed for c1.
    daemon
        .ctl(&["checkpoint-add", "vol", "c1"])
        .expect_code(code::USAGE)
        .error_line(&["already has a checkpoint c1"]);
    daemon
        .ctl(&["checkpoint-add", "vol", "no/slash"])
        .expect_code(code::USAGE)
        .error_line(&["not a checkpoint name"]);
    daemon.ctl_ok(&["checkpoint-remove", "vol", "c2"]);
    daemon
        .ctl(&["checkpoint-remove", "vol", "c2"])
        .expect_code(code::USAGE)
        .error_line(&["no checkpoint c2"]);
    daemon.qemu_io("vol", &["write -P 0x55 10M 4k"]);
    let c1 = checkpoint_extents(&daemon, "vol", "c1");
    for offset in [20 * MIB, 50 * MIB, 60 * MIB, 10 * MIB] {
        assert!(
            covers(&c1, payload + offset, 4096),
            "c1 misses {offset}: {c1:?}"
        );
    }
    let list = daemon.ctl_ok(&["checkpoint-list", "vol"]);
    assert_eq!(list["checkpoints"].as_array().unwrap().len(), 1, "{list}");
    assert!(list["store"]
        .as_str()
        .unwrap()
        .ends_with("disk.luks.cryptblk-checkpoints"));
    assert_eq!(daemon.terminate(), code::OK);
}
