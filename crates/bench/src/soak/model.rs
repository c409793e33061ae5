//! What each disk must hold: every 4 KiB block the soak writes carries its disk, its block
//! number and a generation, followed by bytes derived from those three; the model remembers
//! the last generation acknowledged per block (and one written but never answered, when a
//! connection dropped under it), so every read is checked whole. The data lives in the image
//! files, so the model holds across daemon restarts.
use std::fmt;

/// The unit of the model; requests are whole blocks.
pub const BLOCK: usize = 4096;
const MAGIC: u64 = 0x6372_7970_7473_6f6b; // "cryptsok"

#[derive(Clone, Copy, Default)]
struct Block {
    /// The last generation acknowledged; 0: never written by this soak (any content goes).
    acked: u32,
    /// A later generation sent but never answered (its connection dropped): the block may
    /// hold either until a read tells which.
    in_doubt: u32,
}

/// One disk's expected contents.
pub struct Model {
    disk: u32,
    blocks: Vec<Block>,
    next_generation: u32,
}

/// A read that returned other data than the model allows.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    pub disk: u32,
    pub block: u64,
    pub expected: u32,
    pub also_allowed: Option<u32>,
    /// What the block's header says it is, if it is a block this soak wrote.
    pub found: Option<(u64, u64, u32)>,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "disk {} block {}: expected generation {}",
            self.disk, self.block, self.expected
        )?;
        if let Some(g) = self.also_allowed {
            write!(f, " (or {g}, written when its connection dropped)")?;
        }
        match self.found {
            Some((d, b, g)) if (d, b) == (self.disk as u64, self.block) => {
                write!(f, ", found generation {g} (a lost or reordered write)")
            }
            Some((d, b, g)) if d == self.disk as u64 => write!(
                f,
                ", found block {b}'s data (generation {g}): misplaced write"
            ),
            Some((d, b, g)) => write!(
                f,
                ", found disk {d} block {b} generation {g}: another disk's data"
            ),
            None => write!(f, ", found bytes this soak never wrote"),
        }
    }
}

impl Model {
    pub fn new(disk: u32, blocks: u64) -> Model {
        Model {
            disk,
            blocks: vec![Block::default(); blocks as usize],
            next_generation: 1,
        }
    }

    pub fn blocks(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// Starts a write of `count` blocks from `first`: fills `buf` with their contents at a new
    /// generation, and returns it (for [`Model::acknowledged`]).
    pub fn begin_write(&mut self, first: u64, buf: &mut [u8]) -> u32 {
        let generation = self.next_generation;
        self.next_generation += 1;
        for (i, chunk) in buf.chunks_exact_mut(BLOCK).enumerate() {
            let block = first + i as u64;
            fill(self.disk, block, generation, chunk);
            self.blocks[block as usize].in_doubt = generation;
        }
        generation
    }

    /// The write begun at `generation` was answered: its blocks hold it now.
    pub fn acknowledged(&mut self, first: u64, count: u64, generation: u32) {
        for b in &mut self.blocks[first as usize..(first + count) as usize] {
            *b = Block {
                acked: generation,
                in_doubt: 0,
            };
        }
    }

    /// Checks what a read of the blocks from `first` returned; a block that was in doubt
    /// becomes what it was found to hold.
    pub fn check(&mut self, first: u64, data: &[u8]) -> Result<(), Mismatch> {
        let mut expected = vec![0u8; BLOCK];
        for (i, chunk) in data.chunks_exact(BLOCK).enumerate() {
            let block = first + i as u64;
            let state = self.blocks[block as usize];
            let candidates = [state.acked, state.in_doubt];
            let mut matched = None;
            for &g in candidates.iter().filter(|&&g| g != 0) {
                fill(self.disk, block, g, &mut expected);
                if expected == chunk {
                    matched = Some(g);
                    break;
                }
            }
            match matched {
                Some(g) => {
                    self.blocks[block as usize] = Block {
                        acked: g,
                        in_doubt: 0,
                    }
                }
                // Never written, or a write whose connection dropped before it reached the
                // disk: whatever the image held before.
                None if state.acked == 0 => {}
                None => {
                    return Err(Mismatch {
                        disk: self.disk,
                        block,
                        expected: state.acked,
                        also_allowed: (state.in_doubt != 0).then_some(state.in_doubt),
                        found: header(chunk),
                    })
                }
            }
        }
        Ok(())
    }
}

/// A block's contents: a header (magic, disk, block, generation), then a splitmix64 stream
/// seeded from it.
pub fn fill(disk: u32, block: u64, generation: u32, out: &mut [u8]) {
    let head = [MAGIC, disk as u64, block, generation as u64];
    let mut state = MAGIC ^ ((disk as u64) << 40) ^ (block << 8) ^ ((generation as u64) << 20);
    for (i, word) in out.chunks_exact_mut(8).enumerate() {
        let v = match head.get(i) {
            Some(h) => *h,
            None => {
                state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^ (z >> 31)
            }
        };
        word.copy_from_slice(&v.to_le_bytes());
    }
}

/// (disk, block, generation) of a block this soak wrote, from its header.
fn header(chunk: &[u8]) -> Option<(u64, u64, u32)> {
    let word = |i: usize| u64::from_le_bytes(chunk[i * 8..i * 8 + 8].try_into().unwrap());
    (word(0) == MAGIC).then(|| (word(1), word(2), word(3) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(model: &mut Model, first: u64, count: usize) -> (Vec<u8>, u32) {
        let mut buf = vec![0u8; count * BLOCK];
        let g = model.begin_write(first, &mut buf);
        (buf, g)
    }

    #[test]
    fn reads_of_acknowledged_writes_pass_and_stale_or_foreign_data_fails() {
        let mut m = Model::new(3, 16);
        // Never written: anything goes.
        m.check(0, &[0xa5; 2 * BLOCK]).unwrap();
        let (old, g1) = written(&mut m, 4, 2);
        m.acknowledged(4, 2, g1);
        m.check(4, &old).unwrap();
        let (new, g2) = written(&mut m, 4, 2);
        m.acknowledged(4, 2, g2);
        m.check(4, &new).unwrap();
        // The older generation read back: a lost write, named as such.
        let e = m.check(4, &old).unwrap_err();
        assert_eq!((e.block, e.expected, e.found), (4, g2, Some((3, 4, g1))));
        assert!(e.to_string().contains("lost or reordered"), "{e}");
        // Another disk's block at the right place.
        let mut other = Model::new(4, 16);
        let (theirs, _) = written(&mut other, 5, 1);
        let e = m.check(5, &theirs).unwrap_err();
        assert!(e.to_string().contains("another disk"), "{e}");
        // One flipped byte in the middle of a block.
        let mut torn = new.clone();
        torn[BLOCK + 1000] ^= 1;
        assert_eq!(m.check(4, &torn).unwrap_err().block, 5);
    }

    #[test]
    fn a_write_whose_connection_dropped_may_or_may_not_have_landed() {
        let mut m = Model::new(1, 4);
        let (first, g1) = written(&mut m, 0, 1);
        m.acknowledged(0, 1, g1);
        let (unanswered, _) = written(&mut m, 0, 1);
        // Either is fine while in doubt ...
        m.check(0, &first).unwrap();
        // ... but once the old one was read, the new one can no longer appear.
        assert!(m.check(0, &unanswered).is_err());
        // Never written before, sent, unanswered, then found: it landed.
        let (again, _) = written(&mut m, 1, 1);
        m.check(1, &again).unwrap();
        m.check(1, &again).unwrap();
    }
}
