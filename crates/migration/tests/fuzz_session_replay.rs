//! Stable replay of the `migration_session` fuzz target (fuzz/drivers/migration_session.rs):
//! its seed corpus, then seeded random frame sequences, against a real destination session
//! on every `cargo test`.

#[path = "../../../fuzz/drivers/migration_session.rs"]
mod driver;

use cryptblk_migration::Phase;
use rand::{Rng, SeedableRng};
use std::path::Path;

#[test]
fn session_corpus_replays() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/migration_session");
    let mut inputs = 0;
    for entry in std::fs::read_dir(&dir).expect("fuzz/corpus/migration_session must exist") {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let phase = driver::run(&data);
        eprintln!("{}: {phase}", path.display());
        let name = path.file_name().unwrap().to_str().unwrap();
        let expected = match name {
            "complete_by_zero_ranges" => Some(Phase::Completed),
            "postcopy_then_hangup" | "missing_list_then_postcopy_twice" => {
                Some(Phase::PostcopyPaused)
            }
            "no_hello" | "wrong_version" | "bad_granularity" | "disk_over_store_limit" => {
                Some(Phase::Setup)
            }
            "complete_too_early" | "repeated_hello" | "damaged_frame" => Some(Phase::Failed),
            _ => None,
        };
        if let Some(expected) = expected {
            assert_eq!(phase, expected, "{name}");
        }
        inputs += 1;
    }
    assert!(inputs >= 8, "the seed corpus is missing");
}

#[test]
fn random_frame_sequences() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    for _ in 0..100 {
        let len = rng.gen_range(0..40);
        let mut data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
        // Mostly past the handshake: a valid Hello for a 1 MiB disk.
        if let Some(first) = data.first_mut() {
            if rng.gen_bool(0.8) {
                *first = 0;
            }
        }
        driver::run(&data);
    }
}
