//! Arbitrary bytes as a LUKS2 header's clevis token (untrusted JSON): parsing it, with the
//! key checks the recovery runs before it contacts a server, must answer an error, never
//! panic. The committed seeds are tokens `clevis luks bind` wrote; the stable replay is
//! `crates/clevis/tests/fuzz_corpus_replay.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = cryptblk_clevis::parse_token("0", &value);
    }
});
