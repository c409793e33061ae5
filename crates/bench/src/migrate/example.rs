//! Running crates/migration/examples/postcopy_latency: building it and starting one child
//! role of it.
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
    let release =
        crate::release_build(&["-p", "cryptblk-migration", "--example", "postcopy_latency"])?;
    Ok(release.join("examples/postcopy_latency"))
}
