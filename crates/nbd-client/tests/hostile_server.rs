//! The client against server byte streams built by hand: a valid session works; the same
//! session damaged in 4,000 seeded ways (bytes flipped, cut, repeated, lengths made huge)
//! gives errors, never a panic. The same inputs seed the `nbd_client` fuzz target
//! (fuzz/corpus/nbd_client/; `CRYPTBLK_WRITE_SEEDS=1` rewrites it).
use cryptblk_nbd_client::{Client, Error, Extent, BASE_ALLOCATION};
use std::io::{Cursor, Read, Write};

const BITMAP: &str = "qemu:dirty-bitmap:c0";
const SIZE: u64 = 1 << 20;

struct Server(Cursor<Vec<u8>>);

impl Read for Server {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Server {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Default)]
struct Bytes(Vec<u8>);

impl Bytes {
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn option_reply(&mut self, option: u32, kind: u32, payload: &[u8]) -> &mut Self {
        self.u64(0x0003_e889_0455_65a9)
            .u32(option)
            .u32(kind)
            .u32(payload.len() as u32)
            .raw(payload)
    }
    fn chunk(&mut self, flags: u16, kind: u16, cookie: u64, payload: &[u8]) -> &mut Self {
        self.u32(0x668e_33ef)
            .u16(flags)
            .u16(kind)
            .u64(cookie)
            .u32(payload.len() as u32)
            .raw(payload)
    }
}

/// What QEMU sends for: handshake with both contexts, one block status (cookie 1), one
/// 8 KiB read at 0 (cookie 2: 4 KiB of data, then a 4 KiB hole).
fn valid_session() -> Vec<u8> {
    session(None)
}

/// [`valid_session`], the export's GO answer with NBD_INFO_DESCRIPTION `description` too.
fn session(description: Option<&[u8]>) -> Vec<u8> {
    let mut b = handshake(description);
    let mut status = Bytes::default();
    status
        .u32(1)
        .u32(4096)
        .u32(0)
        .u32((SIZE - 4096) as u32)
        .u32(3);
    b.chunk(1, 5, 1, &status.0);
    let mut data = Bytes::default();
    data.u64(0).raw(&[0xab; 4096]);
    b.chunk(0, 1, 2, &data.0);
    let mut hole = Bytes::default();
    hole.u64(4096).u32(4096);
    b.chunk(1, 2, 2, &hole.0);
    b.0
}

/// The server's side of the handshake, up to the export's GO answer.
fn handshake(description: Option<&[u8]>) -> Bytes {
    let mut b = Bytes::default();
    b.u64(0x4e42_444d_4147_4943)
        .u64(0x4948_4156_454f_5054)
        .u16(3);
    b.option_reply(8, 1, &[]);
    for (id, name) in [(1u32, BASE_ALLOCATION), (2, BITMAP)] {
        let mut p = id.to_be_bytes().to_vec();
        p.extend_from_slice(name.as_bytes());
        b.option_reply(10, 4, &p);
    }
    b.option_reply(10, 1, &[]);
    let mut info = Bytes::default();
    info.u16(0).u64(SIZE).u16(1 | 2);
    b.option_reply(7, 3, &info.0);
    if let Some(description) = description {
        let mut info = Bytes::default();
        info.u16(2).raw(description);
        b.option_reply(7, 3, &info.0);
    }
    b.option_reply(7, 1, &[]);
    b
}

/// The session the fuzz target runs too (contexts, then block status and reads).
fn run(input: Vec<u8>) -> Result<(Vec<Extent>, Vec<u8>), Error> {
    let mut client = Client::handshake(
        Server(Cursor::new(input)),
        "disk",
        &[BASE_ALLOCATION, BITMAP],
    )?;
    let size = client.info().size;
    let mut extents = Vec::new();
    let length = size.min(u64::from(u32::MAX)) as u32;
    client.block_status(BASE_ALLOCATION, 0, length, &mut extents)?;
    let described: u64 = extents.iter().map(|e| e.length).sum();
    assert!(described <= u64::from(length));
    let mut buf = vec![0x11u8; size.min(8192) as usize];
    client.read(0, &mut buf)?;
    Ok((extents, buf))
}

