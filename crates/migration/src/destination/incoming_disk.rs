//! [`IncomingDisk`]: the `BlockDevice` a destination serves while the migration is still
//! bringing its blocks in.

use super::requests::send_requests;
use super::state::{phase_code, Created, DShared};
use crate::Phase;
use cryptblk_block::{BlockDevice, BlockError, BlockErrorKind, Extent, ExtentKind};
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

/// The disk a destination serves while a migration brings it in: before switchover every I/O
/// waits; in postcopy a read of a block not here yet asks the source for it and waits for that
/// block only, and a write makes the blocks it fully covers "received" (partially covered ones
/// are fetched first); once complete it is a plain pass-through.
pub struct IncomingDisk {
    inner: Arc<dyn BlockDevice>,
    shared: Arc<DShared>,
    payload_offset: u64,
}

impl std::fmt::Debug for IncomingDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncomingDisk")
            .field("size", &self.inner.size())
            .field("payload_offset", &self.payload_offset)
            .finish()
    }
}

fn fetch_error(op: &'static str, why: String) -> BlockError {
    BlockError::new(
        BlockErrorKind::Io,
        format!("the incoming migration of this disk failed: {why}"),
    )
    .with_op(op)
}

impl IncomingDisk {
    /// `inner` is the disk opened over the received image, whose payload starts
    /// `payload_offset` bytes into the file.
    pub(super) fn new(
        inner: Arc<dyn BlockDevice>,
        shared: Arc<DShared>,
        payload_offset: u64,
    ) -> IncomingDisk {
        IncomingDisk {
            inner,
            shared,
            payload_offset,
        }
    }

    fn complete(&self) -> bool {
        self.shared.phase_fast.load(Ordering::Acquire) == phase_code(Phase::Completed)
    }

    /// Waits until the destination is live.
    fn live(&self, op: &'static str) -> Result<&Created, BlockError> {
        let mut s = self.shared.lock();
        loop {
            match s.phase {
                Phase::Postcopy | Phase::PostcopyPaused | Phase::Completed => break,
                Phase::Failed | Phase::Cancelled => {
                    return Err(fetch_error(op, s.error.clone().unwrap_or_default()))
                }
                Phase::Setup | Phase::Precopy => {
                    s = self
                        .shared
                        .cond
                        .wait(s)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
        drop(s);
        self.shared
            .created
            .get()
            .ok_or_else(|| fetch_error(op, "no source".into()))
    }

    /// Makes sure the blocks under `len` file bytes at `offset` are here, fetching the
    /// missing ones on demand.
    fn ensure(
        &self,
        c: &Created,
        op: &'static str,
        offset: u64,
        len: u64,
    ) -> Result<(), BlockError> {
        if len == 0 || c.received.all_set(offset, len) {
            return Ok(());
        }
        let started = Instant::now();
        let g = u64::from(c.hello.granularity);
        let (first, last) = (offset / g, (offset + len - 1) / g);
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        {
            let _s = self.shared.lock();
            let mut block = first;
            while let Some((b, count)) = c.received.next_run(block, false) {
                if b > last {
                    break;
                }
                let end = (b + count).min(last + 1);
                for blk in b..end {
                    if !c.requested.is_set(blk) {
                        c.requested.set_range(blk * g, 1);
                        match ranges.last_mut() {
                            Some((o, l)) if *o + *l == blk * g => *l += g,
                            _ => ranges.push((blk * g, g)),
                        }
                    }
                }
                block = end;
            }
        }
        // The last block may be short.
        let size = c.hello.disk_size_bytes;
        for r in &mut ranges {
            r.1 = r.1.min(size - r.0);
        }
        if !ranges.is_empty() {
            send_requests(&self.shared, &ranges);
        }
        let mut s = self.shared.lock();
        while !c.received.all_set(offset, len) {
            if matches!(s.phase, Phase::Failed | Phase::Cancelled) {
                return Err(fetch_error(op, s.error.clone().unwrap_or_default()));
            }
            s = self
                .shared
                .cond
                .wait_timeout(s, Duration::from_secs(1))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        s.urgent_requests += 1;
        s.latency.record(started.elapsed());
        Ok(())
    }

    /// Before a write or discard of `len` plaintext bytes at `offset`: fetches partially
    /// covered edge blocks, then marks the covered blocks received so arriving data will not
    /// overwrite what the guest writes.
    fn before_write(&self, op: &'static str, offset: u64, len: u64) -> Result<(), BlockError> {
        let c = self.live(op)?;
        if len == 0 {
            return Ok(());
        }
        let g = u64::from(c.hello.granularity);
        let size = c.hello.disk_size_bytes;
        let start = offset + self.payload_offset;
        let end = start + len;
        if !start.is_multiple_of(g) {
            let b = start - start % g;
            self.ensure(c, op, b, g.min(size - b))?;
        }
        if !end.is_multiple_of(g) && end != size {
            let b = end - end % g;
            self.ensure(c, op, b, g.min(size - b))?;
        }
        let _order = self
            .shared
            .apply
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        c.received.set_range(start, len);
        self.shared.cond.notify_all();
        Ok(())
    }
}

impl BlockDevice for IncomingDisk {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        if !self.complete() {
            let c = self.live("read")?;
            self.ensure(c, "read", offset + self.payload_offset, buf.len() as u64)?;
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        if !self.complete() {
            self.before_write("write", offset, buf.len() as u64)?;
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), BlockError> {
        if !self.complete() {
            self.live("flush")?;
        }
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        if !self.complete() {
            self.before_write("discard", offset, len)?;
        }
        self.inner.discard(offset, len)
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        if !self.complete() {
            let c = self.live("block_status")?;
            if !c.received.all_set(offset + self.payload_offset, len) {
                // Not here yet: say "data", which is never wrong.
                return Ok(Extent {
                    len: len.min(self.inner.size().saturating_sub(offset)),
                    kind: ExtentKind::Data,
                });
            }
        }
        self.inner.block_status(offset, len)
    }
}
