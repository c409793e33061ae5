//! The `checksum` resilience's hashes of a hotzone: one digest per block, stored in the
//! reencrypt keyslot area before the hotzone is rewritten. Hashing is as much work as the
//! re-encryption itself (SHA-256 of every byte), so the blocks are shared out between threads
//! in contiguous runs, each writing its digests into its own part of the result.
use crate::HashAlg;

/// The digests of `data`'s `block`-byte blocks (the last may be shorter), in order, computed
/// on up to `threads` threads.
pub(super) fn block_checksums(hash: HashAlg, block: usize, data: &[u8], threads: usize) -> Vec<u8> {
    let hlen = hash.digest_len();
    let blocks = data.len().div_ceil(block);
    let mut sums = vec![0u8; blocks * hlen];
    let per_thread = blocks.div_ceil(threads.max(1)).max(1);
    let hash_run = |data: &[u8], out: &mut [u8]| {
        for (chunk, slot) in data.chunks(block).zip(out.chunks_mut(hlen)) {
            slot.copy_from_slice(&hash.digest(&[chunk]));
        }
    };
    std::thread::scope(|s| {
        let runs = data
            .chunks(per_thread * block)
            .zip(sums.chunks_mut(per_thread * hlen));
        for (data, out) in runs {
            s.spawn(move || hash_run(data, out));
        }
    });
    sums
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threads_give_the_digests_one_thread_gives() {
        let data: Vec<u8> = (0..(37 * 4096 + 100))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let serial: Vec<u8> = data
            .chunks(4096)
            .flat_map(|c| HashAlg::Sha256.digest(&[c]).to_vec())
            .collect();
        for threads in [1, 2, 3, 8, 64] {
            assert_eq!(
                block_checksums(HashAlg::Sha256, 4096, &data, threads),
                serial
            );
        }
    }
}
