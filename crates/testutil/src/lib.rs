//! Test support shared by cryptblk's crates. Never published; a dev-dependency only.
//!
//! - [`corpus`]: cryptsetup's own test images, looked up beside the workspace, and the honest
//!   way to skip a test when they are absent ([`skip`]).
//! - `luks` (feature `luks`): LUKS2 images that are cheap to open.
//! - [`x509`]: TLS credentials in QEMU's `tls-creds-x509` layout, made with the openssl CLI.
//! - [`docs`]: the project's pages checked against the command line and the tree.
//! - `vhost_user` (feature `vhost-user`): an in-process vhost-user-blk frontend.
//! - `nbd` (feature `nbd`): NBD test clients, strict and byte-level.
//! - `ceph` (feature `ceph`): a throwaway single-node Ceph cluster for RBD tests.

// System calls go through rustix; the one `unsafe` left (a poll on vmm-sys-util's `EventFd`,
// which lends no `BorrowedFd`) is allowed where it is made.
#![deny(unsafe_code)]

#[cfg(feature = "ceph")]
pub mod ceph;
pub mod corpus;
pub mod docs;
#[cfg(feature = "luks")]
pub mod luks;
#[cfg(feature = "nbd")]
pub mod nbd;
#[cfg(feature = "vhost-user")]
pub mod vhost_user;
pub mod x509;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Reports that the running test is skipped, and why, as one line on the process's stderr:
/// `SKIPPED <test binary>::<test name>: <reason>`. The caller then returns without asserting
/// anything. libtest counts such a test as passed, so the line is written past its output
/// capture (it shows in every run, not only for failures) and `scripts/test.sh` counts these
/// lines as skipped in its closing summary.
pub fn skip(reason: &str) {
    let line = format!("SKIPPED {}: {reason}\n", current_test());
    // `eprintln!` would be captured by libtest and shown only if the test failed.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// `<test binary>::<test name>`, as `cargo test` names them.
fn current_test() -> String {
    let exe = std::env::current_exe().ok();
    let binary = exe
        .as_deref()
        .and_then(Path::file_name)
        .and_then(|n| n.to_str())
        .map(binary_name)
        .unwrap_or("?");
    let thread = std::thread::current();
    format!("{binary}::{}", thread.name().unwrap_or("?"))
}

/// Cargo names a test binary `<target>-<16 hex digits>`; the target is what a user knows.
fn binary_name(file: &str) -> &str {
    match file.rsplit_once('-') {
        Some((target, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            target
        }
        _ => file,
    }
}

/// Test data that differs per byte and per seed.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The path of an external tool the test needs (`qemu-img`, `cryptsetup`, `nbdinfo`, ...),
/// searched in the system's binary folders, then in `PATH`. Panics when it is missing: a
/// missing interop tool fails the suite, it never skips it.
pub fn tool(name: &str) -> PathBuf {
    let mut dirs: Vec<PathBuf> = ["/usr/bin", "/usr/sbin", "/usr/local/bin", "/bin", "/sbin"]
        .iter()
        .map(PathBuf::from)
        .collect();
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    if let Some(found) = dirs.iter().map(|d| d.join(name)).find(|p| p.is_file()) {
        return found;
    }
    panic!(
        "required tool `{name}` is not installed: run scripts/install-deps.sh (it installs every \
         tool the tests drive) and run the tests again"
    );
}

/// Where scripts/build-cryptsetup27.sh puts cryptsetup 2.7 unless told otherwise.
pub const DEFAULT_CRYPTSETUP27: &str = "/var/tmp/cryptsetup-2.7.5/sbin/cryptsetup";

/// cryptsetup 2.7 (Debian 13's; Debian 12's 2.6 cannot decrypt to a detached header):
/// `$CRYPTSETUP27`, else the build script's default path. Panics when it is missing or older:
/// a missing interop tool fails the suite, it never skips it (scripts/test.sh builds it).
pub fn cryptsetup27() -> PathBuf {
    let path = std::env::var_os("CRYPTSETUP27")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CRYPTSETUP27));
    assert!(
        path.is_file(),
        "cryptsetup 2.7 is not at {} (set CRYPTSETUP27 or run scripts/build-cryptsetup27.sh, \
         which scripts/test.sh runs)",
        path.display()
    );
    let out = std::process::Command::new(&path)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", path.display()));
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && version.starts_with("cryptsetup 2.")
            && !version.starts_with("cryptsetup 2.6"),
        "{} is not cryptsetup 2.7 or later: {version}",
        path.display()
    );
    path
}

/// Runs `program args`; panics with its output unless it succeeds, so that a fixture that
/// cannot be prepared fails its test loudly.
pub fn run_tool(program: &str, args: &[&std::ffi::OsStr]) -> Output {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| {
        panic!("cannot run `{program}` ({e}): install it (scripts/install-deps.sh) and run the tests again")
    });
    assert!(
        out.status.success(),
        "`{program} {args:?}` failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `qemu_img args` for a command that calibrates a LUKS KDF (creating an encrypted image),
/// retrying only QEMU's "Unable to get accurate CPU usage" failure, and returns the last output
/// unchecked.
///
/// Why that failure happens: QEMU 7.2 times its first 32768-iteration PBKDF2 pass with the
/// calling thread's *user* time (`getrusage(RUSAGE_THREAD)`), and gives up if it reads 0 ms. The
/// kernel splits a thread's run time into user and system time by sampled ticks, so a short-lived
/// thread whose only tick so far landed in the kernel reads no user time for a pass shorter than a
/// tick. Measured on this project's machines: 53 of 100 runs failed on an idle 2-vCPU VM. Each try
/// is independent and a failed one ends in milliseconds, so many quick retries make the failure
/// vanishingly rare (20 tries 200 ms apart once failed all in a row on CI).
pub fn qemu_img_kdf(qemu_img: &std::ffi::OsStr, args: &[&std::ffi::OsStr]) -> Output {
    const TRIES: usize = 400;
    let mut last = None;
    for _ in 0..TRIES {
        let out = Command::new(qemu_img)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run `{qemu_img:?}` ({e}): install qemu-utils (scripts/install-deps.sh)"
                )
            });
        if out.status.success()
            || !String::from_utf8_lossy(&out.stderr).contains("accurate CPU usage")
        {
            return out;
        }
        last = Some(out);
    }
    last.expect("at least one try")
}

/// [`qemu_img_kdf`] that must succeed: panics with QEMU's message otherwise.
pub fn qemu_img_kdf_ok(qemu_img: &std::ffi::OsStr, args: &[&std::ffi::OsStr]) -> Output {
    let out = qemu_img_kdf(qemu_img, args);
    assert!(
        out.status.success(),
        "qemu-img {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::binary_name;

    #[test]
    fn binary_name_drops_cargos_hash() {
        assert_eq!(binary_name("corpus_luks1-0123456789abcdef"), "corpus_luks1");
        assert_eq!(binary_name("cli_errors-a1b2c3d4e5f60718"), "cli_errors");
        // Not a cargo hash: kept whole.
        assert_eq!(binary_name("my-test"), "my-test");
        assert_eq!(binary_name("plain"), "plain");
    }
}
