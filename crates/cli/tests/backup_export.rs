//! The daemon's own key-less backup export (`ctl backup-start` / `backup-end`): a LUKS2 disk
//! served over NBD, written, backed up in full and then incrementally from a checkpoint.
//! `nbdinfo --map=qemu:dirty-bitmap:c0`, `qemu-img map` with `x-dirty-bitmap`, `ctl
//! checkpoint-list --extents` and `cryptblk backup pull` all see the same dirty extents; the
//! chain restores to the image file's bytes at each checkpoint, which cryptsetup opens and
//! which decrypt to what was written; neither the export's bytes nor the chain hold the
//! plaintext. A failed backup folds its checkpoint's changes back into the previous one; the
//! export is refused while a client could write the disk, and the disk's header and
//! checkpoints cannot change under it.
mod common;

use common::backup::{chain_extents, covers, manifest, merged, nbdinfo_dirty, qemu_img_dirty};
use common::*;
use serde_json::Value;

/// 64 KiB of text no ciphertext or header holds by chance.
fn marker(n: u8) -> Vec<u8> {
    format!("<<plaintext marker {n:03} written by the client>>")
        .into_bytes()
        .into_iter()
        .cycle()
        .take(64 << 10)
        .collect()
}

fn holds(bytes: &[u8], needle: &[u8]) -> bool {
    // The first 64 bytes of a marker are enough to find it.
    bytes.windows(64).any(|w| w == &needle[..64])
}

