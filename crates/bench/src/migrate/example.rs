//! Running crates/migration/examples/postcopy_latency: building it, starting one child role
//! of it, and the room its images need.
use crate::clients;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The example's switch between its parent and its child roles.
const CHILD_ENV: &str = "CRYPTBLK_POSTCOPY_LATENCY_CHILD";

/// Runs the example as a child of the given kind; its stdout (the RESULT line).
pub(super) fn child(example: &Path, kind: &str, args: &[String]) -> Result<String> {
    let mut cmd = Command::new(example);
    cmd.env(CHILD_ENV, kind).args(args).stderr(Stdio::inherit());
    eprintln!(
        "+ {CHILD_ENV}={kind} {} {}",
        example.display(),
        args.join(" ")
    );
    let out = cmd
        .output()
        .with_context(|| format!("running {}", example.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!("the {kind} run failed ({}): {}", out.status, stdout.trim());
    }
    Ok(stdout)
}

pub(super) fn build_example() -> Result<PathBuf> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut cmd = Command::new("cargo");
    cmd.current_dir(&workspace).args([
        "build",
        "--release",
        "-p",
        "cryptblk-migration",
        "--example",
        "postcopy_latency",
    ]);
    clients::show(&cmd);
    if !cmd.status().context("running cargo")?.success() {
        bail!("building the postcopy_latency example failed");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace.join("target"), PathBuf::from);
    Ok(target.join("release/examples/postcopy_latency"))
}

/// Bytes an unprivileged writer may still put on the filesystem holding `dir`.
pub(super) fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .with_context(|| format!("{}: a path with a NUL byte", dir.display()))?;
    // SAFETY: statvfs is plain integers, for which all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a live, writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        bail!(
            "statvfs({}): {}",
            dir.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}
