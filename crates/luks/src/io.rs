//! Positioned reads and writes on the image file with errors that say what was being read.
use crate::{LuksError, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;

/// Read exactly `buf.len()` bytes at `offset`; a short file is `Truncated`, naming `what`.
pub(crate) fn read_at(file: &File, offset: u64, buf: &mut [u8], what: &str) -> Result<()> {
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

pub(crate) fn write_at(file: &File, offset: u64, buf: &[u8]) -> Result<()> {
    file.write_all_at(buf, offset)?;
    Ok(())
}

/// Overwrite `len` bytes at `offset` with zeros, in bounded chunks.
pub(crate) fn zero_range(file: &File, offset: u64, len: u64) -> Result<()> {
    let chunk = vec![0u8; 1 << 20];
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(chunk.len() as u64) as usize;
        file.write_all_at(&chunk[..n], offset + done)?;
        done += n as u64;
    }
    Ok(())
}
