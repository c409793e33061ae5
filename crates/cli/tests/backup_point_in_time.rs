//! The daemon's backup export is a point in time while a client writes the disk
//! (copy-before-write): a full backup pulled while an NBD client of the disk's own export
//! writes all over it restores to the image file as it was when `backup-start` returned,
//! and the writes made meanwhile are all there on the disk and recorded in the backup's
//! checkpoint. A scratch too small for what the client changes fails the backup, not the
//! client, and `backup-end` then insists on `--failed`. A daemon killed during a backup
//! leaves its scratch, which the next start removes. A backup with `max-bandwidth` is read no faster
//! than it. An incremental copies only what it serves: writes elsewhere do not fill its
//! scratch, and a region changed there is refused, not served as it is now.
mod common;

use common::backup::checkpoint_extents;
use common::*;
use rand::{Rng, RngCore, SeedableRng};
use serde_json::Value;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const REGION: u64 = 64 << 10;

fn covered(ranges: &[(u64, u64)], offset: u64) -> bool {
    ranges.iter().any(|&(o, l)| o <= offset && offset < o + l)
}

#[test]
fn a_backup_pulled_while_a_client_writes_is_the_image_at_backup_start() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", "32M", &key);
    let mut daemon = t.serve().disk(&img).name("vol").nbd().control().start();
    let payload = img.dump()["segments"][0]["offset"].as_u64().unwrap();
    let size = 32 * MIB;
    let mut rng = rand::rngs::StdRng::seed_from_u64(36);
    let mut client = daemon.nbd("vol");
    let mut chunk = vec![0u8; REGION as usize];
    for at in (0..size).step_by(4 * MIB as usize) {
        rng.fill_bytes(&mut chunk);
        client.write(at, &chunk, false).unwrap();
    }
    client.flush().unwrap();

    // The client stays connected but idle: the image file is the backup's moment.
    let expected = read(&img.path);
    let sock = t.path("backup.sock");
    let started = daemon.ctl_ok(&argv!(
        "backup-start vol --checkpoint c0 --nbd unix:{}",
        sock
    ));
    let scratch = std::path::PathBuf::from(started["scratch"].as_str().unwrap());
    assert_eq!(started["scratch-size"], 1u64 << 30, "{started}");
    assert!(scratch.exists(), "{started}");

    // Writes all over the disk while the backup is pulled (and before: the pull waits for
    // the first hundred).
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, first_writes) = std::sync::mpsc::channel();
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut written = Vec::new();
            while !stop.load(Ordering::SeqCst) || written.len() < 100 {
                let len = 4096 * rng.gen_range(1..=32u64);
                let at = rng.gen_range(0..(size - len) / 4096) * 4096;
                let mut data = vec![0u8; len as usize];
                rng.fill_bytes(&mut data);
                client.write(at, &data, false).unwrap();
                written.push((at, data));
                if written.len() == 100 {
                    tx.send(()).unwrap();
                }
            }
            client.flush().unwrap();
            (client, written)
        })
    };
    first_writes.recv().unwrap();
    let chain = t.path("chain");
    cryptblk(argv!(
        "backup pull nbd+unix:///vol?socket={} {} --checkpoint c0",
        sock,
        chain
    ))
    .ok();
    stop.store(true, Ordering::SeqCst);
    let (mut client, written) = writer.join().unwrap();
    assert!(written.len() >= 100);
    let ended = daemon.ctl_ok(&["backup-end", "vol"]);
    assert_eq!(ended["kept"], true, "{ended}");
    assert!(!scratch.exists(), "the scratch stays after backup-end");

    // The backup is the image as it was when backup-start returned ...
    let restored = t.path("restored.luks");
    cryptblk(argv!("backup restore {} {}", chain, restored)).ok();
    assert_same_bytes(&read(&restored), &expected, "the backup");
    assert!(cryptsetup_accepts(&restored, &key));
    // ... although the disk changed under it: every write landed, and is recorded in c0.
    assert_ne!(
        read(&img.path),
        expected,
        "the client's writes changed nothing"
    );
    let mut last = std::collections::BTreeMap::new();
    for (at, data) in &written {
        for (k, block) in data.chunks(4096).enumerate() {
            last.insert(at + 4096 * k as u64, block);
        }
    }
    let since_c0 = checkpoint_extents(&daemon, "vol", "c0");
    for (&at, &block) in &last {
        assert!(client.read(at, 4096).unwrap() == block, "the write at {at}");
        assert!(
            covered(&since_c0, payload + at),
            "{at} not in c0: {since_c0:?}"
        );
    }
    client.disconnect().unwrap();
    assert_eq!(daemon.terminate(), code::OK);
}

