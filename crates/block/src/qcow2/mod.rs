//! Read-only qcow2 (versions 2 and 3): L1/L2 lookup, zero and compressed clusters, and backing
//! chains. Metadata comes from an untrusted file, so every table entry is checked against the
//! file size before it is followed.

mod backing;
mod cache;
mod header;
mod l2;

pub use backing::MAX_BACKING_DEPTH;

use crate::error::check_range;
use crate::{BlockDevice, BlockError, BlockErrorKind, Extent, ExtentKind, OpenOptions, RawFile};
use backing::{open_backing, BackingChain};
use cache::L2Cache;
use flate2::{Decompress, FlushDecompress};
use header::Header;
use l2::{decode_l2, Mapping, OFFSET_MASK};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// Most cluster lookups one `block_status` call makes; a shorter extent is a valid answer, and
/// this keeps a query over a huge allocated image from taking unbounded time.
const MAX_STATUS_LOOKUPS: usize = 65536;
/// Memory budget of the L2 table cache.
const L2_CACHE_BYTES: usize = 4 * 1024 * 1024;

/// A read-only qcow2 image.
pub struct Qcow2 {
    file: RawFile,
    path: PathBuf,
    file_len: u64,
    header: Header,
    cluster_size: u64,
    l2_entries: u64,
    l1: Box<[u64]>,
    l2_cache: Mutex<L2Cache>,
    /// The most recently decompressed cluster (host offset, data), so that reads smaller than
    /// a compressed cluster do not inflate it again for every piece.
    last_compressed: Mutex<Option<(u64, Arc<[u8]>)>>,
    backing: Option<Arc<dyn BlockDevice>>,
    backing_path: Option<PathBuf>,
}

impl std::fmt::Debug for Qcow2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("cluster_size", &self.cluster_size)
            .field("size", &self.header.size)
            .field("backing", &self.backing_path)
            .finish()
    }
}

