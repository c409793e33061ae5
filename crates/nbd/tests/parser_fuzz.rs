//! The wire parsers must survive arbitrary bytes: 10k random and mutated inputs each.
use cryptblk_nbd::protocol::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Valid encodings to mutate, so the parsers' deeper branches are reached.
fn seeds() -> Vec<Vec<u8>> {
    let request = encode_request_header(&RequestHeader {
        flags: CMD_FLAG_FUA,
        command: CMD_WRITE,
        cookie: 9,
        offset: 4096,
        length: 512,
    })
    .to_vec();
    let mut option = Vec::new();
    option.extend_from_slice(&IHAVEOPT.to_be_bytes());
    option.extend_from_slice(&OPT_GO.to_be_bytes());
    option.extend_from_slice(&9u32.to_be_bytes());
    let mut info = Vec::new();
    info.extend_from_slice(&4u32.to_be_bytes());
    info.extend_from_slice(b"disk");
    info.extend_from_slice(&1u16.to_be_bytes());
    info.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    let mut meta = Vec::new();
    meta.extend_from_slice(&4u32.to_be_bytes());
    meta.extend_from_slice(b"disk");
    meta.extend_from_slice(&1u32.to_be_bytes());
    meta.extend_from_slice(&15u32.to_be_bytes());
    meta.extend_from_slice(b"base:allocation");
    vec![request, option, info, meta]
}

fn mutate(rng: &mut StdRng, seed: &[u8]) -> Vec<u8> {
    let mut data = seed.to_vec();
    for _ in 0..rng.gen_range(1..6) {
        match rng.gen_range(0..4) {
            0 if !data.is_empty() => {
                let at = rng.gen_range(0..data.len());
                data[at] = rng.gen();
            }
            1 if !data.is_empty() => {
                let at = rng.gen_range(0..data.len());
                data.truncate(at);
            }
            2 => data.extend((0..rng.gen_range(1..8)).map(|_| rng.gen::<u8>())),
            _ if data.len() >= 4 => {
                // Extreme length fields are the classic parser killer.
                let at = rng.gen_range(0..data.len() - 3);
                let value: u32 = [0, 1, u32::MAX, u32::MAX / 2, 4096, 4097][rng.gen_range(0..6)];
                data[at..at + 4].copy_from_slice(&value.to_be_bytes());
            }
            _ => {}
        }
    }
    data
}

#[test]
fn parsers_never_panic_on_random_or_mutated_input() {
    let mut rng = StdRng::seed_from_u64(0x6e62_6466);
    let seeds = seeds();
    for i in 0..10_000 {
        let input = if i % 2 == 0 {
            let len = rng.gen_range(0..64);
            (0..len).map(|_| rng.gen::<u8>()).collect::<Vec<u8>>()
        } else {
            mutate(&mut rng, &seeds[i % seeds.len()])
        };
        let _ = parse_request_header(&input);
        let _ = parse_option_header(&input);
        let _ = parse_info_request(&input);
        let _ = parse_meta_context_request(&input);
        if input.len() >= REQUEST_HEADER_LEN {
            let _ = parse_request_header(&input[..REQUEST_HEADER_LEN]);
        }
        if input.len() >= OPTION_HEADER_LEN {
            let _ = parse_option_header(&input[..OPTION_HEADER_LEN]);
        }
    }
}

#[test]
fn mutated_valid_inputs_still_parse_when_untouched() {
    let seeds = seeds();
    assert!(parse_request_header(&seeds[0]).is_ok());
    assert!(parse_option_header(&seeds[1]).is_ok());
    assert!(parse_info_request(&seeds[2]).is_some());
    assert!(parse_meta_context_request(&seeds[3]).is_some());
}
