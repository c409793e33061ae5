//! Replays the `migration_stream` fuzz corpus (fuzz/corpus/migration_stream) through the frame
//! parsers on stable Rust, so every input the fuzzer found interesting stays covered in CI.

use cryptblk_migration::wire;
use std::path::Path;

#[test]
fn fuzz_corpus_parses_without_panicking() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/migration_stream");
    let mut inputs = 0;
    let mut frames = 0;
    for entry in std::fs::read_dir(&dir).expect("fuzz/corpus/migration_stream must exist") {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        inputs += 1;
        let mut rest = &data[..];
        while let Ok((frame, used)) = wire::decode(rest) {
            let again = frame.encode();
            assert_eq!(wire::decode(&again).unwrap().0, frame);
            rest = &rest[used..];
            frames += 1;
        }
        let mut stream = std::io::Cursor::new(&data);
        while wire::read_frame(&mut stream).is_ok() {}
    }
    assert!(inputs >= 4, "the seed corpus is missing");
    assert!(
        frames > 0,
        "no input held a valid frame: the seeds are broken"
    );
}