/// The ranges `checkpoint-list --extents` gives for `checkpoint`.
fn listed(daemon: &Daemon, checkpoint: &str) -> Option<Vec<(u64, u64)>> {
    let list = daemon.ctl_ok(&["checkpoint-list", "vol", "--extents"]);
    let entry = list["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == checkpoint)?
        .clone();
    Some(merged(
        entry["extents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e[0].as_u64().unwrap(), e[1].as_u64().unwrap())),
    ))
}

/// `ctl backup-start vol ARGS...`.
fn backup_start(daemon: &Daemon, args: &[&str]) -> Value {
    daemon.ctl_ok(&argv!("backup-start vol"; args))
}

fn pull(args: &[&str]) {
    cryptblk(argv!("backup pull"; args)).ok();
}

#[test]
fn the_backup_export_serves_ciphertext_and_the_dirty_bitmap_every_tool_reads_alike() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", "32M", &key);
    let mut daemon = t.serve().disk(&img).name("vol").nbd().control().start();
    let payload = img.dump()["segments"][0]["offset"].as_u64().unwrap();
    let source = t.path("marker.bin");
    let write_marker = |n: u8, at: &str| {
        std::fs::write(&source, marker(n)).unwrap();
        daemon.qemu_io("vol", &[&format!("write -s {} {at} 64k", s(&source))]);
    };
    write_marker(1, "0");
    write_marker(2, "8M");

    // A full backup at c0.
    let sock0 = t.path("backup0.sock");
    let started = backup_start(
        &daemon,
        &[
            "--checkpoint",
            "c0",
            "--nbd",
            &format!("unix:{}", s(&sock0)),
        ],
    );
    assert_eq!(started["export"], "vol", "{started}");
    assert_eq!(started["size"], std::fs::metadata(&*img).unwrap().len());
    assert_eq!(started["bitmap"], Value::Null, "{started}");
    let uri0 = format!("nbd+unix:///vol?socket={}", s(&sock0));
    let chain = t.path("chain");
    pull(&[&uri0, s(&chain), "--checkpoint", "c0"]);
    let at_c0 = read(&img.path);
    // A second backup of the same disk is refused while this one serves.
    daemon
        .ctl(&[
            "backup-start",
            "vol",
            "--checkpoint",
            "x",
            "--nbd",
            "unix:/nonexistent/x",
        ])
        .expect_code(code::IN_USE)
        .error_line(&["already has a backup export"]);
    let ended = daemon.ctl_ok(&["backup-end", "vol"]);
    assert_eq!(ended["kept"], true, "{ended}");
    assert!(
        !sock0.exists(),
        "the export's socket stays after backup-end"
    );

    // Changes after c0, then an incremental at c1 from c0.
    write_marker(3, "4M");
    daemon.qemu_io("vol", &["write -P 0x77 20M 4k", "write -z 24M 128k"]);
    let sock1 = t.path("backup1.sock");
    let started = backup_start(
        &daemon,
        &[
            "--checkpoint",
            "c1",
            "--incremental",
            "c0",
            "--nbd",
            &format!("unix:{}", s(&sock1)),
        ],
    );
    assert_eq!(started["bitmap"], "qemu:dirty-bitmap:c0", "{started}");
    let uri1 = format!("nbd+unix:///vol?socket={}", s(&sock1));

    let from_nbdinfo = nbdinfo_dirty(&uri1, "c0");
    let from_qemu_img = qemu_img_dirty(&sock1, "vol", "c0");
    let from_ctl = listed(&daemon, "c0").unwrap();
    assert_eq!(from_nbdinfo, from_ctl, "nbdinfo and checkpoint-list");
    assert_eq!(from_qemu_img, from_ctl, "qemu-img and checkpoint-list");
    // The header, and every write since c0, in 64 KiB regions; nothing else.
    assert!(covers(&from_ctl, 0, payload), "{from_ctl:?}");
    for (offset, len) in [(4 * MIB, 65536), (20 * MIB, 4096), (24 * MIB, 131072)] {
        assert!(
            covers(&from_ctl, payload + offset, len),
            "{offset}: {from_ctl:?}"
        );
    }
    assert!(!covers(&from_ctl, payload + 8 * MIB, 4096), "{from_ctl:?}");
    let dirty: u64 = from_ctl.iter().map(|r| r.1).sum();
    assert_eq!(dirty, payload + 65536 + 65536 + 131072, "{from_ctl:?}");

    // While the export serves: its checkpoints stay, the header does not change.
    daemon
        .ctl(&["checkpoint-remove", "vol", "c0"])
        .expect_code(code::IN_USE)
        .error_line(&["backup export uses checkpoint c0"]);
    daemon
        .ctl(&["disk-resize", "vol", "48M"])
        .expect_code(code::IN_USE)
        .error_line(&["has a backup export"]);

    // The export's bytes are ciphertext: no marker in them.
    let stream = t.path("stream.raw");
    tool("nbdcopy", [uri1.as_str(), s(&stream)]).ok();
    let streamed = read(&stream);
    for n in 1..=3 {
        assert!(
            !holds(&streamed, &marker(n)),
            "marker {n} in the NBD stream"
        );
    }

    pull(&["--incremental", &uri1, s(&chain), "--checkpoint", "c1"]);
    let m = manifest(&chain);
    assert_eq!(
        chain_extents(&chain, &m["entries"][1]),
        from_ctl,
        "the pull's extents"
    );
    let at_c1 = read(&img.path);
    assert_same_bytes(&streamed, &at_c1, "the export's bytes");
    daemon.ctl_ok(&["backup-end", "vol"]);

    // Each checkpoint restores to the image file as it was, opens and decrypts.
    for (name, image, markers) in [("c0", &at_c0, &[1u8, 2][..]), ("c1", &at_c1, &[1, 2, 3])] {
        let out = t.path(&format!("restored-{name}.luks"));
        cryptblk([
            "backup",
            "restore",
            "--checkpoint",
            name,
            s(&chain),
            s(&out),
        ])
        .ok();
        assert_same_bytes(&read(&out), image, name);
        assert!(cryptsetup_accepts(&out, &key), "{name}");
        let plain = cryptblk_decrypt(&out, &key, &t.path(&format!("plain-{name}.raw")));
        for &n in markers {
            let at = [0, 8 * MIB as usize, 4 * MIB as usize][n as usize - 1];
            assert!(plain[at..at + 65536] == marker(n)[..], "{name}: marker {n}");
        }
    }
    // No plaintext and no key on the backup side.
    let secret = read(&key);
    for f in std::fs::read_dir(&chain).unwrap() {
        let bytes = read(&f.unwrap().path());
        for n in 1..=3 {
            assert!(!holds(&bytes, &marker(n)), "marker {n} in the chain");
        }
        assert!(!bytes.windows(secret.len()).any(|w| w == secret));
    }

    // A failed backup: c2 goes, and what changed since it stays recorded for c1.
    daemon.qemu_io("vol", &["write -P 0x66 12M 4k"]);
    backup_start(
        &daemon,
        &[
            "--checkpoint",
            "c2",
            "--incremental",
            "c1",
            "--nbd",
            &format!("unix:{}", s(&t.path("backup2.sock"))),
        ],
    );
    let ended = daemon.ctl_ok(&["backup-end", "vol", "--failed"]);
    assert_eq!(ended["kept"], false, "{ended}");
    assert_eq!(listed(&daemon, "c2"), None);
    let c1 = listed(&daemon, "c1").unwrap();
    assert!(covers(&c1, payload + 12 * MIB, 4096), "{c1:?}");
    daemon
        .ctl(&["backup-end", "vol"])
        .expect_code(code::OTHER)
        .error_line(&["has no backup export"]);

    // Refused for an unknown checkpoint.
    daemon
        .ctl(&argv!(
            "backup-start vol --checkpoint c3 --incremental nope --nbd unix:/nonexistent/y"
        ))
        .expect_code(code::USAGE)
        .error_line(&["has no checkpoint nope"]);
    assert_eq!(listed(&daemon, "c3"), None);
    assert_eq!(daemon.terminate(), code::OK);
}