#[test]
fn the_export_description_is_what_the_server_sent_or_none() {
    let handshake = |input| {
        Client::handshake(
            Server(Cursor::new(input)),
            "disk",
            &[BASE_ALLOCATION, BITMAP],
        )
        .unwrap()
    };
    let described = handshake(session(Some(b"backup 0f3c of disk vol")));
    assert_eq!(described.description(), Some("backup 0f3c of disk vol"));
    assert_eq!(described.info().size, SIZE);
    assert_eq!(handshake(valid_session()).description(), None);
    // Not UTF-8, as the spec wants it: kept (lossily) rather than refused.
    let odd = handshake(session(Some(b"disk \xff")));
    assert_eq!(odd.description(), Some("disk \u{fffd}"));
}

#[test]
fn a_valid_session_reads_extents_data_and_holes() {
    let (extents, buf) = run(valid_session()).unwrap();
    assert_eq!(
        extents,
        [
            Extent {
                length: 4096,
                flags: 0
            },
            Extent {
                length: SIZE - 4096,
                flags: 3
            }
        ]
    );
    assert!(buf[..4096].iter().all(|&b| b == 0xab));
    assert!(buf[4096..].iter().all(|&b| b == 0));
    if std::env::var_os("CRYPTBLK_WRITE_SEEDS").is_some() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus/nbd_client");
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(format!("{dir}/valid_session"), valid_session()).unwrap();
    }
}

/// xorshift64*: reproducible mutations without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn a_damaged_session_is_an_error_never_a_panic() {
    let valid = valid_session();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut failures = 0;
    for _ in 0..4000 {
        let mut input = valid.clone();
        for _ in 0..1 + rng.below(3) {
            let at = rng.below(input.len());
            match rng.below(5) {
                0 => input[at] ^= 1 << rng.below(8),
                1 => input.truncate(at),
                2 => {
                    let end = (at + rng.below(64)).min(input.len());
                    let copy = input[at..end].to_vec();
                    input.splice(at..at, copy);
                }
                // A length or size field made huge (any 4 bytes set to 0xff..).
                3 => {
                    let end = (at + 4).min(input.len());
                    input[at..end].fill(0xff);
                }
                _ => input[at] = rng.next() as u8,
            }
        }
        if run(input).is_err() {
            failures += 1;
        }
    }
    // Most damage is noticed (some flips only change data bytes or flags).
    assert!(
        failures > 2000,
        "only {failures} of 4000 damaged sessions failed"
    );
}

#[test]
fn hostile_lengths_and_ranges_are_refused_by_name() {
    let valid = valid_session();
    // The first option reply claims 4 GiB.
    let mut huge = valid.clone();
    huge[18 + 16..18 + 20].copy_from_slice(&u32::MAX.to_be_bytes());
    let err = run(huge).unwrap_err().to_string();
    assert!(err.contains("at most 65536"), "{err}");
    // The data chunk claims offset 1 MiB: outside the 8 KiB read.
    let at = valid.len() - (20 + 12) - (20 + 8 + 4096) + 20;
    let mut outside = valid.clone();
    outside[at..at + 8].copy_from_slice(&SIZE.to_be_bytes());
    let err = run(outside).unwrap_err().to_string();
    assert!(err.contains("outside the request"), "{err}");
    // The hole chunk overlaps the data chunk.
    let hole_at = valid.len() - 12;
    let mut overlap = valid.clone();
    overlap[hole_at..hole_at + 8].copy_from_slice(&0u64.to_be_bytes());
    let err = run(overlap).unwrap_err().to_string();
    assert!(err.contains("overlapping"), "{err}");
    // A server that does not offer the bitmap.
    let mut b = Bytes::default();
    b.u64(0x4e42_444d_4147_4943)
        .u64(0x4948_4156_454f_5054)
        .u16(1);
    b.option_reply(8, 1, &[]);
    b.option_reply(10, 1, &[]);
    let err = Client::handshake(Server(Cursor::new(b.0)), "disk", &[BITMAP])
        .err()
        .unwrap();
    assert!(
        matches!(err, Error::NoContext(ref c) if c == BITMAP),
        "{err}"
    );
}

/// A data chunk of `len` bytes of `byte` at `offset`, for request `cookie`.
fn data(b: &mut Bytes, done: bool, cookie: u64, offset: u64, byte: u8, len: usize) {
    let mut payload = Bytes::default();
    payload.u64(offset).raw(&vec![byte; len]);
    b.chunk(u16::from(done), 1, cookie, &payload.0);
}

