//! The small Debian guest the end-to-end tests boot under QEMU (see `scripts/guest/`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// `scripts/guest`: the scripts that build and boot the guest.
pub fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/guest")
}

/// Builds (or finds cached) the guest kernel and initramfs; returns the directory holding
/// `vmlinuz` and `initramfs.cpio.gz`.
pub fn build_guest() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("guest");
    let status = Command::new(scripts().join("build-initramfs.sh"))
        .arg(&dir)
        .status()
        .expect("run scripts/guest/build-initramfs.sh");
    assert!(status.success(), "build-initramfs.sh failed: {status}");
    for file in ["vmlinuz", "initramfs.cpio.gz"] {
        assert!(dir.join(file).is_file(), "no {file} in {}", dir.display());
    }
    dir
}

/// sha256 of `data` in hex, by the host's sha256sum (coreutils), to compare with the digest
/// the guest's busybox prints.
pub fn host_digest(data: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run sha256sum");
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}
