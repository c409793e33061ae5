//! A model-checking driver for `IoQueue`s: batches of concurrent, non-overlapping reads and
//! writes with scattered and misaligned buffers, checked against an in-memory model.

use cryptblk_block::aio::{IoOp, IoQueue, IoRequest, IoVec};
use rand::{Rng, RngCore, SeedableRng};
use std::collections::HashMap;

/// One request of a batch with the memory behind its buffers.
struct Pending {
    op: IoOp,
    offset: usize,
    len: usize,
    /// Backing memory; the segments point into it at `skew`.
    mem: Vec<u8>,
    skew: usize,
    iov: Vec<IoVec>,
}

/// Splits `len` bytes at `mem[skew..]` into 1..=4 segments of multiples of `unit`.
pub fn segments(
    mem: &mut [u8],
    skew: usize,
    len: usize,
    unit: usize,
    rng: &mut impl Rng,
) -> Vec<IoVec> {
    let units = len / unit;
    let mut cuts: Vec<usize> = (0..rng.gen_range(0..4usize).min(units.saturating_sub(1)))
        .map(|_| rng.gen_range(1..units) * unit)
        .collect();
    cuts.push(0);
    cuts.push(len);
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2)
        .map(|w| IoVec::from_slice(&mut mem[skew + w[0]..skew + w[1]]))
        .collect()
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
            let mut mem = vec![0u8; len + 4096 + skew];
            let base = mem.as_ptr() as usize;
            let skew = (4096 - base % 4096) % 4096 + skew;
            let op = if rng.gen_bool(0.5) {
                IoOp::Read
            } else {
                IoOp::Write
            };
            if op == IoOp::Write {
                rng.fill_bytes(&mut mem[skew..skew + len]);
                model[offset..offset + len].copy_from_slice(&mem[skew..skew + len]);
            }
            let iov = segments(&mut mem, skew, len, block, &mut rng);
            batch.insert(
                tag,
                Pending {
                    op,
                    offset,
                    len,
                    mem,
                    skew,
                    iov,
                },
            );
        }
        for (&tag, p) in &batch {
            let req = match p.op {
                IoOp::Read => IoRequest::read(p.offset as u64, &p.iov, tag),
                _ => IoRequest::write(p.offset as u64, &p.iov, rng.gen_bool(0.2), tag),
            };
            // SAFETY: `batch` keeps the memory alive and untouched until every completion
            // has been drained below.
            unsafe { queue.push(&req) }.unwrap();
        }
        queue.submit().unwrap();
        let mut left = batch.len();
        while left > 0 {
            queue.drain(&mut |c| {
                c.result
                    .unwrap_or_else(|e| panic!("request {} failed: {e}", c.tag));
                let p = &batch[&c.tag];
                if p.op == IoOp::Read {
                    assert!(
                        p.mem[p.skew..p.skew + p.len] == model[p.offset..p.offset + p.len],
                        "read of {} bytes at {} returned wrong data",
                        p.len,
                        p.offset
                    );
                }
                left -= 1;
            });
            if left > 0 {
                queue.wait();
            }
        }
        assert_eq!(queue.in_flight(), 0);
    }
}

/// Runs one request to its end.
pub fn run(queue: &mut dyn IoQueue, req: &IoRequest<'_>) -> Result<(), cryptblk_block::BlockError> {
    // SAFETY: callers keep the request's buffers alive across the call.
    unsafe { cryptblk_block::aio::run_one(queue, req) }
}
