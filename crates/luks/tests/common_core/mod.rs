//! Helpers for the LUKS-core integration tests: real tools, corpus images, temp files.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Path of a required external tool; the test fails (not skips) when it is missing.
pub fn tool(name: &str) -> PathBuf {
    for dir in ["/usr/sbin", "/usr/bin", "/sbin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return p;
        }
    }
    panic!("required tool '{name}' is not installed (install it, e.g. apt-get install {name})");
}

pub fn run(name: &str, args: &[&str]) -> Output {
    let out = Command::new(tool(name))
        .args(args)
        .output()
        .expect("spawn tool");
    assert!(
        out.status.success(),
        "{name} {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `qemu-img` for commands that calibrate a KDF. QEMU 7.2 times its calibration with thread
/// CPU usage and on a loaded machine sometimes gives up with "Unable to get accurate CPU
/// usage"; only that failure is retried.
pub fn qemu_img_kdf(args: &[&str]) -> Output {
    // Each try takes milliseconds; the failure comes in bursts while other tests load the CPU.
    for attempt in 0..20 {
        if attempt > 0 {
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let out = Command::new(tool("qemu-img"))
            .args(args)
            .output()
            .expect("spawn qemu-img");
        if out.status.success()
            || !String::from_utf8_lossy(&out.stderr).contains("accurate CPU usage")
        {
            assert!(
                out.status.success(),
                "qemu-img {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            return out;
        }
    }
    panic!("qemu-img {args:?}: its KDF calibration kept failing");
}

/// Run a tool, returning whether it succeeded (for commands expected to fail).
pub fn run_status(name: &str, args: &[&str]) -> bool {
    Command::new(tool(name))
        .args(args)
        .output()
        .expect("spawn tool")
        .status
        .success()
}

pub fn corpus_dir() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/corpus/cryptsetup");
    assert!(p.is_dir(), "corpus directory {} is missing", p.display());
    p
}

/// Decompress corpus file `name.xz` into `dir`, returning the decompressed path.
pub fn unxz(name: &str, dir: &Path) -> PathBuf {
    let src = corpus_dir().join(format!("{name}.xz"));
    let out = run("xz", &["-dc", src.to_str().unwrap()]);
    let dst = dir.join(name);
    std::fs::write(&dst, out.stdout).unwrap();
    dst
}

/// Unpack corpus `name.tar.xz` into `dir`.
pub fn untar(name: &str, dir: &Path) {
    let src = corpus_dir().join(format!("{name}.tar.xz"));
    run(
        "tar",
        &["-xJf", src.to_str().unwrap(), "-C", dir.to_str().unwrap()],
    );
}

pub fn write_key(dir: &Path, name: &str, pass: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, pass).unwrap();
    p
}

/// The volume key as cryptsetup recovers it with `keyfile`.
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
    let text = String::from_utf8(out.stdout).unwrap();
    let mut hexs = String::new();
    let mut in_dump = false;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("MK dump:") {
            in_dump = true;
            hexs.push_str(rest);
        } else if in_dump && line.starts_with('\t') {
            hexs.push_str(line);
        } else if in_dump {
            break;
        }
    }
    let hexs: String = hexs.split_whitespace().collect();
    assert!(!hexs.is_empty(), "no MK dump in cryptsetup output:\n{text}");
    hex::decode(hexs).unwrap()
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

pub fn open(p: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .unwrap()
}
