//! `ctl reencrypt-start`: a served LUKS2 disk's volume key replaced while an NBD client keeps
//! reading and writing it, the daemon killed part-way and restarted on the image, the work
//! finished by cryptblk or by cryptsetup; the result checked with cryptsetup and an
//! independent decryption (cryptsetup's volume key, openssl's AES).
mod common;

use common::online::{done_bytes, io_until_finished, status, Model, OnlineDisk};
use common::*;
use serde_json::Value;
use std::time::{Duration, Instant};

/// Payload of each image: enough hotzones at a low bandwidth for I/O to land mid-way.
const SIZE: u64 = 32 * MIB;

/// A LUKS2 image with 512-byte sectors and a 256-bit aes-xts key (as QEMU makes them).
fn luks2_disk() -> OnlineDisk {
    let t = TestDir::new();
    let key = t.key("key");
    let options = ["--sector-size", "512", "--key-size", "256"];
    let img = t.luks2_with("disk.luks", "32M", &key, &options).path;
    OnlineDisk { t, img, key }
}

/// A LUKS1 image as QEMU makes it: aes-xts-plain64 with a 256-bit key, 512-byte sectors, the
/// payload right after the eighth keyslot area.
fn qemu_luks1_disk() -> OnlineDisk {
    let t = TestDir::new();
    let key = t.key("key");
    let options = "cipher-alg=aes-128,cipher-mode=xts,iter-time=10";
    let img = t.luks1_by_qemu("disk.luks", "32M", &key, options).path;
    OnlineDisk { t, img, key }
}

/// `serve` with the image as disk "vol" and its passphrase.
fn serve(disk: &OnlineDisk) -> Serve {
    disk.serve().key(&disk.key)
}

/// `reencrypt-start` to 4096-byte sectors and a 512-bit key at `bandwidth` bytes/s.
fn start(daemon: &Daemon, disk: &OnlineDisk, bandwidth: &str) -> Value {
    let start = "reencrypt-start vol --key-file {} --sector-size 4096 --key-size 512";
    daemon.ctl_ok(&argv!(start, disk.key; CTL_CHEAP_KDF, ["--max-bandwidth", bandwidth]))
}

fn in_reencryption(disk: &OnlineDisk) -> bool {
    common::reencrypt::in_reencryption(&disk.img)
}

/// The image is plain LUKS2 again, with the new layout and a new volume key, opened by
/// cryptsetup, and decrypts (through cryptblk and through openssl) to `plain`.
fn check_final(disk: &OnlineDisk, plain: &[u8], old_key: &str) {
    assert!(!in_reencryption(disk), "reencryption not finished");
    assert_eq!(dump_json(&disk.img)["sector_size"].as_u64(), Some(4096));
    assert!(cryptsetup_accepts(&disk.img, &disk.key));
    let key_hex = xts::cryptsetup_volume_key(&disk.img, &disk.key);
    assert_eq!(key_hex.len(), 128, "a 512-bit key: {key_hex}");
    assert_ne!(key_hex, old_key, "the volume key did not change");
    xts::check_sampled_sectors(&disk.img, &key_hex, 4096, plain);
    let out = cryptblk_decrypt(&disk.img, &disk.key, &disk.path("plain.raw"));
    assert_same_bytes(&out[..plain.len()], plain, "cryptblk's decryption");
}

#[test]
fn volume_key_rotated_while_the_disk_is_read_and_written() {
    let disk = luks2_disk();
    let old_key = xts::cryptsetup_volume_key(&disk.img, &disk.key);
    let mut daemon = serve(&disk).start();
    let (mut c, mut model) = Model::filled(&daemon, SIZE, 23, &[]);
    assert_eq!(status(&daemon)["phase"], "idle");

    let st = start(&daemon, &disk, "8M");
    assert_eq!(st["phase"], "running", "{st}");
    assert_eq!(st["resilience"], "checksum", "{st}");
    let rounds = io_until_finished(&daemon, &mut c, &mut model, done_bytes);
    assert!(
        rounds >= 3,
        "the I/O did not overlap the reencryption ({rounds} rounds)"
    );
    model.check_all(&mut c, "after the reencryption");
    let st = status(&daemon);
    assert_eq!(done_bytes(&st), SIZE, "{st}");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    check_final(&disk, &model.data, &old_key);
}

