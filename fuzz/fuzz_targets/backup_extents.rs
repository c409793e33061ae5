//! Arbitrary bytes as a backup chain entry's extents file (a backup store is not trusted):
//! the reader returns records that are sorted, disjoint and inside the disk, or an error,
//! never a panic.
#![no_main]

use cryptblk_backup::extents::Reader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (size, bytes) = match data.split_first_chunk::<8>() {
        Some((size, rest)) => (u64::from_be_bytes(*size), rest),
        None => return,
    };
    let Ok(mut reader) = Reader::new(bytes, size) else {
        return;
    };
    let mut next_free = 0u64;
    while let Ok(Some(r)) = reader.next_record() {
        assert!(r.length > 0 && r.offset >= next_free);
        next_free = r.offset.checked_add(r.length).expect("inside the disk");
        assert!(next_free <= size);
    }
});
