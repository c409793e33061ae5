//! Arbitrary bytes as a LUKS image (and as a detached LUKS2 header): reading and describing
//! the header must never panic, hang or allocate without bound, whatever the file holds.
#![no_main]

use cryptblk_luks::LuksImage;
use libfuzzer_sys::fuzz_target;
use std::io::Write;

fuzz_target!(|data: &[u8]| {
    let Ok(mut file) = tempfile::tempfile() else {
        return;
    };
    if file.write_all(data).is_err() {
        return;
    }
    let _ = LuksImage::probe(&file);
    if let Ok((image, _warnings)) = LuksImage::read(&file) {
        let _ = image.dump_json();
        let _ = image.dump_text();
        let _ = image.data_size(data.len() as u64);
        let _ = image.cipher_spec();
        let _ = image.active_keyslots();
        let _ = image.read_only_reason();
        if let LuksImage::V2(h) = &image {
            // Reencryption metadata: keyslot, backup and live segments, extents.
            let _ = h.reencrypt_state();
            let _ = h.reencrypt_extents(data.len() as u64);
        }
    }
    // The same bytes as a detached header (`reencrypt --decrypt --header FILE`), whose
    // segments may start at offset 0 of another device.
    if let Ok((h, _warnings)) = cryptblk_luks::luks2::Luks2Header::read_detached(&file) {
        let _ = h.reencrypt_state();
        let _ = h.reencrypt_extents(data.len() as u64);
    }
});
