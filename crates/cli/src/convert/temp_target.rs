//! New targets are written under a temporary name and renamed into place only when complete,
//! so an interrupted or failed convert never leaves a file that looks finished.
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// A target written under `.NAME.cryptblk-partial` in the destination's directory; removed on
/// drop unless committed by an atomic rename.
pub struct TempTarget {
    temp: PathBuf,
    target: PathBuf,
    committed: bool,
}

impl TempTarget {
    pub fn new(target: &Path) -> Result<Self> {
        let name = target
            .file_name()
            .context("the target path has no file name")?
            .to_string_lossy();
        let dir = target
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let temp = dir.join(format!(".{name}.cryptblk-partial"));
        // A leftover from an earlier interrupted run is ours to replace.
        let _ = std::fs::remove_file(&temp);
        Ok(TempTarget {
            temp,
            target: target.to_path_buf(),
            committed: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.temp
    }

    pub fn commit(mut self) -> Result<()> {
        std::fs::rename(&self.temp, &self.target).with_context(|| {
            format!(
                "renaming {} to {}",
                self.temp.display(),
                self.target.display()
            )
        })?;
        self.committed = true;
        let dir = self
            .target
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for TempTarget {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}
