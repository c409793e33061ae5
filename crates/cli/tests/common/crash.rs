//! What the crash tests (`crash.rs`, `crash_keyslots.rs`) share: the seed a run replays by,
//! and the 4 KiB block records whose loss, tearing or foreignness the checker finds.
use rand::RngCore;

pub const BLOCK: usize = 4096;

pub fn seed_for(test: &str) -> u64 {
    let seed = match std::env::var("CRYPTBLK_CRASH_SEED") {
        Ok(v) => v.parse().expect("CRYPTBLK_CRASH_SEED must be a u64"),
        Err(_) => rand::thread_rng().next_u64(),
    };
    eprintln!("{test}: seed {seed} (replay with CRYPTBLK_CRASH_SEED={seed})");
    seed
}

// ---------------------------------------------------------------------------------------------
// Block records
// ---------------------------------------------------------------------------------------------

const RECORD_MAGIC: &[u8; 8] = b"CBLKCRSH";

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub fn fnv1a(data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn fill(block: u64, generation: u64, out: &mut [u8]) {
    let mut st = block.rotate_left(32) ^ generation ^ 0x5eed_c0de;
    for chunk in out.chunks_mut(8) {
        let v = splitmix(&mut st).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// The 4 KiB record of `generation` for `block`: magic, block, generation, pseudo-random fill
/// derived from both, FNV-1a checksum of everything before it.
pub fn record(block: u64, generation: u64) -> Vec<u8> {
    let mut r = vec![0u8; BLOCK];
    r[..8].copy_from_slice(RECORD_MAGIC);
    r[8..16].copy_from_slice(&block.to_le_bytes());
    r[16..24].copy_from_slice(&generation.to_le_bytes());
    fill(block, generation, &mut r[24..BLOCK - 8]);
    let sum = fnv1a(&r[..BLOCK - 8]);
    r[BLOCK - 8..].copy_from_slice(&sum.to_le_bytes());
    r
}

/// Decodes a record: Ok((block, generation)), or why it is not one.
pub fn decode(r: &[u8]) -> Result<(u64, u64), String> {
    if r.iter().all(|&b| b == 0) {
        return Err("all zeros".into());
    }
    if &r[..8] != RECORD_MAGIC {
        return Err(format!("no record magic (starts {:02x?})", &r[..16]));
    }
    let block = u64::from_le_bytes(r[8..16].try_into().unwrap());
    let generation = u64::from_le_bytes(r[16..24].try_into().unwrap());
    let sum = u64::from_le_bytes(r[BLOCK - 8..].try_into().unwrap());
    if fnv1a(&r[..BLOCK - 8]) != sum {
        let expected = record(block, generation);
        let first_bad = r.iter().zip(&expected).position(|(a, b)| a != b);
        return Err(format!(
            "torn/corrupt record claiming block {block} generation {generation}: checksum \
             mismatch, first byte differing from that record at {first_bad:?}"
        ));
    }
    if r != record(block, generation).as_slice() {
        return Err(format!(
            "record block {block} gen {generation}: fill does not match"
        ));
    }
    Ok((block, generation))
}
