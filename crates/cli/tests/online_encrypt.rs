//! `ctl reencrypt-start --encrypt`: a served raw disk encrypted in place while an NBD client
//! keeps reading and writing it, the daemon killed part-way and restarted on the image (now
//! LUKS2, attached with the passphrase), the work finished by cryptblk or by cryptsetup; the
//! disk keeps its size throughout, and the result is checked with cryptsetup and an
//! independent decryption (cryptsetup's volume key, openssl's AES).
mod common;

use common::online::{done_bytes, io_until_finished, status, Model, OnlineDisk};
use common::*;
use serde_json::Value;

/// The disk the client sees.
const SIZE: u64 = 32 * MIB;
/// `--reduce-device-size`: a 4 MiB header, the data shifted 4 MiB up while it runs.
const REDUCE: &str = "8M";
const SHIFT: u64 = 4 * MIB;

/// A raw image of `SIZE` zero bytes and the passphrase the encryption will be given.
fn raw_disk() -> OnlineDisk {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.raw("disk.raw", SIZE).path;
    OnlineDisk { t, img, key }
}

/// `reencrypt-start --encrypt` at `bandwidth` bytes/s (or the continuation of one).
fn start(daemon: &Daemon, disk: &OnlineDisk, bandwidth: &str) -> Value {
    let mut args = encrypt_args(disk);
    args.extend(["--max-bandwidth", bandwidth].map(Into::into));
    daemon.ctl_ok(&args)
}

/// `reencrypt-start vol --encrypt --key-file KEY --reduce-device-size REDUCE`, cheap keyslot.
fn encrypt_args(disk: &OnlineDisk) -> Vec<std::ffi::OsString> {
    let start = "reencrypt-start vol --encrypt --key-file {} --reduce-device-size {}";
    argv!(start, disk.key, REDUCE; CTL_CHEAP_KDF)
}

fn luks_dump(disk: &OnlineDisk) -> String {
    let out = cryptsetup(argv!("luksDump {}", disk.img));
    out.ok();
    out.stdout
}

fn len(disk: &OnlineDisk) -> u64 {
    std::fs::metadata(&disk.img).unwrap().len()
}

/// The image is an ordinary LUKS2 one: the header, then exactly the disk's `SIZE` bytes
/// encrypted with a fresh 512-bit aes-xts key in 512-byte sectors; cryptsetup opens it, and it
/// decrypts (through cryptblk and through openssl) to `plain`.
fn check_final(disk: &OnlineDisk, plain: &[u8]) {
    let dump = luks_dump(disk);
    assert!(!dump.contains("online-reencrypt"), "not finished:\n{dump}");
    assert!(dump.contains("length: (whole device)"), "{dump}");
    assert_eq!(len(disk), SHIFT + SIZE, "the image is not header + disk");
    let json = dump_json(&disk.img);
    assert_eq!(json["data_offset"].as_u64(), Some(SHIFT), "{json}");
    assert_eq!(json["sector_size"].as_u64(), Some(512), "{json}");
    assert!(cryptsetup_accepts(&disk.img, &disk.key));
    let key_hex = xts::cryptsetup_volume_key(&disk.img, &disk.key);
    assert_eq!(key_hex.len(), 128, "a 512-bit key: {key_hex}");
    xts::check_sampled_sectors(&disk.img, &key_hex, 512, plain);
    let out = cryptblk_decrypt(&disk.img, &disk.key, &disk.path("plain.raw"));
    assert_eq!(out.len() as u64, SIZE, "the decrypted volume's size");
    assert_same_bytes(&out, plain, "cryptblk's decryption");
}

/// The boundary an encryption has reached: it works from the disk's end down.
fn boundary(st: &Value) -> u64 {
    SIZE - done_bytes(st)
}

/// A raw disk filled through NBD, its encryption started at 2 MiB/s, written around the
/// boundary once at least `done` bytes are encrypted, then the daemon SIGKILLed (perhaps
/// inside a hotzone).
fn killed_mid_encryption(done: u64) -> (OnlineDisk, Model) {
    let disk = raw_disk();
    let mut daemon = disk.serve().start();
    let (mut c, mut model) = Model::filled(&daemon, SIZE, 41, &[SHIFT, 0]);
    start(&daemon, &disk, "2M");
    let st = daemon.wait_reencrypt("vol", "encrypted bytes", |st| done_bytes(st) >= done);
    model.round(&mut c, boundary(&st));
    c.flush().unwrap();
    drop(c);
    daemon.kill9();
    (disk, model)
}

