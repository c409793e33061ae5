//! Helpers shared by the LUKS-core integration tests: real tools (cryptsetup, qemu-img), key
//! files, raw file edits, and cheap LUKS2 format/unlock shortcuts.
#![allow(dead_code)]

use cryptblk_crypto::{CipherSpec, SecretKey};
use cryptblk_luks::kdf::Argon2Variant;
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{FormatOptions, HashAlg, LuksVersion, PbkdfKind, PbkdfOptions, UnlockOptions};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

// ---- external tools ----

pub use cryptblk_testutil::tool;

/// Run a tool, panic with its output unless it succeeds; returns its raw output.
pub fn run_output(name: &str, args: &[&str]) -> Output {
    let out = Command::new(tool(name))
        .args(args)
        .output()
        .expect("spawn tool");
    assert!(
        out.status.success(),
        "{name} {args:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Run a tool, panic with its output unless it succeeds; returns stdout as text.
pub fn run(name: &str, args: &[&str]) -> String {
    String::from_utf8_lossy(&run_output(name, args).stdout).into_owned()
}

/// Run a tool and only report whether it succeeded (for commands expected to fail).
pub fn succeeds(name: &str, args: &[&str]) -> bool {
    Command::new(tool(name))
        .args(args)
        .output()
        .expect("spawn tool")
        .status
        .success()
}

/// `qemu-img` for commands that calibrate a KDF; panics unless it succeeds. QEMU's calibration
/// fails at random with "Unable to get accurate CPU usage": see
/// [`cryptblk_testutil::qemu_img_kdf`], which retries only that failure.
pub fn qemu_img_kdf(args: &[&str]) -> Output {
    let program = tool("qemu-img");
    let refs: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
    cryptblk_testutil::qemu_img_kdf_ok(program.as_os_str(), &refs)
}

// ---- files and keys ----

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

pub fn write_key(dir: &Path, name: &str, pass: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, pass).unwrap();
    p
}

pub fn open_rw(p: &Path) -> File {
    OpenOptions::new().read(true).write(true).open(p).unwrap()
}

/// Flip one byte of a file.
pub fn flip(p: &Path, offset: u64) {
    let f = open_rw(p);
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 0x55;
    f.write_all_at(&b, offset).unwrap();
}

pub fn read_range(p: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    File::open(p)
        .unwrap()
        .read_exact_at(&mut b, offset)
        .unwrap();
    b
}

pub fn write_range(p: &Path, offset: u64, data: &[u8]) {
    open_rw(p).write_all_at(data, offset).unwrap();
}

// ---- cryptsetup ----

/// `truncate -s size` + `cryptsetup luksFormat --type luks2` with the given extra options.
pub fn cs_format(dir: &Path, size: u64, key: &Path, extra: &[&str]) -> PathBuf {
    let img = dir.join("img");
    File::create(&img).unwrap().set_len(size).unwrap();
    let mut args = vec![
        "luksFormat",
        "--type",
        "luks2",
        "--batch-mode",
        "--key-file",
        s(key),
    ];
    args.extend_from_slice(extra);
    args.push(s(&img));
    run("cryptsetup", &args);
    img
}

/// The volume key as cryptsetup recovers it with `keyfile` (LUKS1 or LUKS2).
pub fn cryptsetup_volume_key(img: &Path, keyfile: &Path) -> Vec<u8> {
    let out = run(
        "cryptsetup",
        &[
            "luksDump",
            "--dump-volume-key",
            "--batch-mode",
            "--key-file",
            s(keyfile),
            s(img),
        ],
    );
    let mut hexs = String::new();
    let mut in_dump = false;
    for line in out.lines() {
        if let Some(rest) = line.strip_prefix("MK dump:") {
            in_dump = true;
            hexs.push_str(rest);
        } else if in_dump && line.starts_with(char::is_whitespace) {
            hexs.push_str(line);
        } else if in_dump {
            break;
        }
    }
    let hexs: String = hexs.split_whitespace().collect();
    assert!(!hexs.is_empty(), "no MK dump in cryptsetup output:\n{out}");
    hex::decode(hexs).unwrap()
}

/// Size of one LUKS2 header copy as cryptsetup writes it by default.
pub const HDR: u64 = 16384;

/// Replace the JSON of both header copies in `img`, re-checksumming them.
pub fn rewrite_json(img: &Path, edit: &dyn Fn(&str) -> String) {
    for off in [0, HDR] {
        let mut area = read_range(img, off, HDR as usize);
        let end = 4096 + area[4096..].iter().position(|&b| b == 0).unwrap();
        let json = std::str::from_utf8(&area[4096..end]).unwrap().to_string();
        let new = edit(&json);
        assert_ne!(new, json, "edit did not apply");
        area[4096..].fill(0);
        area[4096..4096 + new.len()].copy_from_slice(new.as_bytes());
        let sum = cryptblk_luks::luks2::binary::compute_checksum(HashAlg::Sha256, &area).unwrap();
        area[448..448 + 64].copy_from_slice(&sum);
        write_range(img, off, &area);
    }
}

// ---- LUKS2 through cryptblk ----

pub fn read(p: &Path) -> (Luks2Header, Vec<String>) {
    Luks2Header::read(&File::open(p).unwrap()).unwrap()
}

pub fn unlock(p: &Path, pass: &[u8]) -> cryptblk_luks::Result<(usize, SecretKey)> {
    let (h, _) = read(p);
    h.unlock(&File::open(p).unwrap(), pass, &UnlockOptions::default())
}

pub fn cheap_argon() -> PbkdfOptions {
    PbkdfOptions {
        kind: PbkdfKind::Argon2(Argon2Variant::Argon2id),
        hash: HashAlg::Sha256,
        iter_time_ms: 100,
        memory_kib: 32,
        parallel: 1,
        force_iterations: Some(4),
    }
}

pub fn cheap_pbkdf2(hash: HashAlg) -> PbkdfOptions {
    PbkdfOptions::pbkdf2_iterations(hash, 1000)
}

pub fn format_opts(cipher: &str, key_bytes: usize, sector: u32) -> FormatOptions {
    FormatOptions {
        version: LuksVersion::V2,
        cipher: CipherSpec::parse_luks2(cipher, key_bytes).unwrap(),
        hash: HashAlg::Sha256,
        pbkdf: cheap_argon(),
        sector_size: sector,
        label: Some("cryptblk-test".into()),
        uuid: None,
    }
}
