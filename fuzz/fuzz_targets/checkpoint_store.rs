//! Arbitrary bytes as each file of a disk's checkpoint store (the index, a bitmap header, a
//! bitmap block): parsed into something that encodes back to the same bytes, or refused,
//! never a panic. The files lie beside the image, where others may change them.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cryptblk_volume::checkpoint::parse_any(data);
});
