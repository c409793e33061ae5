//! Where a LUKS header lives (a file, or any block device a backend offers: an RBD image), and
//! positioned reads and writes on it with errors that say what was being read.
use crate::{LuksError, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;

/// The container of a LUKS header and payload, as the header code needs it: positioned I/O,
/// its size, and durability points. A `File` is one; a backend (e.g. an RBD image) implements it
/// so that the same header code formats, unlocks and re-keys images that are not files.
pub trait HeaderIo {
    /// Reads exactly `buf.len()` bytes at `offset`; `UnexpectedEof` past the end.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()>;
    /// The container's size in bytes.
    fn size(&self) -> std::io::Result<u64>;
    /// Makes the container `len` bytes long (formatting grows a file to hold the header and
    /// the payload). A container that cannot change size refuses any other length.
    fn set_len(&self, len: u64) -> std::io::Result<()>;
    /// Makes what was written durable (the header is committed in ordered steps).
    fn sync_data(&self) -> std::io::Result<()>;
    /// As `sync_data`, plus the container's own metadata (a file's new length).
    fn sync_all(&self) -> std::io::Result<()> {
        self.sync_data()
    }
}

impl HeaderIo for File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        FileExt::write_all_at(self, buf, offset)
    }
    fn size(&self) -> std::io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        File::set_len(self, len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        File::sync_data(self)
    }
    fn sync_all(&self) -> std::io::Result<()> {
        File::sync_all(self)
    }
}

/// Read exactly `buf.len()` bytes at `offset`; a short file is `Truncated`, naming `what`.
pub(crate) fn read_at(file: &dyn HeaderIo, offset: u64, buf: &mut [u8], what: &str) -> Result<()> {
    match file.read_exact_at(buf, offset) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err(LuksError::Truncated(format!(
                "{what} ({} bytes at offset {offset}) lies beyond the end of the file",
                buf.len()
            )))
        }
        Err(e) => Err(e.into()),
    }
}

pub(crate) fn write_at(file: &dyn HeaderIo, offset: u64, buf: &[u8]) -> Result<()> {
    file.write_all_at(buf, offset)?;
    Ok(())
}

/// Overwrite `len` bytes at `offset` with zeros, in bounded chunks.
pub(crate) fn zero_range(file: &dyn HeaderIo, offset: u64, len: u64) -> Result<()> {
    let chunk = vec![0u8; 1 << 20];
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(chunk.len() as u64) as usize;
        file.write_all_at(&chunk[..n], offset + done)?;
        done += n as u64;
    }
    Ok(())
}
