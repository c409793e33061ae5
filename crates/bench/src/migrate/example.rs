//! Running crates/migration/examples/postcopy_latency: building it and starting one child
//! role of it.
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
