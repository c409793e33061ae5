//! The checkpoint store's on-disk format (version 1), encoded and parsed here and nowhere
//! else. Every integer is little-endian. The bytes come from a file anyone with access to the
//! image's directory may have changed: parsing checks every field and returns an error, never
//! panics (`fuzz/fuzz_targets/checkpoint_store.rs`).
//!
//! `index` (replaced whole: written to `index.tmp`, fsynced, renamed):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `CBCKPTIX` |
//! | 8 | 4 | version (1) |
//! | 12 | 4 | granularity in bytes (a power of two, 4 KiB to 16 MiB) |
//! | 16 | 8 | the image bytes the bitmaps cover |
//! | 24 | 8 | the next generation number |
//! | 32 | 4 | number of checkpoints (at most [`MAX_CHECKPOINTS`]) |
//! | 36 | 4 | 0 |
//! | 40 | 96 each | checkpoints, oldest first: generation (u64), created (u64, seconds since 1970 UTC), name length (u8), name (64 bytes, zero padded), 15 zero bytes |
//! | end | 32 | SHA-256 of every byte before it |
//!
//! `GGGGGGGGGGGGGGGG.bitmap` (the generation in 16 hex digits), one per checkpoint: what was
//! written since that checkpoint was added and before the next one was:
//!
//! - a 4 KiB header block: magic `CBCKPTBM`, version (u32), granularity (u32), covered bytes
//!   (u64), generation (u64), SHA-256 of those 32 bytes, then zeroes;
//! - then 4 KiB bitmap blocks: 4048 bytes of bits (506 u64 words; bit `j` of word `w` of
//!   block `b` is region `b * 32384 + w * 64 + j`, region `r` covering image bytes
//!   `r * granularity ..`), then the SHA-256 of those 4048 bytes, the generation (u64) and the
//!   block number (u64) — a block copied from another file or place does not verify.
//!
//! A bitmap block that does not verify reads as all dirty: a damaged log costs a larger
//! incremental, never a missed change.

use sha2::{Digest, Sha256};

pub(crate) const INDEX_MAGIC: &[u8; 8] = b"CBCKPTIX";
pub(crate) const BITMAP_MAGIC: &[u8; 8] = b"CBCKPTBM";
pub(crate) const VERSION: u32 = 1;
/// Checkpoints a disk keeps at most: each costs a bitmap in memory (2 MiB per TiB of disk).
pub const MAX_CHECKPOINTS: usize = 32;
/// Longest checkpoint name.
pub const MAX_NAME: usize = 64;
pub(crate) const BLOCK: usize = 4096;
/// u64 words of bits in a bitmap block.
pub(crate) const WORDS_PER_BLOCK: usize = 506;
/// Regions one bitmap block covers.
pub(crate) const REGIONS_PER_BLOCK: u64 = WORDS_PER_BLOCK as u64 * 64;
const BITS_BYTES: usize = WORDS_PER_BLOCK * 8;
const INDEX_HEAD: usize = 40;
const INDEX_ENTRY: usize = 96;
const SUM: usize = 32;
const MIN_GRANULARITY: u32 = 4096;
const MAX_GRANULARITY: u32 = 16 << 20;

/// A store file that does not parse: what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FormatError(pub String);

fn bad(why: impl Into<String>) -> FormatError {
    FormatError(why.into())
}

/// One checkpoint as the index records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub name: String,
    /// Its bitmap's generation: larger for a later checkpoint.
    pub generation: u64,
    /// When it was added, seconds since 1970 (UTC).
    pub created: u64,
}

/// The index: which checkpoints a disk has and what its bitmaps cover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Index {
    pub granularity: u32,
    pub covered: u64,
    pub next_generation: u64,
    /// Oldest first.
    pub entries: Vec<IndexEntry>,
}