#[test]
fn a_full_scratch_fails_the_backup_and_not_the_client() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", "16M", &key);
    let mut daemon = t.serve().disk(&img).name("vol").nbd().control().start();
    let mut client = daemon.nbd("vol");
    let sock = t.path("backup.sock");
    let start = "backup-start vol --checkpoint c0 --nbd unix:{} --scratch-size {}";
    daemon
        .ctl(&argv!(start, sock, "2K"))
        .expect_code(code::USAGE)
        .error_line(&["scratch-size", "4K"]);
    let started = daemon.ctl_ok(&argv!(start, sock, "8K"));
    assert_eq!(started["scratch-size"], 8192, "{started}");
    let scratch = std::path::PathBuf::from(started["scratch"].as_str().unwrap());

    // Three regions changed, room for two: every write still succeeds.
    for n in 0..3u8 {
        client
            .write(u64::from(n) * MIB, &[n + 1; 4096], false)
            .unwrap();
    }
    client.flush().unwrap();
    for n in 0..3u8 {
        assert!(client.read(u64::from(n) * MIB, 4096).unwrap() == [n + 1; 4096]);
    }
    assert!(std::fs::metadata(&scratch).unwrap().len() <= 8192);

    // The export answers with an error, so the pull fails and keeps no entry.
    let chain = t.path("chain");
    let out = cryptblk(argv!(
        "backup pull nbd+unix:///vol?socket={} {}",
        sock,
        chain
    ));
    assert_eq!(out.code, code::OTHER, "{}", out.stderr);
    assert!(!chain.join("manifest.json").exists());

    // backup-end says why and wants --failed; the checkpoint then goes.
    daemon
        .ctl(&["backup-end", "vol"])
        .expect_code(code::OTHER)
        .error_line(&["backup failed", "scratch", "full", "--failed"]);
    let ended = daemon.ctl_ok(&["backup-end", "vol", "--failed"]);
    assert_eq!(ended["kept"], false, "{ended}");
    assert!(!scratch.exists());
    let list: Value = daemon.ctl_ok(&["checkpoint-list", "vol"]);
    assert_eq!(list["checkpoints"].as_array().unwrap().len(), 0, "{list}");
    client.write(5 * MIB, &[9; 4096], false).unwrap();
    client.disconnect().unwrap();
    assert_eq!(daemon.terminate(), code::OK);
}

#[test]
fn a_daemon_killed_during_a_backup_removes_the_scratch_when_it_starts_again() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", "16M", &key);
    let mut daemon = t.serve().disk(&img).name("vol").nbd().control().start();
    let sock = t.path("backup.sock");
    let started = daemon.ctl_ok(&argv!(
        "backup-start vol --checkpoint c0 --nbd unix:{}",
        sock
    ));
    let scratch = std::path::PathBuf::from(started["scratch"].as_str().unwrap());
    daemon.qemu_io("vol", &["write -P 0x42 1M 64k"]);
    assert_eq!(
        std::fs::metadata(&scratch).unwrap().len(),
        REGION,
        "one region copied"
    );
    daemon.kill9();
    assert!(scratch.exists());
    daemon.restart();
    assert!(
        !scratch.exists(),
        "the scratch of a backup that never ended stays"
    );
    // The backup's checkpoint stays, as documented, until removed; the disk serves on.
    let list = daemon.ctl_ok(&["checkpoint-list", "vol"]);
    assert_eq!(list["checkpoints"][0]["name"], "c0", "{list}");
    daemon.ctl_ok(&["checkpoint-remove", "vol", "c0"]);
    daemon.qemu_io("vol", &["read -P 0x42 1M 64k"]);
    assert_eq!(daemon.terminate(), code::OK);
}

#[test]
fn a_backup_with_a_max_bandwidth_is_pulled_no_faster_than_it() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", "16M", &key);
    let daemon = t.serve().disk(&img).name("vol").nbd().control().start();
    daemon.qemu_io("vol", &["write -P 0x5a 0 8M"]);
    let sock = t.path("backup.sock");
    let start = "backup-start vol --checkpoint c0 --nbd unix:{} --max-bandwidth {}";
    daemon
        .ctl(&argv!(start, sock, "64K"))
        .expect_code(code::USAGE)
        .error_line(&["max-bandwidth", "1M"]);
    let started = daemon.ctl_ok(&argv!(start, sock, "4M"));
    assert_eq!(started["max-bandwidth"], 4u64 << 20, "{started}");
    let chain = t.path("chain");
    let began = std::time::Instant::now();
    cryptblk(argv!(
        "backup pull nbd+unix:///vol?socket={} {} --checkpoint c0",
        sock,
        chain
    ))
    .ok();
    let took = began.elapsed();
    daemon.ctl_ok(&["backup-end", "vol"]);
    // 8 MiB of data and the header at 4 MiB/s: more than a second, though the first 4 MiB
    // read goes at once.
    assert!(took >= std::time::Duration::from_millis(1000), "{took:?}");
    let restored = t.path("restored.luks");
    cryptblk(argv!("backup restore {} {}", chain, restored)).ok();
    assert_same_bytes(&read(&restored), &read(&img.path), "the backup");
}

