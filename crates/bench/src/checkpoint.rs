//! A peer with `checkpoint = true`: the cost of the dirty log that incremental backups read
//! (issue 36), in its steady state. The server gets a control socket; once the disk serves,
//! a checkpoint is added and the whole disk written once, so every write the measurement
//! makes lands in a region already recorded. A region's first write costs a durable write of
//! the bitmap instead; that ramp is not what this measures.
//!
//! The checkpoint store lives beside the image, which the other peers serve too: it is
//! removed before every cryptblk server starts, so only the checkpoint peer records.

use crate::clients::ctl;
use crate::command::quiet_output;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The disk's name on the control socket.
pub const DISK: &str = "vol";
const CHECKPOINT: &str = "bench";

/// The control socket of a server whose disk socket is `socket`.
pub fn control_socket(socket: &Path) -> PathBuf {
    socket.with_extension("ctl")
}

/// Removes the checkpoint store a server of `image` may have left (a run stopped midway),
/// so the next server of it records nothing unless it is told to.
pub fn forget(image: &Path) -> Result<()> {
    let mut store = image.as_os_str().to_owned();
    store.push(".cryptblk-checkpoints");
    match std::fs::remove_dir_all(&store) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {}", store.to_string_lossy())),
    }
}

/// Adds the checkpoint to the served disk and writes all `size` bytes of it once through
/// `vu_bench`; fails unless the checkpoint then counts the whole disk changed.
pub fn record_everywhere(cryptblk: &Path, vu_bench: &Path, socket: &Path, size: u64) -> Result<()> {
    let control = control_socket(socket);
    ctl(cryptblk, &control, &["checkpoint-add", DISK, CHECKPOINT])?;
    quiet_output(Command::new(vu_bench).arg("--socket").arg(socket).args([
        "--rw",
        "write",
        "--bs",
        "1048576",
        "--iodepth",
        "8",
        "--once",
    ]))
    .context("writing the whole disk once under the checkpoint")?;
    let list = ctl(cryptblk, &control, &["checkpoint-list", DISK])?;
    let dirty = list["checkpoints"][0]["dirty-bytes"].as_u64().unwrap_or(0);
    if dirty < size {
        bail!("the checkpoint counts {dirty} bytes changed after the whole disk ({size} bytes) was written: {list}");
    }
    Ok(())
}
