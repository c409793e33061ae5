//! Stable-Rust stand-in for the cargo-fuzz target: replay the committed fuzz corpus and a
//! bounded, deterministic set of mutations of real LUKS1 and LUKS2 headers through the
//! parser and dumps. Any panic fails the test and saves the input for the fuzz corpus.
use cryptblk_luks::LuksImage;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/luks_header")
}

/// Everything the fuzz target does with an input.
fn exercise(file: &std::fs::File, len: u64) {
    let _ = LuksImage::probe(file);
    if let Ok((image, _)) = LuksImage::read(file) {
        let _ = image.dump_json();
        let _ = image.dump_text();
        let _ = image.data_size(len);
        let _ = image.cipher_spec();
        let _ = image.active_keyslots();
        let _ = image.read_only_reason();
        if let LuksImage::V2(h) = &image {
            let _ = h.reencrypt_state();
            let _ = h.reencrypt_extents(len);
        }
    }
}

fn check(file: &std::fs::File, data: &[u8], what: &str) {
    file.set_len(0).unwrap();
    file.write_all_at(data, 0).unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        exercise(file, data.len() as u64)
    }));
    if r.is_err() {
        let out = std::env::temp_dir().join(format!("luks-crash-{}", std::process::id()));
        std::fs::write(&out, data).unwrap();
        panic!(
            "{what}: the parser panicked; input saved to {}",
            out.display()
        );
    }
}

fn seeds() -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(corpus_dir())
        .expect("fuzz/corpus/luks_header must exist")
        .map(|e| e.unwrap().path())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn committed_corpus_replays_without_panic() {
    let seeds = seeds();
    assert!(
        seeds.len() >= 5,
        "seed corpus unexpectedly small: {}",
        seeds.len()
    );
    let file = tempfile::tempfile().unwrap();
    for (name, data) in &seeds {
        check(&file, data, name);
    }
    // The valid seeds must actually parse, or the mutation loop below only tests rejection.
    for valid in [
        "luks1_compatimage_4k",
        "luks2_valid_32k",
        "luks2_primary_magic_gone",
    ] {
        let data = &seeds.iter().find(|(n, _)| n == valid).expect(valid).1;
        file.set_len(0).unwrap();
        file.write_all_at(data, 0).unwrap();
        LuksImage::read(&file).unwrap_or_else(|e| panic!("{valid} should parse: {e}"));
    }
    // cryptsetup's reencryption headers (after --init-only, and with a hotzone a SIGKILL
    // interrupted) parse with their reencryption state, so mutations of them reach it.
    for (valid, hot) in [
        ("luks2_reencrypt_init_only_32k", false),
        ("luks2_reencrypt_hotzone_32k", true),
    ] {
        let data = &seeds.iter().find(|(n, _)| n == valid).expect(valid).1;
        file.set_len(0).unwrap();
        file.write_all_at(data, 0).unwrap();
        let Ok((LuksImage::V2(h), _)) = LuksImage::read(&file) else {
            panic!("{valid} should parse as LUKS2");
        };
        let state = h.reencrypt_state().unwrap().expect(valid);
        assert_eq!(state.hot_segment.is_some(), hot, "{valid}");
        assert!(h.read_only_reason().is_some());
    }
}

const LUKS2_COPY: usize = 0x4000;
const LUKS2_CSUM_OFF: usize = 448;

/// Mutate the JSON of both LUKS2 copies identically and re-seal their checksums, so the
/// mutation reaches the JSON parser and validator instead of stopping at the checksum.
fn mutate_luks2_json(rng: &mut StdRng, base: &[u8]) -> Vec<u8> {
    let mut d = base.to_vec();
    let json_end = 4096
        + d[4096..LUKS2_COPY]
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(0);
    for _ in 0..rng.gen_range(1..4) {
        let i = rng.gen_range(4096..json_end.max(4097));
        let c = [
            b'9', b'0', b'-', b'"', b'{', b'}', b'[', b',', b'e', b'x', 0,
        ][rng.gen_range(0..11)];
        d[i] = c;
        d[LUKS2_COPY + i] = c;
    }
    for copy in [0, LUKS2_COPY] {
        let area = &d[copy..copy + LUKS2_COPY];
        let csum =
            cryptblk_luks::luks2::binary::compute_checksum(cryptblk_luks::HashAlg::Sha256, area)
                .unwrap();
        d[copy + LUKS2_CSUM_OFF..copy + LUKS2_CSUM_OFF + csum.len()].copy_from_slice(&csum);
    }
    d
}

