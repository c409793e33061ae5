//! A benchmark's scratch directory: made under a parent with enough free space, removed when
//! the benchmark ends (also on an error), and the random key file its images use.
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// A directory removed with everything in it when dropped.
#[derive(Debug)]
pub struct WorkDir {
    path: PathBuf,
}

impl WorkDir {
    /// `parent/NAME.PID`, made fresh; fails unless `parent` has `need` bytes free, saying
    /// what the room is for.
    pub fn new(parent: &Path, name: &str, need: u64, what: &str) -> Result<WorkDir> {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
        // The daemon and the tools take absolute paths only.
        let parent = parent
            .canonicalize()
            .with_context(|| format!("resolving {}", parent.display()))?;
        let free = free_bytes(&parent)?;
        if free < need {
            bail!(
                "{} has {} MiB free, {what} need {} MiB: free some space or choose another directory",
                parent.display(),
                free >> 20,
                need >> 20
            );
        }
        let path = parent.join(format!("{name}.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(WorkDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Bytes an unprivileged user may still write to the filesystem holding `dir`.
pub fn free_bytes(dir: &Path) -> Result<u64> {
    let s = rustix::fs::statvfs(dir)
        .map_err(|e| anyhow::anyhow!("statvfs({}): {}", dir.display(), std::io::Error::from(e)))?;
    Ok(s.f_bavail * s.f_frsize)
}

/// A fresh random passphrase (48 hex digits) in `path`, as the images of `images.rs` get.
pub fn write_key(path: &Path) -> Result<()> {
    let mut key = [0u8; 24];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))
        .context("reading /dev/urandom")?;
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(path, hex).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_work_dir_is_gone_after_use_and_refused_without_room() {
        let parent = tempfile::tempdir().unwrap();
        let kept;
        {
            let w = WorkDir::new(parent.path(), "t", 1, "the test files").unwrap();
            write_key(&w.join("key")).unwrap();
            assert_eq!(std::fs::read_to_string(w.join("key")).unwrap().len(), 48);
            kept = w.path().to_path_buf();
            assert!(kept.is_absolute() && kept.is_dir());
        }
        assert!(!kept.exists());
        let err = WorkDir::new(parent.path(), "t", u64::MAX, "two images").unwrap_err();
        assert!(format!("{err:#}").contains("two images need"), "{err:#}");
    }
}
