use super::*;
use cryptblk_volume::checkpoint::{CarriedCheckpoint, CarriedCheckpoints};
use rand::{Rng, SeedableRng};

fn carried() -> CarriedCheckpoints {
    CarriedCheckpoints {
        granularity: 64 << 10,
        covered: 1 << 30,
        checkpoints: vec![
            CarriedCheckpoint {
                name: "c0".into(),
                created: 1_700_000_000,
                runs: vec![(0, 1), (7, 3), (16383, 1)],
            },
            CarriedCheckpoint {
                name: "nightly.2".into(),
                created: 1_700_000_100,
                runs: Vec::new(),
            },
        ],
    }
}

fn samples() -> Vec<Frame> {
    vec![
        Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            disk_size_bytes: 1 << 30,
            granularity: 4096,
            header_len: 16 << 20,
            role: Role::Urgent,
            flags: FLAG_POSTCOPY | FLAG_PREEMPT,
            session: [9; SESSION_ID_LEN],
        }),
        Frame::chunk(4096, vec![7u8; 1000]),
        Frame::Request {
            offset: 8192,
            len: 4096,
        },
        Frame::Missing {
            offset: 1 << 20,
            len: 1 << 16,
        },
        Frame::Postcopy,
        Frame::MissingEnd,
        Frame::SharedImage {
            identity: "fsid/3/10ab".into(),
        },
        Frame::Zero {
            offset: 0,
            len: 1 << 20,
        },
        Frame::PassDone {
            pass: 3,
            dirty_left: 12345,
        },
        Frame::Complete,
        Frame::Error {
            message: "disk full".into(),
        },
        Frame::Checkpoints(carried()),
        Frame::Ready,
    ]
}

#[test]
fn round_trip() {
    for f in samples() {
        let bytes = f.encode();
        let (g, used) = decode(&bytes).unwrap();
        assert_eq!(g, f);
        assert_eq!(used, bytes.len());
        let mut cur = std::io::Cursor::new(&bytes);
        assert_eq!(read_frame(&mut cur).unwrap(), f);
    }
    let mut v = Vec::new();
    write_chunk(&mut v, 99, b"abc").unwrap();
    assert_eq!(decode(&v).unwrap().0, Frame::chunk(99, b"abc".to_vec()));
}

#[test]
fn an_old_hello_is_read_as_far_as_its_version() {
    let mut v1 = Vec::new();
    push_header(&mut v1, KIND_HELLO, HELLO_V1_LEN);
    v1.extend_from_slice(&1u32.to_le_bytes());
    v1.extend_from_slice(&[0u8; HELLO_V1_LEN - 4]);
    match decode(&v1).unwrap().0 {
        Frame::Hello(h) => assert_eq!(h.version, 1),
        other => panic!("{other:?}"),
    }
    // The current version must carry the whole Hello.
    let mut short = Vec::new();
    push_header(&mut short, KIND_HELLO, HELLO_V1_LEN);
    short.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    short.extend_from_slice(&[0u8; HELLO_V1_LEN - 4]);
    assert!(matches!(decode(&short), Err(WireError::BadLength { .. })));
}

#[test]
fn corruption_is_caught() {
    let bytes = Frame::chunk(8192, vec![1u8; 512]).encode();
    // Flip every bit of the offset, checksum and data in turn: all must be refused.
    for i in HEADER_LEN..bytes.len() {
        for bit in 0..8 {
            let mut b = bytes.clone();
            b[i] ^= 1 << bit;
            assert!(decode(&b).is_err(), "flip at byte {i} bit {bit} accepted");
        }
    }
}

#[test]
fn oversized_and_unknown_headers_are_refused_before_allocation() {
    let mut h = Vec::new();
    push_header(&mut h, KIND_CHUNK, CHUNK_PREFIX + MAX_CHUNK_LEN + 1);
    assert!(matches!(parse_header(&h), Err(WireError::BadLength { .. })));
    let mut h = Vec::new();
    push_header(&mut h, 99, 0);
    assert!(matches!(parse_header(&h), Err(WireError::UnknownKind(99))));
    // Ready says nothing but that it came.
    let mut h = Vec::new();
    push_header(&mut h, KIND_READY, 1);
    assert!(matches!(
        parse_header(&h),
        Err(WireError::BadLength {
            kind: KIND_READY,
            ..
        })
    ));
    assert!(matches!(
        parse_header(b"XXXX\x01\0\0\0\0\0\0\0"),
        Err(WireError::BadMagic(_))
    ));
    assert!(matches!(
        parse_header(b"CBMG"),
        Err(WireError::Truncated { .. })
    ));
}

