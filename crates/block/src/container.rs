//! What a LUKS volume sits on: a backend whose first bytes hold the header. A local image file
//! is one; so is an RBD image (in the rbd crate), which has no file to hand the header code.
use crate::{BlockDevice, BlockError, RawFile};
use cryptblk_luks::HeaderIo;
use std::path::Path;

/// A backend that can carry a LUKS image: block I/O for the payload, header I/O for the header
/// code (`cryptblk_luks`), and the name users know it by.
pub trait Container: BlockDevice {
    /// The image's name in messages: a file's path, or `rbd:POOL/IMAGE`.
    fn name(&self) -> &Path;
    /// Where the header code reads and writes the LUKS header.
    fn header_io(&self) -> &dyn HeaderIo;
    /// Whether never-written payload sectors must read as zeros rather than as the decryption
    /// of whatever the container returns there: true where other clients of the same image
    /// (librbd's own encryption) behave so, and the disk must look the same through both.
    /// Files follow dm-crypt and QEMU's `luks` driver, which decrypt holes like any data.
    fn unwritten_reads_as_zeros(&self) -> bool {
        false
    }
    /// Makes a range read as zeros, giving its space back where the container can (a migration
    /// receiving a range the source reported as zeros).
    fn zero_range(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.write_zeroes(offset, len)
    }
    /// The image seen alike from other hosts, if it is (an RBD image; not a local file).
    fn shared_storage(&self) -> Option<&dyn SharedStorage> {
        None
    }
    /// The open image file whose lock keeps other processes out, for a successor daemon to
    /// take over without the lock lapsing; `None` where there is no such file (RBD).
    fn locked_file(&self) -> Option<&std::fs::File> {
        None
    }
    /// Grows or shrinks the image to `len` bytes (a resize); `size()` reports the new length
    /// once it holds. On an error the image keeps its old length.
    fn set_len(&self, len: u64) -> Result<(), BlockError> {
        let _ = len;
        Err(BlockError::unsupported(format!(
            "{} cannot be resized",
            self.name().display()
        )))
    }
}

/// Storage that two hosts reach alike (an RBD image in one cluster): migrating a disk on it
/// moves no data, only the right to write, which the image's exclusive lock decides.
pub trait SharedStorage: Send + Sync {
    /// Names the image the same way on every host that opens it (for RBD: the cluster's fsid,
    /// the pool's id and the image's id), so two daemons can tell they share it.
    fn identity(&self) -> Result<String, BlockError>;
    /// Stops being the image's writer, after making every completed write durable, so that
    /// another host can take over.
    fn release(&self) -> Result<(), BlockError>;
    /// Becomes the image's writer; fails (`Locked`) while another host is.
    fn acquire(&self) -> Result<(), BlockError>;
}

impl Container for RawFile {
    fn name(&self) -> &Path {
        self.path()
    }
    fn header_io(&self) -> &dyn HeaderIo {
        self
    }
    /// A punched hole (sparse and zero); zeros written where the filesystem cannot punch.
    fn zero_range(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.punch_hole(offset, len)
            .or_else(|_| BlockDevice::write_zeroes(self, offset, len))
    }
    fn set_len(&self, len: u64) -> Result<(), BlockError> {
        RawFile::set_len(self, len)
    }
    fn locked_file(&self) -> Option<&std::fs::File> {
        Some(RawFile::locked_file(self))
    }
}

/// The header code's view of the file: the buffered descriptor (header I/O is small and
/// unaligned), with its length kept in step with the size the file's queues check requests
/// against. (An encryption in place grows the image, and cuts it at its end, through here.)
impl HeaderIo for RawFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self.file(), buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self.file(), buf, offset)?;
        self.grew_to(offset + buf.len() as u64);
        Ok(())
    }
    fn size(&self) -> std::io::Result<u64> {
        Ok(BlockDevice::size(self))
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        RawFile::set_len(self, len).map_err(std::io::Error::other)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.file().sync_data()
    }
    fn sync_all(&self) -> std::io::Result<()> {
        self.file().sync_all()
    }
}
