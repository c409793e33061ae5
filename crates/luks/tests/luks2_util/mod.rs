//! Helpers for the LUKS2 integration tests: driving the real cryptsetup, reading corpus images.
#![allow(dead_code)]

use cryptblk_crypto::{CipherSpec, SecretKey};
use cryptblk_luks::kdf::Argon2Variant;
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{FormatOptions, HashAlg, LuksVersion, PbkdfKind, PbkdfOptions, UnlockOptions};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A required external tool; fails the test (never skips) when it is missing.
pub fn tool(name: &str) -> PathBuf {
    for dir in ["/usr/sbin", "/usr/bin", "/sbin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return p;
        }
    }
    panic!("required tool '{name}' is not installed; install it (e.g. apt-get install {name}) to run this test");
}

/// Run a tool, panic with its output unless it succeeds; returns stdout.
pub fn run(name: &str, args: &[&str]) -> String {
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
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run a tool and only report whether it succeeded.
pub fn succeeds(name: &str, args: &[&str]) -> bool {
    Command::new(tool(name))
        .args(args)
        .output()
        .expect("spawn tool")
        .status
        .success()
}

pub fn write_key(dir: &Path, name: &str, pass: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, pass).unwrap();
    p
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

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

/// The volume key as cryptsetup reports it.
pub fn cs_volume_key(img: &Path, key: &Path) -> Vec<u8> {
    let out = run(
        "cryptsetup",
        &[
            "luksDump",
            "--dump-volume-key",
            "--batch-mode",
            "--key-file",
            s(key),
            s(img),
        ],
    );
    let mut hex = String::new();
    let mut in_dump = false;
    for line in out.lines() {
        if let Some(rest) = line.strip_prefix("MK dump:") {
            in_dump = true;
            hex.push_str(rest);
        } else if in_dump && line.starts_with(char::is_whitespace) {
            hex.push_str(line);
        } else {
            in_dump = false;
        }
    }
    let hex: String = hex.chars().filter(|c| c.is_ascii_hexdigit()).collect();
    assert!(!hex.is_empty(), "no MK dump in cryptsetup output:\n{out}");
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

pub fn open_rw(p: &Path) -> File {
    OpenOptions::new().read(true).write(true).open(p).unwrap()
}

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
    PbkdfOptions {
        kind: PbkdfKind::Pbkdf2,
        hash,
        force_iterations: Some(1000),
        ..cheap_argon()
    }
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

/// Decompress a corpus file into `dir` (`.xz` files; `.tar.xz` archives are unpacked).
pub fn corpus(dir: &Path, name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/corpus/cryptsetup")
        .join(name);
    assert!(src.exists(), "corpus file {} missing", src.display());
    if let Some(stem) = name.strip_suffix(".tar.xz") {
        run("tar", &["-xJf", s(&src), "-C", s(dir)]);
        return dir.join(stem);
    }
    let stem = name.strip_suffix(".xz").unwrap();
    let out = Command::new(tool("xz"))
        .args(["-dc", s(&src)])
        .output()
        .unwrap();
    assert!(out.status.success(), "xz failed on {name}");
    let p = dir.join(stem);
    std::fs::write(&p, out.stdout).unwrap();
    p
}

/// Flip one byte of a file.
pub fn flip(p: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = open_rw(p);
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 0x55;
    f.write_all_at(&b, offset).unwrap();
}

pub fn read_range(p: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut b = vec![0u8; len];
    File::open(p)
        .unwrap()
        .read_exact_at(&mut b, offset)
        .unwrap();
    b
}

pub fn write_range(p: &Path, offset: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    open_rw(p).write_all_at(data, offset).unwrap();
}