#[test]
fn raw_disk_encrypted_in_place_while_read_and_written() {
    let disk = raw_disk();
    let mut daemon = disk.serve().start();
    let (mut c, mut model) = Model::filled(&daemon, SIZE, 41, &[SHIFT, 0]);
    assert_eq!(status(&daemon)["phase"], "idle");

    let st = start(&daemon, &disk, "8M");
    assert_eq!(st["phase"], "running", "{st}");
    assert_eq!(st["mode"], "encrypt", "{st}");
    assert_eq!(st["resilience"], "datashift", "{st}");
    assert_eq!(st["bytes-total"].as_u64(), Some(SIZE), "{st}");
    // From the start the image is LUKS2, grown by the header area; the disk is not.
    // (cryptsetup cannot look while the daemon holds the image's lock.)
    assert_eq!(read_prefix(&disk.img, 6), b"LUKS\xba\xbe");
    assert_eq!(len(&disk), SIZE + 2 * SHIFT);
    let rounds = io_until_finished(&daemon, &mut c, &mut model, boundary);
    assert!(
        rounds >= 3,
        "the I/O did not overlap the encryption ({rounds} rounds)"
    );
    model.check_all(&mut c, "after the encryption");
    assert_eq!(done_bytes(&status(&daemon)), SIZE);
    // A new client sees the size the first one saw.
    drop(c);
    let mut c = daemon.nbd("vol");
    assert_eq!(c.export.size, SIZE);
    model.check_all(&mut c, "through a new connection");
    let list = daemon.ctl_ok(&["disk-list"]);
    assert_eq!(list["disks"][0]["format"], "luks", "{list}");
    assert_eq!(list["disks"][0]["size"].as_u64(), Some(SIZE), "{list}");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    check_final(&disk, &model.data);
}

#[test]
fn daemon_killed_mid_encryption_serves_on_restart_and_cryptblk_finishes() {
    let (disk, mut model) = killed_mid_encryption(6 * MIB);

    // The image is LUKS2 in mid-encryption now: attached with the passphrase, it serves at
    // once, the same size, and waits for reencrypt-start.
    assert!(luks_dump(&disk).contains("online-reencrypt"));
    let mut daemon = disk.serve().key(&disk.key).start();
    let mut c = daemon.nbd("vol");
    assert_eq!(c.export.size, SIZE);
    let st = status(&daemon);
    assert_eq!(st["phase"], "paused", "{st}");
    assert_eq!(st["mode"], "encrypt", "{st}");
    let before = done_bytes(&st);
    assert!((6 * MIB..SIZE).contains(&before), "{st}");
    model.check_all(&mut c, "after the restart");
    model.round(&mut c, boundary(&st));
    c.flush().unwrap();
    // A migration cannot copy a disk whose data is moving.
    let migrate = argv!("migrate-start vol --to tcp:127.0.0.1:9");
    daemon
        .ctl(&migrate)
        .expect_code(code::IN_USE)
        .error_line(&["mid-encryption"]);

    // Continued (with `--encrypt` or without: the header says what runs), to the end.
    let st = daemon.ctl_ok(&argv!(
        "reencrypt-start vol --key-file {} --max-bandwidth 16M",
        disk.key
    ));
    assert_eq!(st["mode"], "encrypt", "{st}");
    io_until_finished(&daemon, &mut c, &mut model, boundary);
    model.check_all(&mut c, "after the encryption");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    check_final(&disk, &model.data);
}

#[test]
fn daemon_killed_mid_encryption_cryptsetup_finishes() {
    let (disk, model) = killed_mid_encryption(4 * MIB);

    // A restart recovers a hotzone the kill interrupted; a stop leaves the header between
    // hotzones, which cryptsetup resumes.
    let mut daemon = disk.serve().key(&disk.key).start();
    let mut c = daemon.nbd("vol");
    model.check_all(&mut c, "after the restart");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    let resume = "reencrypt --resume-only --force-offline-reencrypt --batch-mode --key-file {} {}";
    cryptsetup(argv!(resume, disk.key, disk.img)).ok();
    // cryptsetup ends its encryptions with a segment to the image's end: the disk's bytes,
    // then the wiped copy of its first part (what cryptsetup does with its own).
    let dump = luks_dump(&disk);
    assert!(!dump.contains("online-reencrypt"), "{dump}");
    assert!(cryptsetup_accepts(&disk.img, &disk.key));
    let key_hex = xts::cryptsetup_volume_key(&disk.img, &disk.key);
    xts::check_sampled_sectors(&disk.img, &key_hex, 512, &model.data);
    let out = cryptblk_decrypt(&disk.img, &disk.key, &disk.path("plain.raw"));
    assert_eq!(out.len() as u64, SIZE + SHIFT, "cryptsetup's volume");
    assert_same_bytes(&out[..SIZE as usize], &model.data, "cryptblk's decryption");
}

