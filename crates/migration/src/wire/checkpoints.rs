//! The payload of a `Checkpoints` frame: the source's checkpoints, each one's own changed
//! regions as runs (see `cryptblk_volume::checkpoint::CarriedCheckpoints`). Little-endian:
//!
//! ```text
//! version u8 (1) | count u8 | 0 0 | granularity u32 | covered bytes u64
//! per checkpoint, oldest first:
//!   created u64 | runs u32 | name length u8 | name | runs x (first region u64, regions u64)
//! ```
//!
//! Parsed strictly (every byte accounted for, the carried checkpoints then validated), so
//! what is accepted re-encodes to the same bytes.

use super::WireError;
use cryptblk_volume::checkpoint::{
    CarriedCheckpoint, CarriedCheckpoints, MAX_CARRIED_RUNS, MAX_CHECKPOINTS, MAX_NAME,
};

const VERSION: u8 = 1;
pub(super) const HEAD: usize = 16;
const ENTRY_HEAD: usize = 13;
const RUN: usize = 16;
/// Largest payload: every checkpoint with the longest name and the most runs (about 32 MiB).
pub(super) const MAX_LEN: usize =
    HEAD + MAX_CHECKPOINTS * (ENTRY_HEAD + MAX_NAME + MAX_CARRIED_RUNS * RUN);

fn bad(why: impl Into<String>) -> WireError {
    WireError::BadCheckpoints(why.into())
}

/// Reads `n` bytes at `*at`, moving past them.
fn take<'a>(p: &'a [u8], at: &mut usize, n: usize) -> Result<&'a [u8], WireError> {
    let bytes = at
        .checked_add(n)
        .and_then(|end| p.get(*at..end))
        .ok_or_else(|| bad(format!("cut short at byte {at}")))?;
    *at += n;
    Ok(bytes)
}

fn u64_of(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn u32_of(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

pub(super) fn encode(c: &CarriedCheckpoints, out: &mut Vec<u8>) {
    out.extend_from_slice(&[VERSION, c.checkpoints.len() as u8, 0, 0]);
    out.extend_from_slice(&c.granularity.to_le_bytes());
    out.extend_from_slice(&c.covered.to_le_bytes());
    for k in &c.checkpoints {
        out.extend_from_slice(&k.created.to_le_bytes());
        out.extend_from_slice(&(k.runs.len() as u32).to_le_bytes());
        out.push(k.name.len() as u8);
        out.extend_from_slice(k.name.as_bytes());
        for (first, count) in &k.runs {
            out.extend_from_slice(&first.to_le_bytes());
            out.extend_from_slice(&count.to_le_bytes());
        }
    }
}

/// Bytes `encode` makes of `c`.
pub(super) fn encoded_len(c: &CarriedCheckpoints) -> usize {
    HEAD + c
        .checkpoints
        .iter()
        .map(|k| ENTRY_HEAD + k.name.len() + k.runs.len() * RUN)
        .sum::<usize>()
}

pub(super) fn decode(p: &[u8]) -> Result<CarriedCheckpoints, WireError> {
    let mut at = 0;
    let head = take(p, &mut at, HEAD)?;
    if head[0] != VERSION {
        return Err(bad(format!(
            "version {} (this side reads version {VERSION})",
            head[0]
        )));
    }
    if head[2..4] != [0, 0] {
        return Err(WireError::Reserved);
    }
    let count = usize::from(head[1]);
    if count > MAX_CHECKPOINTS {
        return Err(bad(format!(
            "{count} checkpoints, more than {MAX_CHECKPOINTS}"
        )));
    }
    let mut carried = CarriedCheckpoints {
        granularity: u32_of(&head[4..]),
        covered: u64_of(&head[8..]),
        checkpoints: Vec::with_capacity(count),
    };
    for k in 0..count {
        let entry = take(p, &mut at, ENTRY_HEAD)?;
        let created = u64_of(entry);
        let runs = u32_of(&entry[8..]) as usize;
        if runs > MAX_CARRIED_RUNS {
            return Err(bad(format!(
                "checkpoint {k} has {runs} runs, more than {MAX_CARRIED_RUNS}"
            )));
        }
        let name = take(p, &mut at, usize::from(entry[12]))?;
        let name = std::str::from_utf8(name).map_err(|_| WireError::BadUtf8)?;
        let bytes = take(p, &mut at, runs * RUN)?;
        carried.checkpoints.push(CarriedCheckpoint {
            name: name.to_owned(),
            created,
            runs: bytes
                .chunks_exact(RUN)
                .map(|r| (u64_of(r), u64_of(&r[8..])))
                .collect(),
        });
    }
    if at != p.len() {
        return Err(bad(format!(
            "{} bytes after the last checkpoint",
            p.len() - at
        )));
    }
    carried.validate().map_err(bad)?;
    Ok(carried)
}