impl Qcow2 {
    /// Opens `path` read-only (shared lock), together with its backing chain.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, BlockError> {
        Self::open_in_chain(path.as_ref(), &mut BackingChain::default())
    }

    /// Opens `path` read-only, refusing images that name a backing file. Use this for images
    /// from untrusted sources: QEMU-style backing resolution would read whatever host file the
    /// image names (e.g. an absolute path) and expose it as guest data.
    pub fn open_standalone(path: impl AsRef<Path>) -> Result<Self, BlockError> {
        let mut chain = BackingChain::refusing();
        Self::open_in_chain(path.as_ref(), &mut chain)
    }

    fn open_in_chain(path: &Path, chain: &mut BackingChain) -> Result<Self, BlockError> {
        chain.enter(path)?;
        let file = RawFile::open(
            path,
            OpenOptions {
                writable: false,
                lock: true,
            },
        )?;
        let file_len = file.size();
        let read = |off: u64, buf: &mut [u8]| file.read_at(buf, off);
        let header = header::parse(file_len, &read).map_err(|e| e.with_path(path))?;
        if header.dirty {
            tracing::warn!(
                image = %path.display(),
                "qcow2 image was not closed cleanly (dirty bit set); reading it anyway, refcounts are not used"
            );
        }
        let cluster_size = 1u64 << header.cluster_bits;
        let l1 = read_l1(&file, &header).map_err(|e| e.with_path(path))?;

        let (backing, backing_path) = match &header.backing_file {
            Some(name) => {
                let (dev, p) = open_backing(path, name, header.backing_format.as_deref(), chain)?;
                (Some(dev), Some(p))
            }
            None => (None, None),
        };

        Ok(Qcow2 {
            path: path.to_path_buf(),
            file,
            file_len,
            cluster_size,
            l2_entries: cluster_size / 8,
            l1,
            l2_cache: Mutex::new(L2Cache::new(L2_CACHE_BYTES, cluster_size as usize)),
            last_compressed: Mutex::new(None),
            backing,
            backing_path,
            header,
        })
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    pub fn cluster_size(&self) -> u64 {
        self.cluster_size
    }

    /// The resolved path of the backing image, if any.
    pub fn backing_path(&self) -> Option<&Path> {
        self.backing_path.as_deref()
    }

    /// The mapping of the cluster containing `off`, and how many bytes from `off` share it
    /// (to the cluster end, or to the end of the L1 entry's range when it has no L2 table).
    fn map(&self, off: u64) -> Result<(Mapping, u64), BlockError> {
        let cb = self.header.cluster_bits;
        let l1_shift = cb + (cb - 3);
        let l1_span = 1u64 << l1_shift;
        let l1_idx = off >> l1_shift;
        let l1_entry = usize::try_from(l1_idx)
            .ok()
            .and_then(|i| self.l1.get(i))
            .copied()
            .unwrap_or(0);
        let l2_off = l1_entry & OFFSET_MASK;
        if l2_off == 0 {
            return Ok((Mapping::Unallocated, l1_span - (off & (l1_span - 1))));
        }
        let in_cluster = self.cluster_size - (off & (self.cluster_size - 1));
        let table = self.l2_table(l2_off).map_err(|e| e.at(off))?;
        let l2_idx = ((off >> cb) & (self.l2_entries - 1)) as usize;
        let entry = table.get(l2_idx).copied().unwrap_or(0);
        Ok((
            decode_l2(entry, &self.geometry()).map_err(|e| e.at(off))?,
            in_cluster,
        ))
    }

    fn geometry(&self) -> l2::Geometry {
        l2::Geometry {
            cluster_bits: self.header.cluster_bits,
            version: self.header.version,
            file_len: self.file_len,
        }
    }

    fn l2_table(&self, l2_off: u64) -> Result<Arc<[u64]>, BlockError> {
        if let Some(t) = lock(&self.l2_cache).get(l2_off) {
            return Ok(t);
        }
        if !l2_off.is_multiple_of(self.cluster_size) {
            return Err(BlockError::corrupt(format!(
                "L2 table offset {l2_off} is not cluster aligned"
            )));
        }
        if l2_off
            .checked_add(self.cluster_size)
            .is_none_or(|end| end > self.file_len)
        {
            return Err(BlockError::corrupt(format!(
                "L2 table at offset {l2_off} lies beyond the end of the file ({} bytes)",
                self.file_len
            )));
        }
        let mut raw = vec![0u8; self.cluster_size as usize];
        self.file.read_at(&mut raw, l2_off)?;
        let table: Arc<[u64]> = raw.chunks_exact(8).map(be64).collect();
        lock(&self.l2_cache).insert(l2_off, Arc::clone(&table));
        Ok(table)
    }

    /// Reads from a data cluster; the part of the cluster past EOF (a truncated last cluster)
    /// reads as zeros, as it does in QEMU.
    fn read_host(&self, buf: &mut [u8], host: u64) -> Result<(), BlockError> {
        let avail = self.file_len.saturating_sub(host).min(buf.len() as u64) as usize;
        let (inside, past) = buf.split_at_mut(avail);
        self.file.read_at(inside, host)?;
        past.fill(0);
        Ok(())
    }

    fn decompressed(&self, host: u64, len: u64) -> Result<Arc<[u8]>, BlockError> {
        if let Some((h, data)) = lock(&self.last_compressed).as_ref() {
            if *h == host {
                return Ok(Arc::clone(data));
            }
        }
        let mut input = vec![0u8; len as usize];
        self.file.read_at(&mut input, host)?;
        let mut out = vec![0u8; self.cluster_size as usize];
        // qcow2 stores raw deflate streams (no zlib header).
        let mut z = Decompress::new(false);
        // Like QEMU, accept the cluster once the output is full: the sector-rounded input may
        // carry padding after the end of the stream.
        z.decompress(&input, &mut out, FlushDecompress::Finish)
            .map_err(|e| {
                BlockError::corrupt(format!("compressed cluster at host offset {host}: {e}"))
            })?;
        if z.total_out() != self.cluster_size {
            return Err(BlockError::corrupt(format!(
                "compressed cluster at host offset {host} inflates to {} bytes instead of {}",
                z.total_out(),
                self.cluster_size
            )));
        }
        let data: Arc<[u8]> = Arc::from(out);
        *lock(&self.last_compressed) = Some((host, Arc::clone(&data)));
        Ok(data)
    }

    /// Reads guest bytes that are unallocated in this image: from the backing image where it
    /// has them, zeros beyond its end or without one.
    fn read_unallocated(&self, buf: &mut [u8], off: u64) -> Result<(), BlockError> {
        let Some(backing) = &self.backing else {
            buf.fill(0);
            return Ok(());
        };
        let bsize = backing.size();
        let avail = bsize.saturating_sub(off).min(buf.len() as u64) as usize;
        let (inside, past) = buf.split_at_mut(avail);
        if !inside.is_empty() {
            backing.read_at(inside, off)?;
        }
        past.fill(0);
        Ok(())
    }
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    u64::from_be_bytes(a)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded caches hold no invariants a panicking holder could break half-way.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn read_l1(file: &RawFile, header: &Header) -> Result<Box<[u64]>, BlockError> {
    let mut raw = vec![0u8; header.l1_size as usize * 8];
    if !raw.is_empty() {
        file.read_at(&mut raw, header.l1_table_offset)?;
    }
    let cluster_size = 1u64 << header.cluster_bits;
    let l1: Box<[u64]> = raw.chunks_exact(8).map(be64).collect();
    for (i, e) in l1.iter().enumerate() {
        let off = e & OFFSET_MASK;
        if !off.is_multiple_of(cluster_size) {
            return Err(BlockError::corrupt(format!(
                "L1 entry {i} points to unaligned L2 table offset {off}"
            )));
        }
    }
    Ok(l1)
}

impl BlockDevice for Qcow2 {
    fn size(&self) -> u64 {
        self.header.size
    }

    fn read_only(&self) -> bool {
        true
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        check_range("read", offset, buf.len() as u64, self.size())
            .map_err(|e| e.with_path(&self.path))?;
        let mut done = 0usize;
        while done < buf.len() {
            let off = offset + done as u64;
            let (mapping, span) = self.map(off).map_err(|e| e.with_path(&self.path))?;
            let mut n = (span.min((buf.len() - done) as u64)) as usize;
            match mapping {
                Mapping::Unallocated => self.read_unallocated(&mut buf[done..done + n], off)?,
                Mapping::Zero => buf[done..done + n].fill(0),
                Mapping::Data(host) => {
                    let start = host + (off & (self.cluster_size - 1));
                    // Coalesce following clusters that are contiguous on the host into one read.
                    while done + n < buf.len() {
                        let next = off + n as u64;
                        match self.map(next).map_err(|e| e.with_path(&self.path))? {
                            (Mapping::Data(h), span) if h == start + n as u64 => {
                                n += span.min((buf.len() - done - n) as u64) as usize;
                            }
                            _ => break,
                        }
                    }
                    self.read_host(&mut buf[done..done + n], start)
                        .map_err(|e| e.at(off).with_path(&self.path))?;
                }
                Mapping::Compressed { host, len } => {
                    let data = self
                        .decompressed(host, len)
                        .map_err(|e| e.at(off).with_path(&self.path))?;
                    let within = (off & (self.cluster_size - 1)) as usize;
                    let src = data.get(within..within + n).ok_or_else(|| {
                        BlockError::corrupt("compressed cluster shorter than a cluster")
                            .with_path(&self.path)
                    })?;
                    buf[done..done + n].copy_from_slice(src);
                }
            }
            done += n;
        }
        Ok(())
    }

    fn write_at(&self, _buf: &[u8], offset: u64) -> Result<(), BlockError> {
        Err(BlockError::new(
            BlockErrorKind::ReadOnly,
            "qcow2 images are read-only in cryptblk",
        )
        .with_op("write")
        .at(offset)
        .with_path(&self.path))
    }

    fn flush(&self) -> Result<(), BlockError> {
        Ok(())
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        check_range("block_status", offset, 0, self.size()).map_err(|e| e.with_path(&self.path))?;
        let len = len.min(self.size() - offset);
        if len == 0 {
            return Ok(Extent {
                len: 0,
                kind: ExtentKind::Data,
            });
        }
        let kind_of = |m: Mapping| match m {
            Mapping::Unallocated => ExtentKind::Unallocated,
            Mapping::Zero => ExtentKind::Zero,
            Mapping::Data(_) | Mapping::Compressed { .. } => ExtentKind::Data,
        };
        let (first, span) = self.map(offset).map_err(|e| e.with_path(&self.path))?;
        let kind = kind_of(first);
        let mut run = span.min(len);
        let mut lookups = 1;
        while run < len && lookups < MAX_STATUS_LOOKUPS {
            lookups += 1;
            let (m, span) = self
                .map(offset + run)
                .map_err(|e| e.with_path(&self.path))?;
            if kind_of(m) != kind {
                break;
            }
            run += span.min(len - run);
        }
        if kind != ExtentKind::Unallocated {
            return Ok(Extent { len: run, kind });
        }
        match &self.backing {
            Some(b) if offset < b.size() => b.block_status(offset, run.min(b.size() - offset)),
            Some(_) => Ok(Extent {
                len: run,
                kind: ExtentKind::Zero,
            }),
            None => Ok(Extent {
                len: run,
                kind: ExtentKind::Unallocated,
            }),
        }
    }
}