/// What `--encrypt` refuses, each leaving the disk as it was (raw, its size, its data); and
/// an encrypted disk is then an ordinary LUKS2 disk: keys, resizes and migrations work.
#[test]
fn refusals_leave_the_raw_disk_and_the_encrypted_disk_is_ordinary_luks() {
    let disk = raw_disk();
    let mut daemon = disk.serve().start();
    let (mut c, model) = Model::filled(&daemon, SIZE, 41, &[SHIFT, 0]);
    let key = s(&disk.key);
    let refused = |args: &[std::ffi::OsString], code: i32, needles: &[&str]| {
        daemon.ctl(args).expect_code(code).error_line(needles);
    };
    // Without --encrypt there is no key to replace.
    refused(
        &argv!("reencrypt-start vol --key-file {}", key),
        code::OTHER,
        &["raw", "--encrypt"],
    );
    // The data shift is the resilience; a header area too small for one keyslot.
    refused(
        &argv!(
            "reencrypt-start vol --encrypt --key-file {} --resilience checksum",
            key
        ),
        code::USAGE,
        &["data shift", "resilience"],
    );
    refused(
        &argv!(
            "reencrypt-start vol --encrypt --key-file {} --reduce-device-size 64K",
            key
        ),
        code::USAGE,
        &["reduce-device-size", "32M"],
    );
    // One cryptsetup takes, but whose data shift is not whole 4 KiB blocks, which the
    // disk's migration tracking moves by.
    refused(
        &argv!(
            "reencrypt-start vol --encrypt --key-file {} --reduce-device-size {}",
            key,
            &(8 * MIB + 1024).to_string()
        ),
        code::USAGE,
        &["multiple of 8192"],
    );
    refused(
        &argv!("key-add vol --key-file {} --new-key-file {}", key, key),
        code::OTHER,
        &["raw", "not LUKS"],
    );
    assert_eq!(len(&disk), SIZE, "a refusal grew the image");
    assert_eq!(status(&daemon)["phase"], "idle");
    model.check_all(&mut c, "after the refusals");
    assert!(read_prefix(&disk.img, 6) != b"LUKS\xba\xbe");

    start(&daemon, &disk, "0");
    daemon.wait_reencrypt("vol", "the end", |st| st["phase"] == "finished");
    // An ordinary LUKS2 disk now, in the same daemon: a second passphrase, --encrypt
    // refused, a resize (the header's segment and the image), a migration not busy.
    let second = disk.t.key("second");
    daemon
        .ctl(&argv!(
            "key-add vol --key-file {} --new-key-file {}",
            key,
            second
        ))
        .ok();
    refused(
        &argv!("reencrypt-start vol --encrypt --key-file {}", key),
        code::OTHER,
        &["LUKS already"],
    );
    daemon.ctl_ok(&["disk-resize", "vol", &(SIZE + MIB).to_string()]);
    assert_eq!(len(&disk), SHIFT + SIZE + MIB);
    drop(c);
    let mut c = daemon.nbd("vol");
    assert_eq!(c.export.size, SIZE + MIB);
    model.check_all(&mut c, "after the resize");
    let out = daemon.ctl(&argv!(
        "migrate-start vol --to tcp:127.0.0.1:9 --connect-timeout 200"
    ));
    assert_ne!(out.code, code::IN_USE, "{out:?}");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    assert!(cryptsetup_accepts(&disk.img, &second));
    let out = cryptblk_decrypt(&disk.img, &disk.key, &disk.path("plain.raw"));
    assert_same_bytes(&out[..SIZE as usize], &model.data, "after the resize");
}

/// A filesystem that refuses to grow the image (a file size limit here; a full disk or a
/// quota alike) fails the start with the reason, and the disk serves on, raw, at its size.
#[test]
fn an_image_that_cannot_grow_is_not_encrypted_and_serves_on() {
    let disk = raw_disk();
    let mut daemon = disk.serve().file_size_limit(SIZE + MIB).start();
    let (mut c, mut model) = Model::filled(&daemon, SIZE, 43, &[]);
    let start = encrypt_args(&disk);
    daemon
        .ctl(&start)
        .expect_code(code::IO)
        .error_line(&["growing", "File too large"]);
    assert_eq!(len(&disk), SIZE, "the image changed size");
    assert!(read_prefix(&disk.img, 6) != b"LUKS\xba\xbe");
    assert_eq!(status(&daemon)["phase"], "idle");
    model.check_all(&mut c, "after the refused start");
    model.round(&mut c, SIZE / 2);
    drop(c);
    assert_eq!(daemon.terminate(), 0);
}

/// A read-only raw disk cannot be encrypted: every sector is written.
#[test]
fn a_read_only_raw_disk_is_not_encrypted() {
    let disk = raw_disk();
    let mut daemon = disk.serve().arg("--readonly").start();
    let start = argv!("reencrypt-start vol --encrypt --key-file {}", disk.key);
    daemon
        .ctl(&start)
        .expect_code(code::USAGE)
        .error_line(&["read-only"]);
    assert_eq!(len(&disk), SIZE);
    assert_eq!(daemon.terminate(), 0);
}