#[test]
fn an_incremental_copies_only_what_changed_since_its_checkpoint() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", "16M", &key);
    let daemon = t.serve().disk(&img).name("vol").nbd().control().start();
    daemon.qemu_io("vol", &["write -P 0x5a 0 16M"]);
    let sock = t.path("backup.sock");
    let chain = t.path("chain");
    let uri = format!("nbd+unix:///vol?socket={}", sock.display());
    daemon.ctl_ok(&argv!(
        "backup-start vol --checkpoint c0 --nbd unix:{}",
        sock
    ));
    cryptblk(argv!("backup pull {} {} --checkpoint c0", uri, chain)).ok();
    daemon.ctl_ok(&["backup-end", "vol"]);

    // Changed since c0: 1 MiB. The incremental's scratch holds one region.
    daemon.qemu_io("vol", &["write -P 0x11 1M 4k"]);
    daemon.ctl_ok(&argv!(
        "backup-start vol --checkpoint c1 --incremental c0 --nbd unix:{} --scratch-size 4K",
        sock
    ));
    let at_c1 = read(&img.path);
    // Three regions written that c0 -> c1 does not serve, then the one it does: one copy.
    daemon.qemu_io(
        "vol",
        &[
            "write -P 0x22 5M 4k",
            "write -P 0x23 6M 4k",
            "write -P 0x24 7M 4k",
        ],
    );
    daemon.qemu_io("vol", &["write -P 0x25 1M 4k"]);
    // Not released, so the export still serves what the pull read.
    cryptblk(argv!(
        "backup pull --incremental --no-release {} {} --checkpoint c1",
        uri,
        chain
    ))
    .ok();
    // A region changed outside it reads as an error, not as the disk is now.
    let payload = img.dump()["segments"][0]["offset"].as_u64().unwrap();
    let mut export = cryptblk_testutil::nbd::NbdClient::connect(&sock, "vol").unwrap();
    assert!(export.read(payload + 5 * MIB, 4096).is_err());
    assert!(export.read(payload + 9 * MIB, 4096).is_ok(), "unchanged");
    export.disconnect().unwrap();
    let ended = daemon.ctl_ok(&["backup-end", "vol"]);
    assert_eq!(ended["kept"], true, "the scratch did not fill: {ended}");
    let restored = t.path("restored.luks");
    cryptblk(argv!("backup restore {} {}", chain, restored)).ok();
    assert_same_bytes(&read(&restored), &at_c1, "the incremental at c1");
    assert!(daemon
        .log()
        .contains("changed here since the backup started"));
}

#[test]
fn a_pull_releases_what_it_stored_so_later_writes_copy_nothing() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", "16M", &key);
    let daemon = t.serve().disk(&img).name("vol").nbd().control().start();
    daemon.qemu_io("vol", &["write -P 0x5a 0 16M"]);
    let mut client = daemon.nbd("vol");
    let sock = t.path("backup.sock");
    let uri = format!("nbd+unix:///vol?socket={}", sock.display());
    let start = "backup-start vol --checkpoint {} --nbd unix:{} --scratch-size 4K";

    // Pulled with releases: the scratch of one block outlives writes to three.
    daemon.ctl_ok(&argv!(start, "c0", sock));
    let at_c0 = read(&img.path);
    let chain = t.path("chain");
    cryptblk(argv!("backup pull {} {} --checkpoint c0", uri, chain)).ok();
    for n in 0..3u8 {
        client
            .write(u64::from(n) * MIB, &[n + 1; 4096], false)
            .unwrap();
    }
    client.flush().unwrap();
    let mut export = cryptblk_testutil::nbd::NbdClient::connect(&sock, "vol").unwrap();
    assert!(
        export.read(0, 4096).is_err(),
        "a released range is not served"
    );
    export.disconnect().unwrap();
    let ended = daemon.ctl_ok(&["backup-end", "vol"]);
    assert_eq!(ended["kept"], true, "no copy was needed: {ended}");
    let restored = t.path("restored.luks");
    cryptblk(argv!("backup restore {} {}", chain, restored)).ok();
    assert_same_bytes(&read(&restored), &at_c0, "the full backup at c0");

    // --no-release: the export keeps everything, and the same writes fill the scratch.
    daemon.ctl_ok(&argv!(start, "c1", sock));
    let other = t.path("other");
    cryptblk(argv!(
        "backup pull --no-release {} {} --checkpoint c1",
        uri,
        other
    ))
    .ok();
    for n in 0..3u8 {
        client
            .write(u64::from(n) * MIB, &[n + 7; 4096], false)
            .unwrap();
    }
    client.flush().unwrap();
    daemon
        .ctl(&["backup-end", "vol"])
        .expect_code(code::OTHER)
        .error_line(&["backup failed", "scratch", "full"]);
    daemon.ctl_ok(&["backup-end", "vol", "--failed"]);
    client.disconnect().unwrap();
}
