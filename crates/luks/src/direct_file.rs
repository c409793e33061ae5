//! An image file with a second, O_DIRECT descriptor for the bulk data of a whole-image pass
//! (a reencryption's hotzones). Reads and writes that are aligned to [`DIRECT_ALIGN`] in
//! memory, length and offset go to the device without the page cache: no copy, no cached
//! pages to allocate and write back, which on a virtual machine cost more system time than
//! the copy itself. Everything else (the header, the checksums) goes through the ordinary
//! descriptor; the kernel keeps the two coherent (a direct write invalidates the cached
//! pages it covers, and cached data is written back before a direct read of it).
use crate::io::HeaderIo;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// The alignment of direct transfers: the largest logical block of common devices.
pub const DIRECT_ALIGN: usize = 4096;

pub struct DirectFile {
    file: File,
    direct: Option<File>,
}

impl DirectFile {
    /// `file` with a direct descriptor of `path` beside it, or `file` alone where the
    /// filesystem refuses O_DIRECT (tmpfs).
    pub fn new(file: File, path: &Path) -> DirectFile {
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok();
        DirectFile { file, direct }
    }

    /// The direct descriptor, when `ptr`, `len` and `offset` suit it.
    fn direct_for(&self, ptr: *const u8, len: usize, offset: u64) -> Option<&File> {
        let aligned = (ptr as usize).is_multiple_of(DIRECT_ALIGN)
            && len.is_multiple_of(DIRECT_ALIGN)
            && offset.is_multiple_of(DIRECT_ALIGN as u64);
        self.direct.as_ref().filter(|_| aligned && len > 0)
    }
}

impl HeaderIo for DirectFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        match self.direct_for(buf.as_ptr(), buf.len(), offset) {
            Some(direct) => FileExt::read_exact_at(direct, buf, offset),
            None => FileExt::read_exact_at(&self.file, buf, offset),
        }
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        match self.direct_for(buf.as_ptr(), buf.len(), offset) {
            Some(direct) => FileExt::write_all_at(direct, buf, offset),
            None => FileExt::write_all_at(&self.file, buf, offset),
        }
    }
    fn size(&self) -> std::io::Result<u64> {
        HeaderIo::size(&self.file)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.file.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        // Direct writes complete to the device, not necessarily to stable storage: one
        // fdatasync covers both descriptors of the same file.
        self.file.sync_data()
    }
    fn sync_all(&self) -> std::io::Result<()> {
        self.file.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_unaligned_transfers_see_each_others_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, vec![0u8; 4 * DIRECT_ALIGN]).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let io = DirectFile::new(file, &path);
        // An aligned buffer inside a larger allocation.
        let mut backing = vec![0u8; 3 * DIRECT_ALIGN];
        let at = backing.as_ptr().align_offset(DIRECT_ALIGN);
        let aligned = &mut backing[at..at + DIRECT_ALIGN];
        aligned.fill(0xa5);
        io.write_all_at(aligned, DIRECT_ALIGN as u64).unwrap();
        // A cached, unaligned write over part of it, then an aligned read sees it.
        io.write_all_at(b"header", DIRECT_ALIGN as u64 + 10)
            .unwrap();
        aligned.fill(0);
        io.read_exact_at(aligned, DIRECT_ALIGN as u64).unwrap();
        assert_eq!(&aligned[10..16], b"header");
        assert!(aligned[..10].iter().all(|&b| b == 0xa5));
        let mut small = [0u8; 4];
        io.read_exact_at(&mut small, DIRECT_ALIGN as u64 + 20)
            .unwrap();
        assert_eq!(small, [0xa5; 4]);
    }
}
