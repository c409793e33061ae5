//! A model-checking driver for `IoQueue`s: batches of concurrent, non-overlapping reads and
//! writes with scattered and misaligned buffers, checked against an in-memory model.

use cryptblk_block::aio::{IoBuffers, IoOp, IoQueue, IoRequest, OwnedBuffer};
use rand::{Rng, RngCore, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

/// One request of a batch with the memory behind its buffers.
struct Pending {
    op: IoOp,
    offset: usize,
    len: usize,
    /// Backing memory; the segments point into it at `skew`.
    mem: Arc<OwnedBuffer>,
    skew: usize,
    buffers: IoBuffers,
}

/// Splits `len` bytes at `mem[skew..]` into 1..=4 segments of multiples of `unit`.
pub fn segments(
    mem: &Arc<OwnedBuffer>,
    skew: usize,
    len: usize,
    unit: usize,
    rng: &mut impl Rng,
) -> IoBuffers {
    let units = len / unit;
    let mut cuts: Vec<usize> = (0..rng.gen_range(0..4usize).min(units.saturating_sub(1)))
        .map(|_| rng.gen_range(1..units) * unit)
        .collect();
    cuts.push(0);
    cuts.push(len);
    cuts.sort_unstable();
    cuts.dedup();
    let mut buffers = IoBuffers::new();
    buffers.set_owner(mem.clone());
    for w in cuts.windows(2) {
        buffers.add((skew + w[0]) as u64, w[1] - w[0]).unwrap();
    }
    buffers
}

/// Runs `rounds` batches of up to `depth` non-overlapping requests through `queue`, checking
/// every read against `model` and applying every write to it. Offsets and segment lengths are
/// multiples of `block`; buffers are sometimes misaligned in memory.
pub fn exercise(
    queue: &mut dyn IoQueue,
    model: &mut [u8],
    depth: usize,
    rounds: usize,
    seed: u64,
    block: usize,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let region = 64 * 1024;
    let regions = model.len() / region;
    for _ in 0..rounds {
        let mut free: Vec<usize> = (0..regions).collect();
        let n = rng.gen_range(1..=depth.min(regions));
        let mut batch: HashMap<u64, Pending> = HashMap::new();
        for tag in 0..n as u64 {
            let r = free.swap_remove(rng.gen_range(0..free.len()));
            let len = rng.gen_range(1..=region / block) * block;
            let offset = r * region + rng.gen_range(0..=(region - len) / block) * block;
            // Mostly aligned memory, sometimes misaligned by a few bytes or half a block.
            let skew = [0, 0, 0, 512, 1, 7][rng.gen_range(0..6)];
            // Direct-I/O aligned at 0.
            let mut mem = OwnedBuffer::zeroed(len + skew);
            let op = if rng.gen_bool(0.5) {
                IoOp::Read
            } else {
                IoOp::Write
            };
            if op == IoOp::Write {
                let bytes = &mut mem.bytes_mut()[skew..skew + len];
                rng.fill_bytes(bytes);
                model[offset..offset + len].copy_from_slice(bytes);
            }
            let mem = Arc::new(mem);
            let buffers = segments(&mem, skew, len, block, &mut rng);
            batch.insert(
                tag,
                Pending {
                    op,
                    offset,
                    len,
                    mem,
                    skew,
                    buffers,
                },
            );
        }
        for (&tag, p) in &batch {
            let req = match p.op {
                IoOp::Read => IoRequest::read(p.offset as u64, &p.buffers, tag),
                _ => IoRequest::write(p.offset as u64, &p.buffers, rng.gen_bool(0.2), tag),
            };
            queue.push(&req).unwrap();
        }
        queue.submit().unwrap();
        let mut left = batch.len();
        let mut done = Vec::with_capacity(batch.len());
        while left > 0 {
            queue.drain(&mut |c| {
                c.result
                    .unwrap_or_else(|e| panic!("request {} failed: {e}", c.tag));
                done.push(c.tag);
                left -= 1;
            });
            for tag in done.drain(..) {
                let p = batch.get_mut(&tag).unwrap();
                p.buffers.clear();
                let mem = Arc::get_mut(&mut p.mem)
                    .expect("the queue let go of a request's memory when it completed");
                if p.op == IoOp::Read {
                    assert!(
                        mem.bytes_mut()[p.skew..p.skew + p.len]
                            == model[p.offset..p.offset + p.len],
                        "read of {} bytes at {} returned wrong data",
                        p.len,
                        p.offset
                    );
                }
            }
            if left > 0 {
                queue.wait();
            }
        }
        assert_eq!(queue.in_flight(), 0);
    }
}

/// Runs one request to its end.
pub fn run(queue: &mut dyn IoQueue, req: &IoRequest<'_>) -> Result<(), cryptblk_block::BlockError> {
    cryptblk_block::aio::run_one(queue, req)
}
