//! Where an incoming disk is written: a new file by default; the daemon supplies other stores
//! (a new RBD image, or the very RBD image the source serves). Created once the source says
//! how large the disk is; removed again if the migration fails before the destination went
//! live. Shared storage is opened instead, and never removed.
use cryptblk_block::{Container, RawFile};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A place a migration creates its image in.
pub trait IncomingStore: Send + Sync {
    /// How users name it (a path, `rbd:POOL/IMAGE`), for messages.
    fn name(&self) -> &Path;
    /// True when something is there already: a migration never overwrites anything.
    fn exists(&self) -> bool;
    /// Creates the image, `size` bytes of zeros, open for writing. Shared storage: opens the
    /// existing image, which must be `size` bytes, without its lock.
    fn create(&self, size: u64) -> Result<Arc<dyn Container>, String>;
    /// Removes what `create` made; false if it cannot be removed yet (an RBD image is removed
    /// only once closed: the migration tries again when it lets go of it). Shared storage is
    /// never removed.
    fn remove(&self) -> bool;
    /// True when this is the image the source serves (shared storage): the migration copies
    /// nothing and takes the image's lock over at switchover.
    fn is_shared(&self) -> bool {
        false
    }
}

/// A new image file (sparse) at a path that must not exist.
#[derive(Debug)]
pub struct NewFile(pub PathBuf);

impl IncomingStore for NewFile {
    fn name(&self) -> &Path {
        &self.0
    }
    fn exists(&self) -> bool {
        self.0.exists()
    }
    fn create(&self, size: u64) -> Result<Arc<dyn Container>, String> {
        let file = RawFile::create(&self.0, size).map_err(|e| e.to_string())?;
        Ok(Arc::new(file))
    }
    fn remove(&self) -> bool {
        // Gone already is as good as removed.
        let _ = std::fs::remove_file(&self.0);
        true
    }
}
