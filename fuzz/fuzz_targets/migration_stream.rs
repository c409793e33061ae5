//! Arbitrary bytes as a migration stream: the frame parsers must return (a frame or an error),
//! never panic or allocate beyond a frame's cap, whatever a peer sends.
#![no_main]

use cryptblk_migration::wire;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok((frame, used)) = wire::decode(rest) {
        // What was accepted re-encodes to a frame that decodes the same.
        let again = frame.encode();
        assert_eq!(wire::decode(&again).map(|(f, _)| f).ok(), Some(frame));
        rest = &rest[used..];
    }
    let mut stream = std::io::Cursor::new(data);
    while wire::read_frame(&mut stream).is_ok() {}
});