#[test]
fn daemon_killed_mid_reencryption_serves_on_restart_and_either_tool_finishes() {
    let disk = luks2_disk();
    let old_key = xts::cryptsetup_volume_key(&disk.img, &disk.key);
    let mut daemon = serve(&disk).start();
    let (mut c, mut model) = Model::filled(&daemon, SIZE, 23, &[]);
    start(&daemon, &disk, "2M");
    let st = daemon.wait_reencrypt("vol", "4 MiB done", |st| done_bytes(st) >= 4 * MIB);
    model.round(&mut c, done_bytes(&st));
    c.flush().unwrap();
    drop(c);
    daemon.kill9();
    assert!(in_reencryption(&disk));

    // Restarted: both segments served at once, the reencryption waits for reencrypt-start.
    daemon.restart();
    let mut c = daemon.nbd("vol");
    let st = status(&daemon);
    assert_eq!(st["phase"], "paused", "{st}");
    assert!(done_bytes(&st) >= 4 * MIB && done_bytes(&st) < SIZE, "{st}");
    model.check_all(&mut c, "after the restart");
    model.round(&mut c, done_bytes(&st));
    c.flush().unwrap();

    // Continued, killed again, and finished offline by cryptsetup.
    start(&daemon, &disk, "2M");
    let before = done_bytes(&st);
    let st = daemon.wait_reencrypt("vol", "progress", |st| done_bytes(st) >= before + 2 * MIB);
    model.round(&mut c, done_bytes(&st));
    c.flush().unwrap();
    drop(c);
    daemon.kill9();
    daemon.restart();
    let mut c = daemon.nbd("vol");
    model.check_all(&mut c, "after the second restart");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    assert!(in_reencryption(&disk));
    let resume = "reencrypt --resume-only --force-offline-reencrypt --batch-mode --key-file {} {}";
    cryptsetup(argv!(resume, disk.key, disk.img)).ok();
    check_final(&disk, &model.data, &old_key);
}

#[test]
fn paused_reencryption_resumes_and_refuses_migration_while_it_runs() {
    let disk = luks2_disk();
    let old_key = xts::cryptsetup_volume_key(&disk.img, &disk.key);
    // The `threads` engine runs each request's crypto on the thread that transfers it: the
    // segment a request was routed to must reach that thread too.
    let mut daemon = serve(&disk).args(&["--aio", "threads"]).start();
    let (mut c, mut model) = Model::filled(&daemon, SIZE, 23, &[]);
    // A wrong passphrase is refused at once and leaves the header alone.
    // (cryptsetup cannot look while the daemon holds the image's lock: its header's seqid
    // shows that nothing was committed.)
    let wrong = disk.t.key("wrong");
    let seqid = read_prefix(&disk.img, 24);
    daemon
        .ctl(&argv!("reencrypt-start vol --key-file {}", wrong))
        .expect_code(code::WRONG_PASSPHRASE);
    assert_eq!(read_prefix(&disk.img, 24), seqid, "the header changed");
    assert_eq!(status(&daemon)["phase"], "idle");
    start(&daemon, &disk, "2M");

    // While it runs: a migration, a second start and a keyslot change are busy at once.
    let t = Instant::now();
    daemon
        .ctl(&argv!("migrate-start vol --to tcp:127.0.0.1:9"))
        .expect_code(code::IN_USE)
        .error_line(&["re-encrypted"]);
    assert!(t.elapsed() < Duration::from_secs(5), "refused late");
    daemon
        .ctl(&argv!("reencrypt-start vol --key-file {}", disk.key))
        .expect_code(code::IN_USE);
    let new_key = disk.t.key("new");
    let add = argv!(
        "key-add vol --key-file {} --new-key-file {}",
        disk.key,
        new_key
    );
    daemon.ctl(&add).expect_code(code::IN_USE);

    // Paused: the boundary stays, the data reads back, and the start continues it.
    let st = daemon.ctl_ok(&["reencrypt-pause", "vol"]);
    assert!(st["phase"] == "pausing" || st["phase"] == "paused", "{st}");
    let paused = daemon.wait_reencrypt("vol", "the pause", |st| st["phase"] == "paused");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(done_bytes(&status(&daemon)), done_bytes(&paused));
    model.round(&mut c, done_bytes(&paused));
    model.check_all(&mut c, "while paused");
    start(&daemon, &disk, "0");
    daemon.wait_reencrypt("vol", "the end", |st| st["phase"] == "finished");
    model.check_all(&mut c, "after the reencryption");
    // Once finished, a migration is no longer refused as busy (it fails to connect instead).
    let out = daemon.ctl(&argv!(
        "migrate-start vol --to tcp:127.0.0.1:9 --connect-timeout 200"
    ));
    assert_ne!(out.code, code::IN_USE, "{out:?}");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    check_final(&disk, &model.data, &old_key);
}

#[test]
fn served_qemu_luks1_disk_gets_a_luks2_header_then_a_new_key() {
    let disk = qemu_luks1_disk();
    let old_key = xts::cryptsetup_volume_key(&disk.img, &disk.key);
    let mut daemon = serve(&disk).start();
    let (mut c, mut model) = Model::filled(&daemon, SIZE, 23, &[]);

    // A wrong passphrase is refused before the header changes.
    let wrong = disk.t.key("wrong");
    daemon
        .ctl(&argv!("reencrypt-start vol --key-file {}", wrong))
        .expect_code(2);
    let dump = tool("cryptsetup", ["luksDump", s(&disk.img)]);
    assert!(
        dump.stdout.contains("Version:       \t1"),
        "{}",
        dump.stdout
    );

    let st = start(&daemon, &disk, "16M");
    assert_eq!(st["phase"], "running", "{st}");
    io_until_finished(&daemon, &mut c, &mut model, done_bytes);
    model.check_all(&mut c, "after the conversion and reencryption");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    check_final(&disk, &model.data, &old_key);
}
