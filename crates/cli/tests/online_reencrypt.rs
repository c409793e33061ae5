//! `ctl reencrypt-start`: a served LUKS2 disk's volume key replaced while an NBD client keeps
//! reading and writing it, the daemon killed part-way and restarted on the image, the work
//! finished by cryptblk or by cryptsetup; the result checked with cryptsetup and an
//! independent decryption (cryptsetup's volume key, openssl's AES).
mod common;

use common::online::{done_bytes, Model, OnlineDisk};
use common::*;
use serde_json::Value;
use std::time::{Duration, Instant};

/// Payload of each image: enough hotzones at a low bandwidth for I/O to land mid-way.
const SIZE: u64 = 32 * MIB;

impl OnlineDisk {
    /// A LUKS2 image with 512-byte sectors and a 256-bit aes-xts key (as QEMU makes them).
    fn new(tag: &str) -> OnlineDisk {
        let dir = tempdir();
        let key = key_file(dir.path(), "key", &passphrase(tag));
        let img = dir.path().join("disk.luks");
        let mut args = vec![
            "format",
            "-q",
            "--key-file",
            s(&key),
            "--sector-size",
            "512",
            "--key-size",
            "256",
        ];
        args.extend_from_slice(CHEAP_PBKDF2);
        args.extend([s(&img), "32M"]);
        cryptblk(&args).ok();
        OnlineDisk { dir, img, key }
    }

    /// A LUKS1 image as QEMU makes it: aes-xts-plain64 with a 256-bit key, 512-byte
    /// sectors, the payload right after the eighth keyslot area.
    fn qemu_luks1(tag: &str) -> OnlineDisk {
        let dir = tempdir();
        let key = key_file(dir.path(), "key", &passphrase(tag));
        let img = dir.path().join("disk.luks");
        qemu_img_kdf([
            "create",
            "-q",
            "-f",
            "luks",
            "--object",
            &format!("secret,id=s0,file={}", s(&key)),
            "-o",
            "key-secret=s0,cipher-alg=aes-128,cipher-mode=xts,iter-time=10",
            s(&img),
            "32M",
        ])
        .ok();
        OnlineDisk { dir, img, key }
    }

    /// `serve` with the image as disk "vol" and its passphrase.
    fn serve(&self) -> ServeProcess {
        self.serve_with(&[])
    }

    /// `serve` as above, with `extra` options.
    fn serve_with(&self, extra: &[&str]) -> ServeProcess {
        let mut args = vec!["--key-file", s(&self.key)];
        args.extend_from_slice(extra);
        self.serve_args(&args)
    }

    /// `reencrypt-start` to 4096-byte sectors and a 512-bit key at `bandwidth` bytes/s.
    fn start(&self, bandwidth: &str) -> Value {
        self.ctl_json(&[
            "reencrypt-start",
            "vol",
            "--key-file",
            s(&self.key),
            "--sector-size",
            "4096",
            "--key-size",
            "512",
            "--pbkdf",
            "pbkdf2",
            "--iter-time",
            "1",
            "--max-bandwidth",
            bandwidth,
        ])
    }

    fn in_reencryption(&self) -> bool {
        let out = tool("cryptsetup", ["luksDump", s(&self.img)]);
        out.ok();
        out.stdout.contains("online-reencrypt-v2")
    }

    /// The image is plain LUKS2 again, with the new layout and a new volume key, opened by
    /// cryptsetup, and decrypts (through cryptblk and through openssl) to `plain`.
    fn check_final(&self, plain: &[u8], old_key: &str) {
        assert!(!self.in_reencryption(), "reencryption not finished");
        assert_eq!(dump_json(&self.img)["sector_size"].as_u64(), Some(4096));
        assert!(cryptsetup_accepts(&self.img, &self.key));
        let key_hex = xts::cryptsetup_volume_key(&self.img, &self.key);
        assert_eq!(key_hex.len(), 128, "a 512-bit key: {key_hex}");
        assert_ne!(key_hex, old_key, "the volume key did not change");
        xts::check_sampled_sectors(&self.img, &key_hex, 4096, plain);
        let out = cryptblk_decrypt(&self.img, &self.key, &self.path("plain.raw"));
        assert_same_bytes(&out[..plain.len()], plain, "cryptblk's decryption");
    }
}

#[test]
fn volume_key_rotated_while_the_disk_is_read_and_written() {
    let disk = OnlineDisk::new("online");
    let old_key = xts::cryptsetup_volume_key(&disk.img, &disk.key);
    let daemon = disk.serve();
    let mut c = disk.nbd();
    let mut model = Model::new(SIZE, 23, &[]);
    model.fill(&mut c);
    assert_eq!(disk.status()["phase"], "idle");

    let st = disk.start("8M");
    assert_eq!(st["phase"], "running", "{st}");
    assert_eq!(st["resilience"], "checksum", "{st}");
    let rounds = disk.io_until_finished(&mut c, &mut model, done_bytes);
    assert!(
        rounds >= 3,
        "the I/O did not overlap the reencryption ({rounds} rounds)"
    );
    model.check_all(&mut c, "after the reencryption");
    let st = disk.status();
    assert_eq!(done_bytes(&st), SIZE, "{st}");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    disk.check_final(&model.data, &old_key);
}

