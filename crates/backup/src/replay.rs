//! Reading one entry back: its extents checked record by record, its data streamed, both
//! hashed and compared with the manifest; with a target, each extent is written there
//! (`restore`), without one the entry is only checked (`verify`).
use crate::error::Error;
use crate::extents::{Kind, Reader};
use crate::manifest::{Entry, FileDigest};
use crate::pull::is_zero;
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;

const COPY_CHUNK: usize = 4 << 20;

/// A reader that hashes and counts what passes through it.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
    bytes: u64,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// Where a replay writes, and what went wrong there (an I/O error on the target is not the
/// chain's damage).
pub struct Target<'a> {
    pub file: &'a File,
    pub path: &'a Path,
}

/// Replays `entry` from the chain in `dir`; `progress` gets the entry's data bytes as they
/// pass. Damage is an [`Error::Damaged`] naming the entry and the file.
pub fn replay(
    dir: &Path,
    entry: &Entry,
    target: Option<&Target>,
    progress: &mut dyn FnMut(u64),
) -> Result<(), Error> {
    let damaged = |problem: String| Error::Damaged {
        dir: dir.to_path_buf(),
        entry: entry.checkpoint.clone(),
        problem,
    };
    let open = |f: &FileDigest, what: &str| -> Result<Hashing<BufReader<File>>, Error> {
        let path = dir.join(&f.file);
        let file =
            File::open(&path).map_err(|e| damaged(format!("its {what} file {}: {e}", f.file)))?;
        let len = file
            .metadata()
            .map_err(|e| damaged(format!("{}: {e}", f.file)))?
            .len();
        if len != f.bytes {
            return Err(damaged(format!(
                "its {what} file {} is {len} bytes long, the manifest says {}",
                f.file, f.bytes
            )));
        }
        Ok(Hashing {
            inner: BufReader::with_capacity(1 << 20, file),
            hash: Sha256::new(),
            bytes: 0,
        })
    };
    let mut data = open(&entry.data, "data")?;
    let extents = open(&entry.extents, "extents")?;
    let mut records = Reader::new(extents, entry.disk_size)
        .map_err(|p| damaged(format!("{}: {p}", entry.extents.file)))?;
    if let Some(t) = target {
        t.file.set_len(entry.disk_size).map_err(|e| io(t.path, e))?;
    }
    let mut buf = vec![0u8; COPY_CHUNK];
    while let Some(r) = records
        .next_record()
        .map_err(|p| damaged(format!("{}: {p}", entry.extents.file)))?
    {
        match r.kind {
            Kind::Zero => {
                if let Some(t) = target {
                    punch(t, r.offset, r.length)?;
                }
            }
            Kind::Data => {
                let mut at = r.offset;
                let end = r.end();
                while at < end {
                    let n = (end - at).min(COPY_CHUNK as u64) as usize;
                    data.read_exact(&mut buf[..n]).map_err(|e| {
                        damaged(format!(
                            "its data file {} ends before its extents do ({e})",
                            entry.data.file
                        ))
                    })?;
                    if let Some(t) = target {
                        if is_zero(&buf[..n]) {
                            punch(t, at, n as u64)?;
                        } else {
                            t.file
                                .write_all_at(&buf[..n], at)
                                .map_err(|e| io(t.path, e))?;
                        }
                    }
                    progress(n as u64);
                    at += n as u64;
                }
            }
        }
    }
    let extents = records.into_inner();
    // Whatever the data file holds past its extents is damage too (and must hash).
    let extra = std::io::copy(&mut data, &mut std::io::sink())
        .map_err(|e| damaged(format!("{}: {e}", entry.data.file)))?;
    if extra != 0 {
        return Err(damaged(format!(
            "its data file {} holds {extra} bytes more than its extents",
            entry.data.file
        )));
    }
    for (f, h, what) in [
        (&entry.extents, extents, "extents"),
        (&entry.data, data, "data"),
    ] {
        let got = hex::encode(h.hash.finalize());
        if got != f.sha256 || h.bytes != f.bytes {
            return Err(damaged(format!(
                "its {what} file {} does not match its checksum (sha256 {got}, the manifest says {})",
                f.file, f.sha256
            )));
        }
    }
    Ok(())
}

fn io(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Zeroes a range of the target as a hole (writing zeroes where holes are not supported).
fn punch(t: &Target, offset: u64, length: u64) -> Result<(), Error> {
    use rustix::fs::FallocateFlags;
    let punched = rustix::fs::fallocate(
        t.file,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        offset,
        length,
    );
    match punched {
        Ok(()) => return Ok(()),
        Err(rustix::io::Errno::OPNOTSUPP) => {}
        Err(e) => return Err(io(t.path, e.into())),
    }
    let zeroes = vec![0u8; COPY_CHUNK.min(length as usize)];
    let mut at = offset;
    while at < offset + length {
        let n = (offset + length - at).min(zeroes.len() as u64) as usize;
        t.file
            .write_all_at(&zeroes[..n], at)
            .map_err(|e| io(t.path, e))?;
        at += n as u64;
    }
    Ok(())
}
