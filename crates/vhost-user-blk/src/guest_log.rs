//! The log of guest pages the device wrote (vhost-user's dirty page log), for live migration.
//!
//! Guest memory pages, not disk blocks: the migration crate's dirty tracking is the disk's.
//!
//! vhost-user-backend's `BitmapMmapRegion` lets SET_LOG_BASE install the frontend's log at
//! run time, but every mark (each status byte, each used ring update, each read segment) then
//! takes a shared `RwLock` and every bitmap slice clones an `Arc`, even while no log is
//! installed, which is nearly always. `MemoryLog` wraps it so that marking without a log is
//! one atomic load, and slices borrow the region's bitmap instead of cloning it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vhost_user_backend::bitmap::{AtomicBitmapMmap, BitmapMmapRegion, BitmapReplace};
use vm_memory::bitmap::{Bitmap, RefSlice, WithBitmapSlice};
use vm_memory::mmap::NewBitmap;

/// The bitmap of one guest memory region: empty (marking is a no-op) until the frontend
/// shares its dirty log (SET_LOG_BASE); from then on marks go to that log, one bit per
/// 4 KiB guest page. Clones share the state.
#[derive(Clone, Debug, Default)]
pub struct MemoryLog(Arc<LogState>);

#[derive(Debug, Default)]
struct LogState {
    /// A log was installed; checked before touching `log`.
    active: AtomicBool,
    log: BitmapMmapRegion,
}

impl MemoryLog {
    /// True once the frontend installed a dirty log for this region.
    pub fn logging(&self) -> bool {
        self.0.active.load(Ordering::Acquire)
    }
}

impl<'a> WithBitmapSlice<'a> for MemoryLog {
    type S = RefSlice<'a, Self>;
}

impl Bitmap for MemoryLog {
    fn mark_dirty(&self, offset: usize, len: usize) {
        if self.logging() {
            self.0.log.mark_dirty(offset, len);
        }
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.logging() && self.0.log.dirty_at(offset)
    }

    fn slice_at(&self, offset: usize) -> <Self as WithBitmapSlice<'_>>::S {
        RefSlice::new(self, offset)
    }
}

impl BitmapReplace for MemoryLog {
    type InnerBitmap = AtomicBitmapMmap;

    /// SET_LOG_BASE: marks go to the new log from now on (also when it replaces an older
    /// one, as when the frontend resizes its log).
    fn replace(&self, bitmap: AtomicBitmapMmap) {
        self.0.log.replace(bitmap);
        self.0.active.store(true, Ordering::Release);
    }
}

impl NewBitmap for MemoryLog {
    fn with_len(_len: usize) -> Self {
        Self::default()
    }
}