/// Whether `name` may name a checkpoint: 1 to 64 of `A-Za-z0-9._-`, not starting with `.`
/// (the backup chain's rule, so one name serves both).
pub fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn valid_granularity(g: u32) -> bool {
    g.is_power_of_two() && (MIN_GRANULARITY..=MAX_GRANULARITY).contains(&g)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Index {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(INDEX_HEAD + self.entries.len() * INDEX_ENTRY + SUM);
        out.extend_from_slice(INDEX_MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.granularity.to_le_bytes());
        out.extend_from_slice(&self.covered.to_le_bytes());
        out.extend_from_slice(&self.next_generation.to_le_bytes());
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for e in &self.entries {
            let start = out.len();
            out.extend_from_slice(&e.generation.to_le_bytes());
            out.extend_from_slice(&e.created.to_le_bytes());
            out.push(e.name.len() as u8);
            out.extend_from_slice(e.name.as_bytes());
            out.resize(start + INDEX_ENTRY, 0);
        }
        let sum = Sha256::digest(&out);
        out.extend_from_slice(&sum);
        out
    }

    /// Parses and checks an index: magic, version, checksum, granularity, names (valid,
    /// unique), generations (increasing, below the next one).
    pub fn decode(bytes: &[u8]) -> Result<Index, FormatError> {
        if bytes.len() < INDEX_HEAD + SUM {
            return Err(bad(format!(
                "the index is {} bytes, shorter than its header",
                bytes.len()
            )));
        }
        if &bytes[..8] != INDEX_MAGIC {
            return Err(bad("the index does not start with CBCKPTIX"));
        }
        let version = u32_at(bytes, 8);
        if version != VERSION {
            return Err(bad(format!(
                "the index is version {version}; this cryptblk reads version {VERSION} \
                 (use a newer cryptblk)"
            )));
        }
        let count = u32_at(bytes, 32) as usize;
        if count > MAX_CHECKPOINTS {
            return Err(bad(format!(
                "the index lists {count} checkpoints, more than {MAX_CHECKPOINTS}"
            )));
        }
        let len = INDEX_HEAD + count * INDEX_ENTRY + SUM;
        if bytes.len() != len {
            return Err(bad(format!(
                "the index is {} bytes; {count} checkpoints make {len}",
                bytes.len()
            )));
        }
        if Sha256::digest(&bytes[..len - SUM])[..] != bytes[len - SUM..] {
            return Err(bad("the index's checksum does not match its contents"));
        }
        let granularity = u32_at(bytes, 12);
        if !valid_granularity(granularity) {
            return Err(bad(format!(
                "the index's granularity {granularity} is not a power of two from 4 KiB to 16 MiB"
            )));
        }
        let covered = u64_at(bytes, 16);
        let next_generation = u64_at(bytes, 24);
        let mut entries: Vec<IndexEntry> = Vec::with_capacity(count);
        for k in 0..count {
            let e = &bytes[INDEX_HEAD + k * INDEX_ENTRY..][..INDEX_ENTRY];
            let generation = u64_at(e, 0);
            let created = u64_at(e, 8);
            let name_len = e[16] as usize;
            if name_len > MAX_NAME {
                return Err(bad(format!("checkpoint {k}'s name is {name_len} bytes")));
            }
            let name = std::str::from_utf8(&e[17..17 + name_len])
                .ok()
                .filter(|n| valid_name(n))
                .ok_or_else(|| bad(format!("checkpoint {k}'s name is not a valid name")))?;
            if e[17 + name_len..].iter().any(|&b| b != 0) {
                return Err(bad(format!("checkpoint {k}'s padding is not zero")));
            }
            let after_previous = entries.last().is_none_or(|p| generation > p.generation);
            if generation == 0 || !after_previous || generation >= next_generation {
                return Err(bad(format!(
                    "checkpoint {name}'s generation {generation} is out of order"
                )));
            }
            if entries.iter().any(|p| p.name == name) {
                return Err(bad(format!("checkpoint {name} is listed twice")));
            }
            entries.push(IndexEntry {
                name: name.to_string(),
                generation,
                created,
            });
        }
        Ok(Index {
            granularity,
            covered,
            next_generation,
            entries,
        })
    }
}

/// A bitmap file's header block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BitmapHeader {
    pub granularity: u32,
    pub covered: u64,
    pub generation: u64,
}