#[test]
fn hostile_checkpoints_are_refused_with_what_is_wrong() {
    let good = Frame::Checkpoints(carried()).encode();
    let at = HEADER_LEN;
    let refused = |bytes: &[u8], needle: &str| {
        let e = decode(bytes).unwrap_err();
        assert!(
            e.to_string().contains(needle),
            "{e} does not say {needle:?}"
        );
    };
    let mut b = good.clone();
    b[at] = 2;
    refused(&b, "version 2");
    let mut b = good.clone();
    b[at + 1] = 33;
    refused(&b, "more than 32");
    let mut b = good.clone();
    b[at + 1] = 3;
    refused(&b, "cut short");
    let mut b = good.clone();
    b[at + 2] = 1;
    refused(&b, "reserved");
    // The first checkpoint's run count (after its created time) far too large.
    let mut b = good.clone();
    b[at + 16 + 8..at + 16 + 12].copy_from_slice(&u32::MAX.to_le_bytes());
    refused(&b, "runs, more than");
    // One run too many: the payload ends inside it.
    let mut b = good.clone();
    b[at + 16 + 8] = 4;
    refused(&b, "cut short");
    // A byte past the last checkpoint.
    let mut b = good.clone();
    b.push(0);
    let len = (b.len() - HEADER_LEN) as u32;
    b[8..12].copy_from_slice(&len.to_le_bytes());
    refused(&b, "after the last checkpoint");
    // What the checkpoints say, checked too: runs out of order, a bad name, a granularity.
    let mut c = carried();
    c.checkpoints[0].runs = vec![(7, 3), (0, 1)];
    refused(&Frame::Checkpoints(c).encode(), "out of order");
    let mut c = carried();
    c.checkpoints[1].name = "../x".into();
    refused(&Frame::Checkpoints(c).encode(), "name");
    let mut c = carried();
    c.granularity = 100;
    refused(&Frame::Checkpoints(c).encode(), "granularity");
    let mut c = carried();
    c.checkpoints[0].runs = vec![(16383, 2)];
    refused(&Frame::Checkpoints(c).encode(), "past the 16384 regions");
    // A header claiming more than the largest store is refused before any allocation.
    let mut h = Vec::new();
    push_header(&mut h, KIND_CHECKPOINTS, checkpoints::MAX_LEN + 1);
    assert!(matches!(parse_header(&h), Err(WireError::BadLength { .. })));
}

/// 10 000 random and mutated frames: the parser must return (Ok or Err), never panic, and
/// anything it accepts must re-encode to exactly the bytes it consumed.
#[test]
fn fuzz_random_and_mutated_frames() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6d69_6772);
    let seeds: Vec<Vec<u8>> = samples().iter().map(Frame::encode).collect();
    let mut accepted = 0;
    for i in 0..10_000 {
        let buf: Vec<u8> = if i % 4 == 0 {
            let n = rng.gen_range(0..200);
            (0..n).map(|_| rng.gen()).collect()
        } else {
            let mut b = seeds[rng.gen_range(0..seeds.len())].clone();
            for _ in 0..rng.gen_range(1..4) {
                match rng.gen_range(0..4) {
                    0 if !b.is_empty() => {
                        let j = rng.gen_range(0..b.len());
                        b[j] = rng.gen();
                    }
                    1 if !b.is_empty() => {
                        let n = rng.gen_range(0..b.len());
                        b.truncate(n);
                    }
                    2 => {
                        let extra: Vec<u8> = (0..rng.gen_range(1..16)).map(|_| rng.gen()).collect();
                        b.extend(extra);
                    }
                    _ if b.len() >= HEADER_LEN => {
                        // Random length field: the classic way to make a parser over-read.
                        let len: u32 = rng.gen();
                        b[8..12].copy_from_slice(&len.to_le_bytes());
                    }
                    _ => {}
                }
            }
            b
        };
        if let Ok((frame, used)) = decode(&buf) {
            accepted += 1;
            // A Hello of another version may carry appended fields we do not re-encode.
            if !matches!(frame, Frame::Hello(h) if h.version != PROTOCOL_VERSION) {
                assert_eq!(frame.encode(), buf[..used], "non-canonical accept");
            }
        }
        let _ = read_frame(&mut std::io::Cursor::new(&buf));
    }
    // Mutations that only touch trailing bytes or a tolerated field must still decode.
    assert!(accepted > 0);
}
