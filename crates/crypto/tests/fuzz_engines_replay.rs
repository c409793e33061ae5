//! Stable replay of the `crypto_engines` fuzz target (fuzz/drivers/crypto_engines.rs): its
//! seed corpus, then seeded random inputs, through the same driver and checks, on every
//! `cargo test -p cryptblk-crypto`.

#[path = "../../../fuzz/drivers/crypto_engines.rs"]
mod driver;

use rand::{Rng, RngCore, SeedableRng};
use std::path::Path;

#[test]
fn engine_corpus_replays() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/crypto_engines");
    let mut inputs = 0;
    for entry in std::fs::read_dir(&dir).expect("fuzz/corpus/crypto_engines must exist") {
        let path = entry.unwrap().path();
        let compared = driver::run(&std::fs::read(&path).unwrap());
        // openssl and rustcrypto everywhere, plus vaes where the CPU has VAES.
        assert!(
            compared >= 2,
            "{}: {compared} engines compared",
            path.display()
        );
        inputs += 1;
    }
    assert!(inputs >= 6, "the seed corpus is missing");
}

#[test]
fn random_inputs_agree() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xf022);
    for _ in 0..400 {
        let mut input = vec![0u8; rng.gen_range(0..200)];
        rng.fill_bytes(&mut input);
        if input.len() > 8 && rng.gen_bool(0.3) {
            // Sector numbers at the edges of the range.
            let edge = [0u64, u64::MAX, u64::MAX - 7, u64::from(u32::MAX)][rng.gen_range(0..4)];
            input[1..9].copy_from_slice(&edge.to_le_bytes());
        }
        driver::run(&input);
    }
}
