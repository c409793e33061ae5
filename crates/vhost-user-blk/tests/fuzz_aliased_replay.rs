//! Stable replay of the `virtio_blk_aliased` fuzz target (fuzz/drivers/virtio_blk_aliased.rs):
//! its seed corpus, then seeded random inputs, through the same driver and checks, so the
//! request-size cap over aliased and indirect descriptor tables is checked on every
//! `cargo test`.

#[path = "../../../fuzz/drivers/virtio_blk_aliased.rs"]
mod driver;

use driver::Outcome;
use rand::{Rng, SeedableRng};
use std::path::Path;

fn seed(name: &str) -> Vec<u8> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/virtio_blk_aliased");
    std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("seed {name}: {e}"))
}

#[test]
fn aliased_descriptor_corpus_replays() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/virtio_blk_aliased");
    let mut inputs = 0;
    for entry in std::fs::read_dir(&dir).expect("fuzz/corpus/virtio_blk_aliased must exist") {
        let path = entry.unwrap().path();
        eprintln!("{}", path.display());
        driver::run(&std::fs::read(&path).unwrap());
        inputs += 1;
    }
    assert!(inputs >= 8, "the seed corpus is missing");
}

#[test]
fn five_aliases_of_one_mib_are_refused_and_four_run() {
    for oversized in [
        "aliased_5x_size_max_out",
        "indirect_oversized_100x64k_out",
        "oversized_before_wrong_direction",
        "flush_with_aliased_data",
    ] {
        assert_eq!(
            driver::run(&seed(oversized)),
            Outcome::OversizedRejected,
            "{oversized}"
        );
    }
    assert_eq!(
        driver::run(&seed("aliased_4x_size_max_in_exactly_4mib")),
        Outcome::Executed(4 << 20)
    );
    assert_eq!(
        driver::run(&seed("indirect_aliased_254x16k_in")),
        Outcome::Executed(254 * (16 << 10))
    );
}

#[test]
fn random_aliased_descriptor_tables() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let mut oversized = 0;
    for _ in 0..300 {
        let len = rng.gen_range(0..64);
        let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        if driver::run(&data) == Outcome::OversizedRejected {
            oversized += 1;
        }
    }
    assert!(
        oversized > 0,
        "no random input reached the request-size cap"
    );
}
