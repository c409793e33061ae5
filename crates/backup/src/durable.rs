//! Crash-safe file replacement: a reader sees the old file or the new one, never a torn one.
use crate::error::{Error, IoContext};
use std::fs::File;
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` through `path.tmp`: write, fsync, rename, fsync the directory.
pub fn replace(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).at(&tmp)?;
    f.write_all(bytes).at(&tmp)?;
    f.sync_all().at(&tmp)?;
    drop(f);
    std::fs::rename(&tmp, path).at(path)?;
    sync_dir(path)
}

/// Makes a rename or a new name in `path`'s directory durable.
pub fn sync_dir(path: &Path) -> Result<(), Error> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all()).at(dir)
}