fn mutate(rng: &mut StdRng, base: &[u8]) -> Vec<u8> {
    if base.len() >= 2 * LUKS2_COPY && rng.gen_bool(0.5) {
        return mutate_luks2_json(rng, base);
    }
    let mut d = base.to_vec();
    match rng.gen_range(0..5) {
        0 => {
            for _ in 0..rng.gen_range(1..8) {
                let i = rng.gen_range(0..d.len());
                d[i] ^= 1 << rng.gen_range(0..8);
            }
        }
        1 => d.truncate(rng.gen_range(0..d.len())),
        2 => {
            // Extreme integers at an aligned spot: sizes, offsets, counts.
            let i = rng.gen_range(0..d.len().saturating_sub(8).max(1)) & !3;
            let v: [u8; 8] = match rng.gen_range(0..4) {
                0 => [0xff; 8],
                1 => [0; 8],
                2 => [0x7f, 0xff, 0xff, 0xff, 0, 0, 0, 1],
                _ => rng.gen(),
            };
            let n = (d.len() - i).min(8);
            d[i..i + n].copy_from_slice(&v[..n]);
        }
        3 => {
            // Digits in the JSON area turn into huge or malformed numbers.
            let i = rng.gen_range(0..d.len());
            let c = [b'9', b'0', b'-', b'"', b'{', b'e'][rng.gen_range(0..6)];
            d[i] = c;
        }
        _ => {
            let i = rng.gen_range(0..d.len());
            let j = rng.gen_range(i..d.len().min(i + 64) + 1);
            d[i..j].fill(rng.gen());
        }
    }
    d
}

#[test]
fn deterministic_mutations_do_not_panic() {
    let seeds = seeds();
    let bases: Vec<&Vec<u8>> = [
        "luks1_compatimage_4k",
        "luks1_v10_phdr_only",
        "luks2_valid_32k",
        "luks2_reencrypt_init_only_32k",
        "luks2_reencrypt_hotzone_32k",
    ]
    .iter()
    .map(|n| &seeds.iter().find(|(s, _)| s == n).expect(n).1)
    .collect();
    let file = tempfile::tempfile().unwrap();
    let mut rng = StdRng::seed_from_u64(0x1u64 << 40 | 0x5eed);
    let start = Instant::now();
    let mut runs = 0;
    while runs < 10_000 && start.elapsed() < Duration::from_secs(15) {
        let base = bases[runs % bases.len()];
        let data = mutate(&mut rng, base);
        check(&file, &data, &format!("mutation {runs}"));
        runs += 1;
    }
    assert!(runs >= 1000, "only {runs} mutations ran in the time budget");
}

#[test]
fn resealed_luks2_seed_still_parses() {
    // Re-sealing with no change must give a valid header, or the JSON mutations above would
    // all be rejected by the checksum and test nothing.
    let seeds = seeds();
    let base = &seeds
        .iter()
        .find(|(s, _)| s == "luks2_valid_32k")
        .unwrap()
        .1;
    let mut d = base.clone();
    d[LUKS2_CSUM_OFF] ^= 0xff;
    d[LUKS2_COPY + LUKS2_CSUM_OFF] ^= 0xff;
    for copy in [0, LUKS2_COPY] {
        let csum = cryptblk_luks::luks2::binary::compute_checksum(
            cryptblk_luks::HashAlg::Sha256,
            &d[copy..copy + LUKS2_COPY],
        )
        .unwrap();
        d[copy + LUKS2_CSUM_OFF..copy + LUKS2_CSUM_OFF + csum.len()].copy_from_slice(&csum);
    }
    let file = tempfile::tempfile().unwrap();
    file.write_all_at(&d, 0).unwrap();
    let (_, warnings) = LuksImage::read(&file).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
}