#[test]
fn daemon_killed_mid_reencryption_serves_on_restart_and_either_tool_finishes() {
    let disk = OnlineDisk::new("restart");
    let old_key = xts::cryptsetup_volume_key(&disk.img, &disk.key);
    let daemon = disk.serve();
    let mut c = disk.nbd();
    let mut model = Model::new(SIZE, 23, &[]);
    model.fill(&mut c);
    disk.start("2M");
    let st = disk.wait("4 MiB done", |st| done_bytes(st) >= 4 * MIB);
    model.round(&mut c, done_bytes(&st));
    c.flush().unwrap();
    drop(c);
    drop(daemon); // SIGKILL
    assert!(disk.in_reencryption());

    // Restarted: both segments served at once, the reencryption waits for reencrypt-start.
    let daemon = disk.serve();
    let mut c = disk.nbd();
    let st = disk.status();
    assert_eq!(st["phase"], "paused", "{st}");
    assert!(done_bytes(&st) >= 4 * MIB && done_bytes(&st) < SIZE, "{st}");
    model.check_all(&mut c, "after the restart");
    model.round(&mut c, done_bytes(&st));
    c.flush().unwrap();

    // Continued, killed again, and finished offline by cryptsetup.
    disk.start("2M");
    let before = done_bytes(&st);
    let st = disk.wait("progress", |st| done_bytes(st) >= before + 2 * MIB);
    model.round(&mut c, done_bytes(&st));
    c.flush().unwrap();
    drop(c);
    drop(daemon);
    let daemon = disk.serve();
    let mut c = disk.nbd();
    model.check_all(&mut c, "after the second restart");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    assert!(disk.in_reencryption());
    let mut args = vec![
        "reencrypt",
        "--resume-only",
        "--force-offline-reencrypt",
        "--batch-mode",
        "--key-file",
        s(&disk.key),
    ];
    args.push(s(&disk.img));
    tool("cryptsetup", &args).ok();
    disk.check_final(&model.data, &old_key);
}

#[test]
fn paused_reencryption_resumes_and_refuses_migration_while_it_runs() {
    let disk = OnlineDisk::new("busy");
    let old_key = xts::cryptsetup_volume_key(&disk.img, &disk.key);
    // The `threads` engine runs each request's crypto on the thread that transfers it: the
    // segment a request was routed to must reach that thread too.
    let daemon = disk.serve_with(&["--aio", "threads"]);
    let mut c = disk.nbd();
    let mut model = Model::new(SIZE, 23, &[]);
    model.fill(&mut c);
    // A wrong passphrase is refused at once and leaves the header alone.
    // (cryptsetup cannot look while the daemon holds the image's lock: its header's seqid
    // shows that nothing was committed.)
    let wrong = key_file(disk.dir.path(), "wrong", &passphrase("busy-wrong"));
    let seqid = read_prefix(&disk.img, 24);
    disk.ctl(&["reencrypt-start", "vol", "--key-file", s(&wrong)])
        .expect_code(code::WRONG_PASSPHRASE);
    assert_eq!(read_prefix(&disk.img, 24), seqid, "the header changed");
    assert_eq!(disk.status()["phase"], "idle");
    disk.start("2M");

    // While it runs: a migration, a second start and a keyslot change are busy at once.
    let t = Instant::now();
    let out = disk.ctl(&["migrate-start", "vol", "--to", "tcp:127.0.0.1:9"]);
    out.expect_code(code::IN_USE);
    out.error_line(&["re-encrypted"]);
    assert!(t.elapsed() < Duration::from_secs(5), "refused late");
    let again = disk.ctl(&["reencrypt-start", "vol", "--key-file", s(&disk.key)]);
    again.expect_code(code::IN_USE);
    let new_key = key_file(disk.dir.path(), "new", &passphrase("busy-new"));
    let add = disk.ctl(&[
        "key-add",
        "vol",
        "--key-file",
        s(&disk.key),
        "--new-key-file",
        s(&new_key),
    ]);
    add.expect_code(code::IN_USE);

    // Paused: the boundary stays, the data reads back, and the start continues it.
    let st = disk.ctl_json(&["reencrypt-pause", "vol"]);
    assert!(st["phase"] == "pausing" || st["phase"] == "paused", "{st}");
    let paused = disk.wait("the pause", |st| st["phase"] == "paused");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(done_bytes(&disk.status()), done_bytes(&paused));
    model.round(&mut c, done_bytes(&paused));
    model.check_all(&mut c, "while paused");
    disk.start("0");
    disk.wait("the end", |st| st["phase"] == "finished");
    model.check_all(&mut c, "after the reencryption");
    // Once finished, a migration is no longer refused as busy (it fails to connect instead).
    let out = disk.ctl(&[
        "migrate-start",
        "vol",
        "--to",
        "tcp:127.0.0.1:9",
        "--connect-timeout",
        "200",
    ]);
    assert_ne!(out.code, code::IN_USE, "{out:?}");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    disk.check_final(&model.data, &old_key);
}

#[test]
fn served_qemu_luks1_disk_gets_a_luks2_header_then_a_new_key() {
    let disk = OnlineDisk::qemu_luks1("online-luks1");
    let old_key = xts::cryptsetup_volume_key(&disk.img, &disk.key);
    let daemon = disk.serve();
    let mut c = disk.nbd();
    let mut model = Model::new(SIZE, 23, &[]);
    model.fill(&mut c);

    // A wrong passphrase is refused before the header changes.
    let wrong = key_file(disk.dir.path(), "wrong", &passphrase("online-luks1-wrong"));
    let out = disk.ctl(&["reencrypt-start", "vol", "--key-file", s(&wrong)]);
    out.expect_code(2);
    let dump = tool("cryptsetup", ["luksDump", s(&disk.img)]);
    assert!(
        dump.stdout.contains("Version:       \t1"),
        "{}",
        dump.stdout
    );

    let st = disk.start("16M");
    assert_eq!(st["phase"], "running", "{st}");
    disk.io_until_finished(&mut c, &mut model, done_bytes);
    model.check_all(&mut c, "after the conversion and reencryption");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    disk.check_final(&model.data, &old_key);
}
