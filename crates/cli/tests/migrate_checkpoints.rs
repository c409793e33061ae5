//! A live migration carries the disk's checkpoints (issue 36, item 4): two daemons, writes
//! through NBD (qemu-io) on the source before and during the migration and on the destination
//! after the switchover; the destination's `checkpoint-list --extents` lists each checkpoint
//! of the source, in order, with every region written since it on either side, and records
//! on. A cancelled migration leaves the source's checkpoints as they were, recording.
mod common;

use common::backup::{checkpoint_extents, covers};
use common::*;
use serde_json::Value;

/// Source writes before c1 (A), after it (B) and during the migration (B2); destination
/// writes after the switchover (C). Payload offsets, 4 KiB each unless said.
const A: [(u64, u64); 2] = [(MIB, 64 * 1024), (40 * MIB, 4096)];
const B: [(u64, u64); 2] = [(20 * MIB, 8192), (52 * MIB, 4096)];
const B2: (u64, u64) = (30 * MIB, 4096);
const C: [(u64, u64); 2] = [(10 * MIB, 4096), (60 * MIB, 128 * 1024)];
/// Written before any checkpoint: data the migration copies (slowly enough, at its
/// bandwidth cap, that a postcopy switchover finds much of it missing).
const BEFORE: (u64, u64) = (2 * MIB, 8 * MIB);

fn write(daemon: &Daemon, pattern: u8, (offset, len): (u64, u64)) {
    daemon.qemu_io("vol", &[&format!("write -P {pattern:#x} {offset} {len}")]);
}