/// Three 4 KiB reads in flight at 0, 4 KiB and 8 KiB (cookies 1-3), answered by `replies`.
fn three_reads(replies: &Bytes) -> Client<Server> {
    let mut input = handshake(None);
    input.raw(&replies.0);
    let mut client = Client::handshake(
        Server(Cursor::new(input.0)),
        "disk",
        &[BASE_ALLOCATION, BITMAP],
    )
    .unwrap();
    for offset in [0, 4096, 8192] {
        client.send_read(offset, vec![0x11; 4096], 4096).unwrap();
    }
    assert_eq!(client.reads_in_flight(), 3);
    client
}

#[test]
fn reads_in_flight_come_back_in_the_order_sent_whatever_order_the_replies_take() {
    // The third answered first, the first in two chunks around the second.
    let mut replies = Bytes::default();
    data(&mut replies, true, 3, 8192, 0x33, 4096);
    data(&mut replies, false, 1, 0, 0x01, 2048);
    data(&mut replies, true, 2, 4096, 0x22, 4096);
    data(&mut replies, true, 1, 2048, 0x02, 2048);
    let mut client = three_reads(&replies);
    let mut got = Vec::new();
    while let Some(read) = client.receive_read().unwrap() {
        got.push((read.offset, read.len, read.buf));
    }
    assert_eq!(got.len(), 3);
    assert_eq!((got[0].0, got[0].1), (0, 4096));
    assert!(got[0].2[..2048].iter().all(|&b| b == 0x01));
    assert!(got[0].2[2048..].iter().all(|&b| b == 0x02));
    assert_eq!(got[1].0, 4096);
    assert!(got[1].2.iter().all(|&b| b == 0x22));
    assert_eq!(got[2].0, 8192);
    assert!(got[2].2.iter().all(|&b| b == 0x33));
    assert_eq!(client.reads_in_flight(), 0);
}

#[test]
fn a_failed_read_in_flight_fails_alone_and_a_stray_reply_breaks_the_connection() {
    // The second read fails with EIO (an error chunk); the others succeed.
    let mut replies = Bytes::default();
    data(&mut replies, true, 1, 0, 0x01, 4096);
    let mut error = Bytes::default();
    error.u32(5).u16(4).raw(b"disk");
    replies.chunk(1, (1 << 15) | 1, 2, &error.0);
    data(&mut replies, true, 3, 8192, 0x03, 4096);
    let mut client = three_reads(&replies);
    assert_eq!(client.receive_read().unwrap().unwrap().offset, 0);
    let err = client.receive_read().unwrap_err();
    assert!(
        matches!(
            err,
            Error::Command {
                command: "read",
                offset: 4096,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(client.receive_read().unwrap().unwrap().offset, 8192);

    // A reply naming a request that was never sent.
    let mut stray = Bytes::default();
    data(&mut stray, true, 9, 0, 0x09, 4096);
    let mut client = three_reads(&stray);
    let err = client.receive_read().unwrap_err().to_string();
    assert!(err.contains("request 9, which is not waiting"), "{err}");
    let err = client.receive_read().unwrap_err().to_string();
    assert!(err.contains("unusable"), "{err}");
}

#[test]
fn reads_in_flight_are_bounded_and_other_requests_wait_for_none() {
    let mut client = three_reads(&Bytes::default());
    let mut extents = Vec::new();
    let err = client
        .block_status(BASE_ALLOCATION, 0, 4096, &mut extents)
        .unwrap_err()
        .to_string();
    assert!(err.contains("while 3 reads wait"), "{err}");
    let err = client.read(0, &mut [0u8; 512]).unwrap_err().to_string();
    assert!(err.contains("3 others wait"), "{err}");
    let err = client
        .send_read(0, vec![0; 512], 4096)
        .unwrap_err()
        .to_string();
    assert!(err.contains("into a buffer of 512"), "{err}");
    for i in 3..cryptblk_nbd_client::MAX_READS_IN_FLIGHT as u64 {
        client.send_read(i * 4096, vec![0; 4096], 4096).unwrap();
    }
    let err = client
        .send_read(0, vec![0; 4096], 4096)
        .unwrap_err()
        .to_string();
    assert!(err.contains("reads in flight"), "{err}");
}