impl BitmapHeader {
    pub fn encode(&self) -> [u8; BLOCK] {
        let mut out = [0u8; BLOCK];
        out[..8].copy_from_slice(BITMAP_MAGIC);
        out[8..12].copy_from_slice(&VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&self.granularity.to_le_bytes());
        out[16..24].copy_from_slice(&self.covered.to_le_bytes());
        out[24..32].copy_from_slice(&self.generation.to_le_bytes());
        let sum = Sha256::digest(&out[..32]);
        out[32..64].copy_from_slice(&sum);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<BitmapHeader, FormatError> {
        if bytes.len() < 64 {
            return Err(bad("the bitmap file is shorter than its header"));
        }
        if &bytes[..8] != BITMAP_MAGIC {
            return Err(bad("the bitmap file does not start with CBCKPTBM"));
        }
        let version = u32_at(bytes, 8);
        if version != VERSION {
            return Err(bad(format!(
                "the bitmap file is version {version}; this cryptblk reads version {VERSION}"
            )));
        }
        if Sha256::digest(&bytes[..32])[..] != bytes[32..64] {
            return Err(bad("the bitmap header's checksum does not match"));
        }
        let granularity = u32_at(bytes, 12);
        if !valid_granularity(granularity) {
            return Err(bad(format!(
                "the bitmap's granularity {granularity} is not a power of two from 4 KiB to 16 MiB"
            )));
        }
        Ok(BitmapHeader {
            granularity,
            covered: u64_at(bytes, 16),
            generation: u64_at(bytes, 24),
        })
    }
}

/// Where bitmap block `block` lies in its file.
pub(crate) fn block_offset(block: u64) -> u64 {
    (block + 1) * BLOCK as u64
}

/// Bitmap blocks needed for `regions` regions.
pub(crate) fn blocks_for(regions: u64) -> u64 {
    regions.div_ceil(REGIONS_PER_BLOCK)
}

fn block_sum(bits: &[u8], generation: u64, block: u64) -> [u8; SUM] {
    let mut h = Sha256::new();
    h.update(bits);
    h.update(generation.to_le_bytes());
    h.update(block.to_le_bytes());
    h.finalize().into()
}

/// Bitmap block `block` of generation `generation` holding `words` (at most 506; the rest
/// are zero).
pub(crate) fn encode_block(words: &[u64], generation: u64, block: u64, out: &mut [u8; BLOCK]) {
    out.fill(0);
    for (k, w) in words.iter().take(WORDS_PER_BLOCK).enumerate() {
        out[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    let sum = block_sum(&out[..BITS_BYTES], generation, block);
    out[BITS_BYTES..BITS_BYTES + SUM].copy_from_slice(&sum);
    out[BITS_BYTES + SUM..BITS_BYTES + SUM + 8].copy_from_slice(&generation.to_le_bytes());
    out[BITS_BYTES + SUM + 8..].copy_from_slice(&block.to_le_bytes());
}

/// The 506 words of bitmap block `block` of generation `generation`, or `None` when it does
/// not verify (the caller then counts every region it covers dirty).
pub(crate) fn decode_block(
    bytes: &[u8],
    generation: u64,
    block: u64,
) -> Option<[u64; WORDS_PER_BLOCK]> {
    // Never written (a hole of the file, made by `set_len`): no bit of it was ever durable, so
    // no write it covers was submitted. A torn write of a block is never all zeroes: it mixes
    // the new bytes with the old, which were zeroes only if the whole block was.
    if bytes.len() == BLOCK && bytes.iter().all(|&b| b == 0) {
        return Some([0; WORDS_PER_BLOCK]);
    }
    if bytes.len() != BLOCK
        || u64_at(bytes, BITS_BYTES + SUM) != generation
        || u64_at(bytes, BITS_BYTES + SUM + 8) != block
        || block_sum(&bytes[..BITS_BYTES], generation, block)[..]
            != bytes[BITS_BYTES..BITS_BYTES + SUM]
    {
        return None;
    }
    let mut words = [0u64; WORDS_PER_BLOCK];
    for (k, w) in words.iter_mut().enumerate() {
        *w = u64_at(bytes, k * 8);
    }
    Some(words)
}

/// Parses any bytes as each of the store's files; for the fuzz target.
#[doc(hidden)]
pub fn parse_any(bytes: &[u8]) {
    if let Ok(index) = Index::decode(bytes) {
        assert_eq!(Index::decode(&index.encode()).as_ref(), Ok(&index));
    }
    if let Ok(header) = BitmapHeader::decode(bytes) {
        assert_eq!(BitmapHeader::decode(&header.encode()), Ok(header));
    }
    if bytes.len() >= 16 {
        let generation = u64_at(bytes, 0);
        let block = u64_at(bytes, 8);
        let rest = &bytes[16..];
        if let Some(words) = decode_block(rest, generation, block) {
            let mut again = [0u8; BLOCK];
            encode_block(&words, generation, block, &mut again);
            assert_eq!(&again[..], rest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index() -> Index {
        Index {
            granularity: 65536,
            covered: 1 << 30,
            next_generation: 5,
            entries: vec![
                IndexEntry {
                    name: "c1".into(),
                    generation: 2,
                    created: 1_700_000_000,
                },
                IndexEntry {
                    name: "nightly.2026-11-29".into(),
                    generation: 4,
                    created: 1_700_000_100,
                },
            ],
        }
    }

    #[test]
    fn index_round_trips_and_every_damaged_byte_is_refused() {
        let bytes = index().encode();
        assert_eq!(Index::decode(&bytes), Ok(index()));
        for at in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x10;
            assert!(Index::decode(&damaged).is_err(), "byte {at} flipped");
        }
        assert!(Index::decode(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn a_newer_index_says_to_use_a_newer_cryptblk() {
        let mut bytes = index().encode();
        bytes[8] = 2;
        let err = Index::decode(&bytes).unwrap_err().to_string();
        assert!(err.contains("newer cryptblk"), "{err}");
    }

    #[test]
    fn names_follow_the_backup_chain_rule() {
        assert!(valid_name("c0") && valid_name("a.b_c-d") && valid_name(&"x".repeat(64)));
        assert!(!valid_name("") && !valid_name(".hidden") && !valid_name("a/b"));
        assert!(!valid_name(&"x".repeat(65)) && !valid_name("sp ace"));
    }

    #[test]
    fn blocks_verify_only_in_their_place() {
        let mut words = [0u64; WORDS_PER_BLOCK];
        words[0] = 0b1011;
        words[505] = 1 << 63;
        let mut block = [0u8; BLOCK];
        encode_block(&words, 7, 3, &mut block);
        assert_eq!(decode_block(&block, 7, 3), Some(words));
        assert_eq!(decode_block(&block, 7, 4), None, "another place");
        assert_eq!(decode_block(&block, 8, 3), None, "another generation");
        block[100] ^= 1;
        assert_eq!(decode_block(&block, 7, 3), None, "a damaged bit");
        assert_eq!(
            decode_block(&[0u8; BLOCK], 7, 3),
            Some([0; WORDS_PER_BLOCK]),
            "a block never written (a hole) has no bit set"
        );
        encode_block(&words, 7, 3, &mut block);
        block[BLOCK / 2..].fill(0);
        assert_eq!(decode_block(&block, 7, 3), None, "a torn write of it");
    }

    #[test]
    fn header_round_trips() {
        let h = BitmapHeader {
            granularity: 65536,
            covered: 123 << 20,
            generation: 9,
        };
        assert_eq!(BitmapHeader::decode(&h.encode()), Ok(h));
        let mut bytes = h.encode();
        bytes[20] ^= 1;
        assert!(BitmapHeader::decode(&bytes).is_err());
    }

    /// The fuzz target's checks over valid files with random damage (a stable replay of
    /// what `fuzz/fuzz_targets/checkpoint_store.rs` does under libFuzzer).
    #[test]
    fn damaged_files_are_refused_without_panicking() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(36);
        let mut block = [0u8; BLOCK];
        encode_block(&[u64::MAX; 3], 5, 2, &mut block);
        let mut block_input = Vec::from(5u64.to_le_bytes());
        block_input.extend_from_slice(&2u64.to_le_bytes());
        block_input.extend_from_slice(&block);
        let header = BitmapHeader {
            granularity: 65536,
            covered: 1 << 40,
            generation: 5,
        };
        let seeds = [index().encode(), header.encode().to_vec(), block_input];
        for seed in &seeds {
            parse_any(seed);
            for _ in 0..1000 {
                let mut input = seed.clone();
                match rng.gen_range(0..3) {
                    0 => {
                        let at = rng.gen_range(0..input.len());
                        input[at] = rng.gen();
                    }
                    1 => input.truncate(rng.gen_range(0..input.len())),
                    _ => input.extend((0..rng.gen_range(1..200)).map(|_| rng.gen::<u8>())),
                }
                parse_any(&input);
            }
        }
    }
}