fn names_and_times(list: &Value) -> Vec<(String, u64)> {
    list["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["created"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// The disk's checkpoints before any write: c0 lists the LUKS header only; its end is where
/// the payload starts.
fn payload_offset(daemon: &Daemon) -> u64 {
    let header = checkpoint_extents(daemon, "vol", "c0");
    assert_eq!(header.len(), 1, "{header:?}");
    assert_eq!(header[0].0, 0);
    header[0].1
}

fn migration_carries_checkpoints(postcopy: bool) {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("src.luks", "64M", &key);
    let dst_img = t.path("dst.luks");
    let (src, dst) = source_and_destination(&t, &img);

    write(&src, 0x01, BEFORE);
    src.ctl_ok(&["checkpoint-add", "vol", "c0"]);
    let payload = payload_offset(&src);
    for (k, &w) in A.iter().enumerate() {
        write(&src, 0x10 + k as u8, w);
    }
    // The creation times are carried as they are: apart by a second at least.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    src.ctl_ok(&["checkpoint-add", "vol", "c1"]);
    for (k, &w) in B.iter().enumerate() {
        write(&src, 0x20 + k as u8, w);
    }
    let source_list = src.ctl_ok(&["checkpoint-list", "vol"]);

    let listen = migrate_incoming(&dst, &dst_img, &key, &[]);
    let mut start = vec!["migrate-start", "vol", "--to", &listen];
    if postcopy {
        start.extend(["--postcopy", "--max-bandwidth", "4M"]);
    }
    src.ctl_ok(&start);
    write(&src, 0x2f, B2);
    // Until the switchover the received disk's checkpoints are on their way.
    dst.wait_ctl(&["disk-list"], "the received disk", BOUND, |list| {
        list["disks"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|d| d["name"] == "vol" && d["state"] != "adding")
    });
    dst.ctl(&["checkpoint-list", "vol"])
        .expect_code(code::IN_USE)
        .error_line(&["being migrated in"]);

    if postcopy {
        // As a destination VM would: connected before the switchover.
        dst.wait_nbd_export("vol");
        src.ctl_ok(&["migrate-postcopy", "vol"]);
        // Written while blocks are still missing (most likely: the copy is capped).
        dst.wait_ctl(&["migrate-status", "vol"], "the switchover", BOUND, |st| {
            matches!(st["phase"].as_str(), Some("postcopy" | "completed"))
        });
        write(&dst, 0x30, C[0]);
        dst.wait_migrate("vol", "completed");
        src.wait_migrate("vol", "completed");
        write(&dst, 0x31, C[1]);
    } else {
        src.ctl_ok(&["migrate-switchover", "vol"]);
        src.wait_migrate("vol", "completed");
        dst.wait_migrate("vol", "completed");
        for (k, &w) in C.iter().enumerate() {
            write(&dst, 0x30 + k as u8, w);
        }
    }

    let list = dst.ctl_ok(&["checkpoint-list", "vol"]);
    assert_eq!(
        names_and_times(&list),
        names_and_times(&source_list),
        "names, order and times as on the source: {list}"
    );
    assert!(list["store"]
        .as_str()
        .unwrap()
        .ends_with("dst.luks.cryptblk-checkpoints"));
    let c0 = checkpoint_extents(&dst, "vol", "c0");
    let c1 = checkpoint_extents(&dst, "vol", "c1");
    for &(offset, len) in A.iter().chain(&B).chain(&[B2]).chain(&C) {
        assert!(
            covers(&c0, payload + offset, len),
            "c0 misses {offset}: {c0:?}"
        );
    }
    for &(offset, len) in B.iter().chain(&[B2]).chain(&C) {
        assert!(
            covers(&c1, payload + offset, len),
            "c1 misses {offset}: {c1:?}"
        );
    }
    for &(offset, _) in &A {
        assert!(
            !covers(&c1, payload + offset, 4096),
            "c1 lists a write from before it: {offset} in {c1:?}"
        );
    }
    // Received data is not a change: neither a region nobody wrote nor one written before
    // the checkpoints is listed (the migration copied every byte of the disk).
    assert!(
        !covers(&c0, payload + 45 * MIB, 4096),
        "c0 lists what nobody wrote: {c0:?}"
    );
    assert!(
        !covers(&c0, payload + BEFORE.0 + MIB, 4096),
        "c0 lists a write from before it: {c0:?}"
    );

    // The destination records on, in a checkpoint of its own and in the carried ones.
    dst.ctl_ok(&["checkpoint-add", "vol", "c2"]);
    write(&dst, 0x40, (48 * MIB, 4096));
    let c2 = checkpoint_extents(&dst, "vol", "c2");
    assert!(covers(&c2, payload + 48 * MIB, 4096), "{c2:?}");
    assert!(!covers(&c2, payload + C[0].0, 4096), "{c2:?}");
    let c1 = checkpoint_extents(&dst, "vol", "c1");
    assert!(covers(&c1, payload + 48 * MIB, 4096), "{c1:?}");

    // An incremental backup from a carried checkpoint, on the destination.
    let sock = t.path("backup.sock");
    let started = dst.ctl_ok(&argv!(
        "backup-start vol --checkpoint c3 --incremental c1 --nbd {}",
        format!("unix:{}", s(&sock))
    ));
    assert_eq!(started["bitmap"], "qemu:dirty-bitmap:c1", "{started}");
    assert_eq!(dst.ctl_ok(&["backup-end", "vol"])["kept"], true);
    let list = dst.ctl_ok(&["checkpoint-list", "vol"]);
    let names: Vec<String> = names_and_times(&list).into_iter().map(|n| n.0).collect();
    assert_eq!(names, ["c0", "c1", "c2", "c3"], "{list}");
}

#[test]
fn precopy_carries_the_checkpoints() {
    migration_carries_checkpoints(false);
}

#[test]
fn postcopy_carries_the_checkpoints() {
    migration_carries_checkpoints(true);
}

#[test]
fn a_cancelled_migration_leaves_the_source_checkpoints_recording() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("src.luks", "32M", &key);
    let dst_img = t.path("dst.luks");
    let (src, dst) = source_and_destination(&t, &img);
    src.ctl_ok(&["checkpoint-add", "vol", "c0"]);
    let payload = payload_offset(&src);
    write(&src, 0x10, A[0]);
    let listen = migrate_incoming(&dst, &dst_img, &key, &[]);
    // Slow enough that the cancel comes during precopy.
    src.ctl_ok(&[
        "migrate-start",
        "vol",
        "--to",
        &listen,
        "--max-bandwidth",
        "1M",
    ]);
    src.ctl_ok(&["migrate-cancel", "vol"]);
    write(&src, 0x11, (20 * MIB, 4096));
    let c0 = checkpoint_extents(&src, "vol", "c0");
    for (offset, len) in [A[0], (20 * MIB, 4096)] {
        assert!(
            covers(&c0, payload + offset, len),
            "c0 misses {offset}: {c0:?}"
        );
    }
    // The destination keeps nothing of it.
    dst.wait_ctl(&["disk-list"], "the cancelled disk to go", BOUND, |list| {
        list["disks"].as_array().is_none_or(|d| d.is_empty())
    });
    let store = t.path("dst.luks.cryptblk-checkpoints");
    assert!(!store.exists(), "{} left; {}", store.display(), dst.log());
}
