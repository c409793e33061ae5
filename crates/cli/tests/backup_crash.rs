//! A backup chain survives the daemon being killed (SIGKILL) between checkpoints and during a
//! backup: the next incremental, restored on top of the chain, is byte for byte what a full
//! backup of the same moment holds, and what the image file holds then. What a kill costs is
//! at most some regions copied again, never a change left out.
mod common;

use common::*;
use rand::{Rng, RngCore, SeedableRng};

const SIZE: u64 = 16 * MIB;

/// Random writes of 4-64 KiB over the disk through its NBD export, not flushed.
fn scribble(client: &mut NbdClient, rng: &mut rand::rngs::StdRng, count: usize) {
    for _ in 0..count {
        let len = 4096 * rng.gen_range(1..=16u64);
        let at = rng.gen_range(0..(SIZE - len) / 4096) * 4096;
        let mut data = vec![0u8; len as usize];
        rng.fill_bytes(&mut data);
        client.write(at, &data, false).unwrap();
    }
}

fn backup_start(daemon: &Daemon, socket: &std::path::Path, args: &[&str]) {
    daemon.ctl_ok(&argv!("backup-start vol --nbd unix:{}", socket; args));
}

fn pull(socket: &std::path::Path, chain: &std::path::Path, args: &[&str]) -> Out {
    cryptblk(argv!("backup pull nbd+unix:///vol?socket={} {}", socket, chain; args))
}

#[test]
fn an_incremental_after_kills_restores_to_what_a_full_backup_of_the_same_moment_holds() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2("disk.luks", "16M", &key);
    let mut daemon = t.serve().disk(&img).name("vol").nbd().control().start();
    let mut rng = rand::rngs::StdRng::seed_from_u64(3636);
    let sock = t.path("backup.sock");
    let chain = t.path("chain");

    let mut client = daemon.nbd("vol");
    scribble(&mut client, &mut rng, 64);
    client.flush().unwrap();
    client.disconnect().unwrap();
    backup_start(&daemon, &sock, &["--checkpoint", "c0"]);
    pull(&sock, &chain, &["--checkpoint", "c0"]).ok();
    daemon.ctl_ok(&["backup-end", "vol"]);

    // Killed between checkpoints, with writes the daemon acknowledged but nobody flushed.
    let mut client = daemon.nbd("vol");
    scribble(&mut client, &mut rng, 16);
    daemon.kill9();
    drop(client);
    daemon.restart();

    // Killed during a backup, while a client writes and the export copies before writes.
    backup_start(
        &daemon,
        &sock,
        &["--checkpoint", "c1", "--incremental", "c0"],
    );
    let mut client = daemon.nbd("vol");
    scribble(&mut client, &mut rng, 16);
    daemon.kill9();
    drop(client);
    let failed = pull(&sock, &chain, &["--incremental", "--checkpoint", "c1"]);
    assert_ne!(
        failed.code,
        code::OK,
        "a pull from a killed daemon succeeded"
    );
    daemon.restart();
    // As documented: the backup that never ended leaves its checkpoint, to be removed; the
    // next incremental is taken from c0 again.
    daemon.ctl_ok(&["checkpoint-remove", "vol", "c1"]);

    let mut client = daemon.nbd("vol");
    scribble(&mut client, &mut rng, 16);
    client.flush().unwrap();
    client.disconnect().unwrap();
    backup_start(
        &daemon,
        &sock,
        &["--checkpoint", "c2", "--incremental", "c0"],
    );
    pull(&sock, &chain, &["--incremental", "--checkpoint", "c2"]).ok();
    daemon.ctl_ok(&["backup-end", "vol"]);

    // Nothing written since: a full backup now is of the same moment as c2.
    let full = t.path("full");
    backup_start(&daemon, &sock, &["--checkpoint", "c3"]);
    pull(&sock, &full, &["--checkpoint", "c3"]).ok();
    daemon.ctl_ok(&["backup-end", "vol"]);
    let at_c2 = read(&img.path);

    let from_chain = t.path("from-chain.luks");
    cryptblk(["backup", "restore", s(&chain), s(&from_chain)]).ok();
    let from_full = t.path("from-full.luks");
    cryptblk(["backup", "restore", s(&full), s(&from_full)]).ok();
    assert_same_bytes(
        &read(&from_chain),
        &read(&from_full),
        "chain vs full backup",
    );
    assert_same_bytes(&read(&from_chain), &at_c2, "chain vs the image");
    assert!(cryptsetup_accepts(&from_chain, &key));
    // The incremental moved less than the disk: the kills cost some regions, not a full copy.
    let manifest: serde_json::Value =
        serde_json::from_slice(&read(&chain.join("manifest.json"))).unwrap();
    let entries = manifest["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 2, "{manifest}");
    assert_eq!(entries[1]["since"], "c0", "{manifest}");
    let moved = entries[1]["data_bytes"].as_u64().unwrap();
    assert!(moved < SIZE / 2, "{moved} bytes moved: {manifest}");
    assert_eq!(daemon.terminate(), code::OK);
}
