//! `ctl reencrypt-start --encrypt`: a served raw disk encrypted in place while an NBD client
//! keeps reading and writing it, the daemon killed part-way and restarted on the image (now
//! LUKS2, attached with the passphrase), the work finished by cryptblk or by cryptsetup; the
//! disk keeps its size throughout, and the result is checked with cryptsetup and an
//! independent decryption (cryptsetup's volume key, openssl's AES).
mod common;

use common::*;
use cryptblk_testutil::nbd::NbdClient;
use rand::{Rng, RngCore, SeedableRng};
use serde_json::Value;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The disk the client sees.
const SIZE: u64 = 32 * MIB;
/// `--reduce-device-size`: a 4 MiB header, the data shifted 4 MiB up while it runs.
const REDUCE: &str = "8M";
const SHIFT: u64 = 4 * MIB;

struct Disk {
    dir: tempfile::TempDir,
    img: PathBuf,
    key: PathBuf,
}

impl Disk {
    /// A raw image of `SIZE` zero bytes and the passphrase the encryption will be given.
    fn new(tag: &str) -> Disk {
        let dir = tempdir();
        let key = key_file(dir.path(), "key", &passphrase(tag));
        let img = dir.path().join("disk.raw");
        std::fs::File::create(&img).unwrap().set_len(SIZE).unwrap();
        Disk { dir, img, key }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `serve` with the image as disk "vol", NBD and a control socket; `--key-file` once the
    /// image is LUKS2 (from the moment the encryption started).
    fn serve(&self, with_key: bool) -> ServeProcess {
        self.serve_with(with_key, &[])
    }

    fn serve_with(&self, with_key: bool, extra: &[&str]) -> ServeProcess {
        let (control, nbd) = (self.path("ctl.sock"), self.path("nbd.sock"));
        let _ = std::fs::remove_file(&control);
        let _ = std::fs::remove_file(&nbd);
        let nbd_arg = format!("unix:{}", s(&nbd));
        let mut args = vec![
            "--image",
            s(&self.img),
            "--name",
            "vol",
            "--nbd",
            &nbd_arg,
            "--control",
            s(&control),
        ];
        if with_key {
            args.extend(["--key-file", s(&self.key)]);
        }
        args.extend_from_slice(extra);
        ServeProcess::start(&args, &control)
    }

    fn nbd(&self) -> NbdClient {
        NbdClient::connect(&self.path("nbd.sock"), "vol").unwrap()
    }

    fn ctl(&self, args: &[&str]) -> Out {
        ctl(&self.path("ctl.sock"), args)
    }

    fn status(&self) -> Value {
        ctl_json(&self.path("ctl.sock"), &["reencrypt-status", "vol"])
    }

    /// `reencrypt-start --encrypt` at `bandwidth` bytes/s (or the continuation of one).
    fn start(&self, bandwidth: &str) -> Value {
        ctl_json(
            &self.path("ctl.sock"),
            &[
                "reencrypt-start",
                "vol",
                "--encrypt",
                "--key-file",
                s(&self.key),
                "--reduce-device-size",
                REDUCE,
                "--pbkdf",
                "pbkdf2",
                "--iter-time",
                "1",
                "--max-bandwidth",
                bandwidth,
            ],
        )
    }

    /// Waits until `reencrypt-status` satisfies `done`; panics after 2 minutes.
    fn wait(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let st = self.status();
            if done(&st) {
                return st;
            }
            assert!(st["last-error"].is_null(), "encryption failed: {st}");
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {st}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn luks_dump(&self) -> String {
        let out = tool("cryptsetup", ["luksDump", s(&self.img)]);
        out.ok();
        out.stdout
    }

    fn len(&self) -> u64 {
        std::fs::metadata(&self.img).unwrap().len()
    }

    /// The image is an ordinary LUKS2 one: the header, then exactly the disk's `SIZE` bytes
    /// encrypted with a fresh 512-bit aes-xts key in 512-byte sectors; cryptsetup opens it,
    /// and it decrypts (through cryptblk and through openssl) to `plain`.
    fn check_final(&self, plain: &[u8]) {
        let dump = self.luks_dump();
        assert!(!dump.contains("online-reencrypt"), "not finished:\n{dump}");
        assert!(dump.contains("length: (whole device)"), "{dump}");
        assert_eq!(self.len(), SHIFT + SIZE, "the image is not header + disk");
        let json = dump_json(&self.img);
        assert_eq!(json["data_offset"].as_u64(), Some(SHIFT), "{json}");
        assert_eq!(json["sector_size"].as_u64(), Some(512), "{json}");
        assert!(cryptsetup_accepts(&self.img, &self.key));
        let key_hex = xts::cryptsetup_volume_key(&self.img, &self.key);
        assert_eq!(key_hex.len(), 128, "a 512-bit key: {key_hex}");
        xts::check_sampled_sectors(&self.img, &key_hex, 512, plain);
        let out = cryptblk_decrypt(&self.img, &self.key, &self.path("plain.raw"));
        assert_eq!(out.len() as u64, SIZE, "the decrypted volume's size");
        assert_same_bytes(&out, plain, "cryptblk's decryption");
    }
}

/// What the disk holds, as the client wrote it.
struct Model {
    data: Vec<u8>,
    rng: rand::rngs::StdRng,
}

impl Model {
    fn new() -> Model {
        Model {
            data: vec![0; SIZE as usize],
            rng: rand::rngs::StdRng::seed_from_u64(41),
        }
    }

    fn write(&mut self, c: &mut NbdClient, offset: u64, len: usize) {
        let mut buf = vec![0u8; len];
        self.rng.fill_bytes(&mut buf);
        c.write(offset, &buf, false).unwrap();
        self.data[offset as usize..offset as usize + len].copy_from_slice(&buf);
    }

    fn fill(&mut self, c: &mut NbdClient) {
        for off in (0..SIZE).step_by(MIB as usize) {
            self.write(c, off, MIB as usize);
        }
        c.flush().unwrap();
    }

    fn check(&self, c: &mut NbdClient, offset: u64, len: usize, when: &str) {
        let got = c.read(offset, len as u32).unwrap();
        assert_same_bytes(
            &got,
            &self.data[offset as usize..offset as usize + len],
            &format!("{len} bytes at {offset} {when}"),
        );
    }

    fn check_all(&self, c: &mut NbdClient, when: &str) {
        for off in (0..SIZE).step_by(MIB as usize) {
            self.check(c, off, MIB as usize, when);
        }
    }

    /// A round of mixed I/O: around the boundary `at` (below, across, above), across the end
    /// of the part moved to the image's end (`SHIFT`), and at random.
    fn round(&mut self, c: &mut NbdClient, at: u64) {
        let around =
            |p: u64, d: i64| (p as i64 + d).clamp(0, (SIZE - 64 * 1024) as i64) as u64 / 512 * 512;
        for (p, d) in [
            (at, -(MIB as i64)),
            (at, -4096),
            (at, -512),
            (at, 0),
            (at, 512),
            (at, MIB as i64),
            (SHIFT, -4096),
            (0, 0),
        ] {
            let off = around(p, d);
            self.write(c, off, 8192 + 512);
            self.check(c, off, 16384, "near a boundary");
        }
        for _ in 0..8 {
            let len = self.rng.gen_range(1..=32) * 512;
            let off = self.rng.gen_range(0..(SIZE - len as u64) / 512) * 512;
            if self.rng.gen_bool(0.5) {
                self.write(c, off, len);
            } else {
                self.check(c, off, len, "at random");
            }
        }
    }
}

fn done_bytes(st: &Value) -> u64 {
    st["bytes-done"].as_u64().unwrap()
}

/// The boundary an encryption has reached: it works from the disk's end down.
fn boundary(st: &Value) -> u64 {
    SIZE - done_bytes(st)
}

#[test]
fn raw_disk_encrypted_in_place_while_read_and_written() {
    let disk = Disk::new("online-encrypt");
    let daemon = disk.serve(false);
    let mut c = disk.nbd();
    let mut model = Model::new();
    model.fill(&mut c);
    assert_eq!(disk.status()["phase"], "idle");

    let st = disk.start("8M");
    assert_eq!(st["phase"], "running", "{st}");
    assert_eq!(st["mode"], "encrypt", "{st}");
    assert_eq!(st["resilience"], "datashift", "{st}");
    assert_eq!(st["bytes-total"].as_u64(), Some(SIZE), "{st}");
    // From the start the image is LUKS2, grown by the header area; the disk is not.
    // (cryptsetup cannot look while the daemon holds the image's lock.)
    assert_eq!(read_prefix(&disk.img, 6), b"LUKS\xba\xbe");
    assert_eq!(disk.len(), SIZE + 2 * SHIFT);
    let mut rounds = 0;
    loop {
        let st = disk.status();
        if st["phase"] == "finished" {
            break;
        }
        assert!(st["last-error"].is_null(), "{st}");
        model.round(&mut c, boundary(&st));
        c.flush().unwrap();
        rounds += 1;
    }
    assert!(
        rounds >= 3,
        "the I/O did not overlap the encryption ({rounds} rounds)"
    );
    model.check_all(&mut c, "after the encryption");
    assert_eq!(done_bytes(&disk.status()), SIZE);
    // A new client sees the size the first one saw.
    drop(c);
    let mut c = disk.nbd();
    assert_eq!(c.export.size, SIZE);
    model.check_all(&mut c, "through a new connection");
    let list = ctl_json(&disk.path("ctl.sock"), &["disk-list"]);
    assert_eq!(list["disks"][0]["format"], "luks", "{list}");
    assert_eq!(list["disks"][0]["size"].as_u64(), Some(SIZE), "{list}");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    disk.check_final(&model.data);
}

#[test]
fn daemon_killed_mid_encryption_serves_on_restart_and_cryptblk_finishes() {
    let disk = Disk::new("encrypt-restart");
    let daemon = disk.serve(false);
    let mut c = disk.nbd();
    let mut model = Model::new();
    model.fill(&mut c);
    disk.start("2M");
    let st = disk.wait("6 MiB encrypted", |st| done_bytes(st) >= 6 * MIB);
    model.round(&mut c, boundary(&st));
    c.flush().unwrap();
    drop(c);
    drop(daemon); // SIGKILL

    // The image is LUKS2 in mid-encryption now: attached with the passphrase, it serves at
    // once, the same size, and waits for reencrypt-start.
    assert!(disk.luks_dump().contains("online-reencrypt"));
    let daemon = disk.serve(true);
    let mut c = disk.nbd();
    assert_eq!(c.export.size, SIZE);
    let st = disk.status();
    assert_eq!(st["phase"], "paused", "{st}");
    assert_eq!(st["mode"], "encrypt", "{st}");
    let before = done_bytes(&st);
    assert!((6 * MIB..SIZE).contains(&before), "{st}");
    model.check_all(&mut c, "after the restart");
    model.round(&mut c, boundary(&st));
    c.flush().unwrap();
    // A migration cannot copy a disk whose data is moving.
    let out = disk.ctl(&["migrate-start", "vol", "--to", "tcp:127.0.0.1:9"]);
    out.expect_code(code::IN_USE);
    out.error_line(&["mid-encryption"]);

    // Continued (with `--encrypt` or without: the header says what runs), to the end.
    let st = ctl_json(
        &disk.path("ctl.sock"),
        &[
            "reencrypt-start",
            "vol",
            "--key-file",
            s(&disk.key),
            "--max-bandwidth",
            "16M",
        ],
    );
    assert_eq!(st["mode"], "encrypt", "{st}");
    loop {
        let st = disk.status();
        if st["phase"] == "finished" {
            break;
        }
        assert!(st["last-error"].is_null(), "{st}");
        model.round(&mut c, boundary(&st));
        c.flush().unwrap();
    }
    model.check_all(&mut c, "after the encryption");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    disk.check_final(&model.data);
}

#[test]
fn daemon_killed_mid_encryption_cryptsetup_finishes() {
    let disk = Disk::new("encrypt-handover");
    let daemon = disk.serve(false);
    let mut c = disk.nbd();
    let mut model = Model::new();
    model.fill(&mut c);
    disk.start("2M");
    let st = disk.wait("4 MiB encrypted", |st| done_bytes(st) >= 4 * MIB);
    model.round(&mut c, boundary(&st));
    c.flush().unwrap();
    drop(c);
    drop(daemon); // SIGKILL, perhaps inside a hotzone

    // A restart recovers a hotzone the kill interrupted; a stop leaves the header between
    // hotzones, which cryptsetup resumes.
    let daemon = disk.serve(true);
    let mut c = disk.nbd();
    model.check_all(&mut c, "after the restart");
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    tool(
        "cryptsetup",
        [
            "reencrypt",
            "--resume-only",
            "--force-offline-reencrypt",
            "--batch-mode",
            "--key-file",
            s(&disk.key),
            s(&disk.img),
        ],
    )
    .ok();
    // cryptsetup ends its encryptions with a segment to the image's end: the disk's bytes,
    // then the wiped copy of its first part (what cryptsetup does with its own).
    let dump = disk.luks_dump();
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
    let disk = Disk::new("encrypt-refusals");
    let daemon = disk.serve(false);
    let mut c = disk.nbd();
    let mut model = Model::new();
    model.fill(&mut c);
    let key = s(&disk.key);
    let refused = |args: &[&str], code: i32, needles: &[&str]| {
        let out = disk.ctl(args);
        out.expect_code(code);
        out.error_line(needles);
    };
    // Without --encrypt there is no key to replace.
    refused(
        &["reencrypt-start", "vol", "--key-file", key],
        code::OTHER,
        &["raw", "--encrypt"],
    );
    // The data shift is the resilience; a header area too small for one keyslot.
    refused(
        &[
            "reencrypt-start",
            "vol",
            "--encrypt",
            "--key-file",
            key,
            "--resilience",
            "checksum",
        ],
        code::USAGE,
        &["data shift", "resilience"],
    );
    refused(
        &[
            "reencrypt-start",
            "vol",
            "--encrypt",
            "--key-file",
            key,
            "--reduce-device-size",
            "64K",
        ],
        code::USAGE,
        &["reduce-device-size", "32M"],
    );
    // One cryptsetup takes, but whose data shift is not whole 4 KiB blocks, which the
    // disk's migration tracking moves by.
    refused(
        &[
            "reencrypt-start",
            "vol",
            "--encrypt",
            "--key-file",
            key,
            "--reduce-device-size",
            &(8 * MIB + 1024).to_string(),
        ],
        code::USAGE,
        &["multiple of 8192"],
    );
    refused(
        &["key-add", "vol", "--key-file", key, "--new-key-file", key],
        code::OTHER,
        &["raw", "not LUKS"],
    );
    assert_eq!(disk.len(), SIZE, "a refusal grew the image");
    assert_eq!(disk.status()["phase"], "idle");
    model.check_all(&mut c, "after the refusals");
    assert!(read_prefix(&disk.img, 6) != b"LUKS\xba\xbe");

    disk.start("0");
    disk.wait("the end", |st| st["phase"] == "finished");
    // An ordinary LUKS2 disk now, in the same daemon: a second passphrase, --encrypt
    // refused, a resize (the header's segment and the image), a migration not busy.
    let second = key_file(disk.dir.path(), "second", &passphrase("encrypt-second"));
    disk.ctl(&[
        "key-add",
        "vol",
        "--key-file",
        key,
        "--new-key-file",
        s(&second),
    ])
    .ok();
    refused(
        &["reencrypt-start", "vol", "--encrypt", "--key-file", key],
        code::OTHER,
        &["LUKS already"],
    );
    disk.ctl(&["disk-resize", "vol", &(SIZE + MIB).to_string()])
        .ok();
    assert_eq!(disk.len(), SHIFT + SIZE + MIB);
    drop(c);
    let mut c = disk.nbd();
    assert_eq!(c.export.size, SIZE + MIB);
    model.check_all(&mut c, "after the resize");
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
    assert!(cryptsetup_accepts(&disk.img, &second));
    let out = cryptblk_decrypt(&disk.img, &disk.key, &disk.path("plain.raw"));
    assert_same_bytes(&out[..SIZE as usize], &model.data, "after the resize");
}

/// A read-only raw disk cannot be encrypted: every sector is written.
#[test]
fn a_read_only_raw_disk_is_not_encrypted() {
    let disk = Disk::new("encrypt-readonly");
    let daemon = disk.serve_with(false, &["--readonly"]);
    let out = disk.ctl(&[
        "reencrypt-start",
        "vol",
        "--encrypt",
        "--key-file",
        s(&disk.key),
    ]);
    out.expect_code(code::USAGE);
    out.error_line(&["read-only"]);
    assert_eq!(disk.len(), SIZE);
    assert_eq!(daemon.terminate(), 0);
}
