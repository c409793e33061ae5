//! `backup restore`: the image as of one checkpoint, from the last full entry at or before it
//! and the incrementals after that, written sparse to a new file. The image appears under its
//! name only once every entry replayed and matched its checksums; a damaged chain leaves
//! nothing behind.
use crate::durable;
use crate::error::{Error, IoContext};
use crate::manifest::{EntryKind, Manifest};
use crate::replay::{replay, Target};
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

/// What a restore rebuilt.
#[derive(Debug, Clone)]
pub struct RestoreReport {
    pub checkpoint: String,
    /// The entries replayed, oldest first.
    pub entries: Vec<String>,
    pub disk_size: u64,
}

/// The chain in `dir`, or a usage error saying there is none.
pub fn load_chain(dir: &Path) -> Result<Manifest, Error> {
    Manifest::load(dir)?.ok_or_else(|| {
        Error::Usage(format!(
            "{} holds no backup chain (no {})",
            dir.display(),
            crate::manifest::FILE
        ))
    })
}

/// Rebuilds `image` (which must not exist) as of `checkpoint` (default: the last entry).
/// `progress` gets (bytes done, bytes in all).
pub fn restore(
    dir: &Path,
    image: &Path,
    checkpoint: Option<&str>,
    mut progress: impl FnMut(u64, u64),
) -> Result<RestoreReport, Error> {
    let chain = load_chain(dir)?;
    let target = chain.find(dir, checkpoint)?;
    let base = chain.entries[..=target]
        .iter()
        .rposition(|e| e.kind == EntryKind::Full)
        .expect("a checked chain starts with a full entry");
    let entries = &chain.entries[base..=target];
    if image.symlink_metadata().is_ok() {
        return Err(Error::Usage(format!(
            "{} exists: restore writes a new image and never overwrites one",
            image.display()
        )));
    }
    let partial = partial_path(image);
    let _ = std::fs::remove_file(&partial);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&partial)
        .at(&partial)?;
    let mut cleanup = RemoveOnDrop(Some(partial.clone()));
    let total: u64 = entries.iter().map(|e| e.data_bytes).sum();
    let mut done = 0;
    let t = Target {
        file: &file,
        path: &partial,
    };
    for e in entries {
        replay(dir, e, Some(&t), &mut |n| {
            done += n;
            progress(done, total);
        })?;
    }
    file.sync_all().at(&partial)?;
    drop(file);
    // A hard link fails if `image` appeared meanwhile: never replace someone's file.
    std::fs::hard_link(&partial, image).at(image)?;
    std::fs::remove_file(&partial).at(&partial)?;
    cleanup.0 = None;
    durable::sync_dir(image)?;
    let last = &chain.entries[target];
    Ok(RestoreReport {
        checkpoint: last.checkpoint.clone(),
        entries: entries.iter().map(|e| e.checkpoint.clone()).collect(),
        disk_size: last.disk_size,
    })
}

fn partial_path(image: &Path) -> PathBuf {
    let mut name = image.file_name().unwrap_or_default().to_os_string();
    name.push(".restore-partial");
    image.with_file_name(name)
}

struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}
