//! Which parts of the source hold data, asked once per extent.
//!
//! `block_status` on a raw file is an `lseek(SEEK_DATA)` and an `lseek(SEEK_HOLE)`, and on
//! tmpfs `SEEK_HOLE` walks the file's pages up to the next hole: asking chunk by chunk over a
//! dense file walks to its end once per chunk (a 2 GiB file in `/dev/shm` spent 16 s in
//! `lseek`). So the walker asks about the rest of the device, keeps the answer, and hands out
//! chunk-sized runs of it until the extent is used up. The source is opened read-only and
//! locked against writers for the whole copy, so a cached extent cannot go stale.
use cryptblk_block::{BlockDevice, BlockError, Extent, ExtentKind};

pub struct ExtentWalker<'a> {
    device: &'a dyn BlockDevice,
    /// The extent last reported, starting at `start`.
    start: u64,
    extent: Extent,
    /// `block_status` calls made so far.
    queries: u64,
}

impl<'a> ExtentWalker<'a> {
    pub fn new(device: &'a dyn BlockDevice) -> Self {
        ExtentWalker {
            device,
            start: 0,
            extent: Extent {
                len: 0,
                kind: ExtentKind::Data,
            },
            queries: 0,
        }
    }

    /// The kind of the bytes at `offset` and how many of the next `max` (at least one) share
    /// it. Asks the device only when `offset` is past the extent it last reported.
    pub fn run_at(&mut self, offset: u64, max: u64) -> Result<(ExtentKind, u64), BlockError> {
        let max = max.max(1);
        let end = self.start + self.extent.len;
        if !(self.start..end).contains(&offset) {
            let rest = self.device.size().saturating_sub(offset);
            self.queries += 1;
            let extent = self.device.block_status(offset, rest)?;
            self.start = offset;
            // A device must report progress; a zero-length answer counts as one byte so that
            // the copy always moves on.
            self.extent = Extent {
                len: extent.len.max(1),
                kind: extent.kind,
            };
        }
        let left = self.start + self.extent.len - offset;
        Ok((self.extent.kind, left.min(max)))
    }

    /// `block_status` calls so far: one per extent walked, whatever the chunk size.
    pub fn queries(&self) -> u64 {
        self.queries
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A device with a fixed extent map that records every `block_status` query.
    struct Mapped {
        size: u64,
        extents: Vec<(u64, u64, ExtentKind)>,
        asked: Mutex<Vec<(u64, u64)>>,
    }

    impl BlockDevice for Mapped {
        fn size(&self) -> u64 {
            self.size
        }
        fn logical_block_size(&self) -> u32 {
            512
        }
        fn read_only(&self) -> bool {
            true
        }
        fn read_at(&self, _: &mut [u8], _: u64) -> Result<(), BlockError> {
            unreachable!("the walker never reads")
        }
        fn write_at(&self, _: &[u8], _: u64) -> Result<(), BlockError> {
            unreachable!("the walker never writes")
        }
        fn flush(&self) -> Result<(), BlockError> {
            Ok(())
        }
        fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
            self.asked.lock().unwrap().push((offset, len));
            let &(start, elen, kind) = self
                .extents
                .iter()
                .find(|(s, l, _)| (*s..s + l).contains(&offset))
                .unwrap();
            Ok(Extent {
                len: (start + elen - offset).min(len),
                kind,
            })
        }
    }

    #[test]
    fn one_query_per_extent_whatever_the_chunk_size() {
        const M: u64 = 1 << 20;
        let dev = Mapped {
            size: 10 * M,
            extents: vec![
                (0, 3 * M + 512, ExtentKind::Data),
                (3 * M + 512, 4 * M - 512, ExtentKind::Unallocated),
                (7 * M, 3 * M, ExtentKind::Data),
            ],
            asked: Mutex::new(Vec::new()),
        };
        let mut walker = ExtentWalker::new(&dev);
        let mut runs = Vec::new();
        let mut offset = 0;
        while offset < dev.size {
            let (kind, len) = walker.run_at(offset, M).unwrap();
            runs.push((offset, len, kind));
            offset += len;
        }
        use ExtentKind::*;
        assert_eq!(
            runs,
            vec![
                (0, M, Data),
                (M, M, Data),
                (2 * M, M, Data),
                (3 * M, 512, Data),
                (3 * M + 512, M, Unallocated),
                (4 * M + 512, M, Unallocated),
                (5 * M + 512, M, Unallocated),
                (6 * M + 512, M - 512, Unallocated),
                (7 * M, M, Data),
                (8 * M, M, Data),
                (9 * M, M, Data),
            ]
        );
        assert_eq!(walker.queries(), 3);
        // Each query asks about the rest of the device, so one answer covers the extent.
        assert_eq!(
            *dev.asked.lock().unwrap(),
            vec![(0, 10 * M), (3 * M + 512, 7 * M - 512), (7 * M, 3 * M)]
        );
    }
}
