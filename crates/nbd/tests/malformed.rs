//! Hostile or broken clients speaking raw bytes: the server answers with the right error or
//! closes the connection, and never writes a partial request.
mod common;

use common::{export, luks2_volume, pattern, raw_file, TestServer};
use cryptblk_block::{BlockDevice, IoStats};
use cryptblk_nbd::protocol::*;
use cryptblk_nbd::ExportRegistry;
use cryptblk_testutil::nbd::RawClient;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SIZE: u64 = 4 << 20;
const EINVAL: u32 = NbdErrno::Inval as u32;
const ENOSPC: u32 = NbdErrno::NoSpc as u32;
const EPERM: u32 = NbdErrno::Perm as u32;

// Fields drop in order: the server must stop before its directory goes.
struct Fixture {
    server: TestServer,
    raw: Arc<dyn BlockDevice>,
    raw_stats: Arc<IoStats>,
    _dir: tempfile::TempDir,
}

/// Exports "raw" (512-byte blocks, patterned), "luks" (4096-byte blocks), "ro" (read-only)
/// and "rel" (read-only, its TRIM a release, patterned).
fn fixture_with(io_timeout: Duration) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    let raw: Arc<dyn BlockDevice> = raw_file(&dir.path().join("a.raw"), SIZE, SIZE as usize);
    let raw_export = export("raw", Arc::clone(&raw));
    let raw_stats = Arc::clone(&raw_export.stats);
    registry.add(raw_export).unwrap();
    registry
        .add(export(
            "luks",
            luks2_volume(&dir.path().join("b.luks"), SIZE, 4096),
        ))
        .unwrap();
    let mut read_only = export("ro", raw_file(&dir.path().join("c.raw"), SIZE, 0));
    read_only.read_only = true;
    registry.add(read_only).unwrap();
    let mut releasing = export(
        "rel",
        raw_file(&dir.path().join("d.raw"), SIZE, SIZE as usize),
    );
    releasing.read_only = true;
    releasing.trim_releases = true;
    registry.add(releasing).unwrap();
    let server = TestServer::unix_with(dir.path(), registry, |server| {
        server.with_io_timeout(io_timeout)
    });
    Fixture {
        _dir: dir,
        raw,
        raw_stats,
        server,
    }
}

fn fixture() -> Fixture {
    fixture_with(Duration::from_secs(30))
}

#[test]
fn bad_client_flags_close_the_connection() {
    let f = fixture();
    for flags in [0, CLIENT_FLAG_FIXED_NEWSTYLE | 1 << 7, u32::MAX] {
        let mut client = RawClient::connect(f.server.socket_path());
        client.send_flags(flags);
        assert!(client.is_closed_by_server(), "flags {flags:#x}");
    }
}

#[test]
fn bad_option_magic_and_oversized_options_close_the_connection() {
    let f = fixture();
    let mut client = RawClient::connect(f.server.socket_path());
    client.send_flags(CLIENT_FLAG_FIXED_NEWSTYLE);
    client.stream.write_all(&[0x55; 16]).unwrap();
    assert!(client.is_closed_by_server());

    let mut client = RawClient::connect(f.server.socket_path());
    client.send_flags(CLIENT_FLAG_FIXED_NEWSTYLE);
    let mut header = Vec::new();
    header.extend_from_slice(&IHAVEOPT.to_be_bytes());
    header.extend_from_slice(&OPT_GO.to_be_bytes());
    header.extend_from_slice(&(16u32 << 20).to_be_bytes());
    client.stream.write_all(&header).unwrap();
    // Closed without the server waiting for 16 MiB of option data.
    assert!(client.is_closed_by_server());
}

#[test]
fn unknown_and_malformed_options_get_error_replies() {
    let f = fixture();
    let mut client = RawClient::connect(f.server.socket_path());
    client.send_flags(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES);

    client.send_option(99, b"whatever");
    assert_eq!(client.read_option_reply(), (99, REP_ERR_UNSUP, vec![]));
    // Extended headers are not implemented either.
    client.send_option(11, &[]);
    assert_eq!(client.read_option_reply().1, REP_ERR_UNSUP);

    client.send_option(OPT_STRUCTURED_REPLY, b"x");
    assert_eq!(client.read_option_reply().1, REP_ERR_INVALID);
    client.send_option(OPT_LIST, b"x");
    assert_eq!(client.read_option_reply().1, REP_ERR_INVALID);
    // Name length larger than the payload.
    client.send_option(OPT_GO, &[0, 0, 0, 9, b'r', b'a', b'w', 0, 0]);
    assert_eq!(client.read_option_reply().1, REP_ERR_INVALID);
    // Meta contexts before structured replies.
    client.send_option(OPT_SET_META_CONTEXT, &[0; 8]);
    assert_eq!(client.read_option_reply().1, REP_ERR_INVALID);
    // STARTTLS on a server without TLS.
    client.send_option(OPT_STARTTLS, &[]);
    assert_eq!(client.read_option_reply().1, REP_ERR_UNSUP);
    let mut unknown_export = Vec::new();
    unknown_export.extend_from_slice(&4u32.to_be_bytes());
    unknown_export.extend_from_slice(b"nope");
    unknown_export.extend_from_slice(&0u16.to_be_bytes());
    client.send_option(OPT_GO, &unknown_export);
    assert_eq!(client.read_option_reply().1, REP_ERR_UNKNOWN);

    // The connection is still usable after all of that.
    client.send_option(OPT_LIST, &[]);
    let mut names = Vec::new();
    loop {
        let (_, reply, payload) = client.read_option_reply();
        if reply == REP_ACK {
            break;
        }
        assert_eq!(reply, REP_SERVER);
        let len = u32::from_be_bytes(payload[..4].try_into().unwrap()) as usize;
        names.push(String::from_utf8(payload[4..4 + len].to_vec()).unwrap());
    }
    assert_eq!(names, ["luks", "raw", "rel", "ro"]);
    client.send_option(OPT_ABORT, &[]);
    assert_eq!(client.read_option_reply().1, REP_ACK);
    assert!(client.is_closed_by_server());
}

#[test]
fn request_with_bad_magic_closes_the_connection() {
    let f = fixture();
    let (mut client, _, _) = RawClient::open(f.server.socket_path(), "raw", false);
    let mut request = encode_request_header(&RequestHeader {
        flags: 0,
        command: CMD_READ,
        cookie: 1,
        offset: 0,
        length: 512,
    });
    request[0] ^= 0xff;
    client.stream.write_all(&request).unwrap();
    assert!(client.is_closed_by_server());
}

#[test]
fn invalid_requests_get_errors_and_the_connection_survives() {
    let f = fixture();
    let (mut client, size, flags) = RawClient::open(f.server.socket_path(), "raw", false);
    assert_eq!(size, SIZE);
    assert_ne!(flags & TFLAG_SEND_TRIM, 0);

    // Too long for one request.
    client.send_request(CMD_READ, 0, 1, 0, 64 << 20);
    assert_eq!(client.read_simple_reply(0).0, EINVAL);
    // Beyond the end: EINVAL for reads, ENOSPC for writes (payload still sent).
    client.send_request(CMD_READ, 0, 2, SIZE - 512, 1024);
    assert_eq!(client.read_simple_reply(0).0, EINVAL);
    client.send_request(CMD_READ, 0, 3, u64::MAX - 100, 512);
    assert_eq!(client.read_simple_reply(0).0, EINVAL);
    client.send_request(CMD_WRITE, 0, 4, SIZE, 512);
    client.stream.write_all(&[0u8; 512]).unwrap();
    assert_eq!(client.read_simple_reply(0), (ENOSPC, 4, vec![]));
    client.send_request(CMD_TRIM, 0, 5, SIZE - 512, 1024);
    assert_eq!(client.read_simple_reply(0).0, ENOSPC);
    // Unknown command, CACHE (not advertised), unknown flag, BLOCK_STATUS without context.
    client.send_request(42, 0, 6, 0, 512);
    assert_eq!(client.read_simple_reply(0), (EINVAL, 6, vec![]));
    client.send_request(CMD_CACHE, 0, 7, 0, 512);
    assert_eq!(client.read_simple_reply(0).0, EINVAL);
    client.send_request(CMD_READ, 1 << 9, 8, 0, 512);
    assert_eq!(client.read_simple_reply(0).0, EINVAL);
    client.send_request(CMD_BLOCK_STATUS, 0, 9, 0, 512);
    assert_eq!(client.read_simple_reply(0).0, EINVAL);
    // Unaligned to 512 bytes.
    client.send_request(CMD_READ, 0, 10, 100, 512);
    assert_eq!(client.read_simple_reply(0).0, EINVAL);

    // Still serving.
    client.send_request(CMD_READ, 0, 11, 4096, 4096);
    let (error, cookie, data) = client.read_simple_reply(4096);
    assert_eq!((error, cookie), (0, 11));
    assert!(data == pattern(SIZE as usize, SIZE)[4096..8192]);
    client.send_request(CMD_DISC, 0, 12, 0, 0);
    assert!(client.is_closed_by_server());
}

#[test]
fn requests_not_aligned_to_4096_byte_sectors_are_refused() {
    let f = fixture();
    let (mut client, _, _) = RawClient::open(f.server.socket_path(), "luks", false);
    client.send_request(CMD_READ, 0, 1, 512, 4096);
    assert_eq!(client.read_simple_reply(0).0, EINVAL);
    client.send_request(CMD_WRITE, 0, 2, 0, 512);
    client.stream.write_all(&[1u8; 512]).unwrap();
    assert_eq!(client.read_simple_reply(0).0, EINVAL);
    client.send_request(CMD_WRITE_ZEROES, 0, 3, 4096, 1024);
    assert_eq!(client.read_simple_reply(0).0, EINVAL);
    client.send_request(CMD_WRITE, 0, 4, 4096, 4096);
    client.stream.write_all(&[1u8; 4096]).unwrap();
    assert_eq!(client.read_simple_reply(0), (0, 4, vec![]));
    client.send_request(CMD_READ, 0, 5, 4096, 4096);
    assert_eq!(client.read_simple_reply(4096).2, vec![1u8; 4096]);
}

#[test]
fn writes_to_a_read_only_export_are_refused() {
    let f = fixture();
    let (mut client, _, flags) = RawClient::open(f.server.socket_path(), "ro", false);
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_eq!(flags & TFLAG_SEND_TRIM, 0);
    client.send_request(CMD_WRITE, 0, 1, 0, 512);
    client.stream.write_all(&[1u8; 512]).unwrap();
    assert_eq!(client.read_simple_reply(0).0, EPERM);
    client.send_request(CMD_WRITE_ZEROES, 0, 2, 0, 512);
    assert_eq!(client.read_simple_reply(0).0, EPERM);
    client.send_request(CMD_READ, 0, 3, 0, 512);
    assert_eq!(client.read_simple_reply(512).0, 0);
}

#[test]
fn a_read_only_export_whose_trim_releases_takes_trim_and_no_write() {
    let f = fixture();
    let (mut client, _, flags) = RawClient::open(f.server.socket_path(), "rel", false);
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_ne!(
        flags & TFLAG_SEND_TRIM,
        0,
        "announced, so a client knows it may release"
    );
    client.send_request(CMD_TRIM, 0, 1, 0, 4096);
    assert_eq!(
        client.read_simple_reply(0).0,
        0,
        "the release reached the device"
    );
    client.send_request(CMD_WRITE, 0, 2, 0, 512);
    client.stream.write_all(&[1u8; 512]).unwrap();
    assert_eq!(client.read_simple_reply(0).0, EPERM);
    client.send_request(CMD_WRITE_ZEROES, 0, 3, 0, 512);
    assert_eq!(client.read_simple_reply(0).0, EPERM);
    client.send_request(CMD_READ, 0, 4, 4096, 512);
    assert_eq!(client.read_simple_reply(512).0, 0);
}

#[test]
fn oversized_write_is_refused_and_the_connection_closed() {
    let f = fixture();
    let (mut client, _, _) = RawClient::open(f.server.socket_path(), "raw", false);
    client.send_request(CMD_WRITE, 0, 1, 0, 64 << 20);
    assert_eq!(client.read_simple_reply(0), (EINVAL, 1, vec![]));
    assert!(client.is_closed_by_server());
}

fn wait_for_no_connections(server: &TestServer, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.registry.connections(name) != 0 {
        assert!(
            Instant::now() < deadline,
            "connection to {name} never ended"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_write_cut_off_mid_payload_changes_nothing() {
    let f = fixture();
    let before = {
        let mut buf = vec![0u8; 64 << 10];
        f.raw.read_at(&mut buf, 0).unwrap();
        buf
    };
    let (mut client, _, _) = RawClient::open(f.server.socket_path(), "raw", false);
    assert_eq!(f.server.registry.connections("raw"), 1);
    client.send_request(CMD_WRITE, 0, 1, 0, 64 << 10);
    client.stream.write_all(&[0xee; 32 << 10]).unwrap();
    drop(client);
    wait_for_no_connections(&f.server, "raw");
    let mut after = vec![0u8; 64 << 10];
    f.raw.read_at(&mut after, 0).unwrap();
    assert!(after == before);
    // The unanswered request is no longer counted as in flight (the metrics gauge).
    assert_eq!(f.raw_stats.in_flight(), 0);
}

#[test]
fn a_client_that_closes_its_side_after_a_burst_gets_every_reply() {
    // More requests than the connection takes at once, all sent before any reply is read,
    // then shutdown(SHUT_WR) (what `nc -N` does): the requests already sent are still served
    // and answered. Small enough (300 x 540 bytes) to sit in the socket buffers.
    const WRITES: u64 = 300;
    const LEN: usize = 512;
    let f = fixture();
    let (mut client, _, _) = RawClient::open(f.server.socket_path(), "raw", false);
    for i in 0..WRITES {
        client.send_request(CMD_WRITE, 0, i, i * LEN as u64, LEN as u32);
        client.stream.write_all(&pattern(LEN, 1000 + i)).unwrap();
    }
    client.stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answered = std::collections::HashSet::new();
    for _ in 0..WRITES {
        let (error, cookie, _) = client.read_simple_reply(0);
        assert_eq!(error, 0, "write {cookie} failed");
        answered.insert(cookie);
    }
    assert_eq!(answered.len() as u64, WRITES);
    assert!(client.is_closed_by_server());
    for i in 0..WRITES {
        let mut data = vec![0u8; LEN];
        f.raw.read_at(&mut data, i * LEN as u64).unwrap();
        assert!(data == pattern(LEN, 1000 + i), "block {i}");
    }
    wait_for_no_connections(&f.server, "raw");
    assert_eq!(f.raw_stats.in_flight(), 0);
}

#[test]
fn stalled_clients_time_out_but_idle_ones_do_not() {
    let f = fixture_with(Duration::from_millis(500));

    // Stalled in the handshake (no client flags).
    let mut client = RawClient::connect(f.server.socket_path());
    let started = Instant::now();
    assert!(client.is_closed_by_server());
    assert!(started.elapsed() < Duration::from_secs(10));

    // Stalled inside a WRITE payload: disconnected, nothing written.
    let (mut client, _, _) = RawClient::open(f.server.socket_path(), "raw", false);
    client.send_request(CMD_WRITE, 0, 1, 0, 4096);
    client.stream.write_all(&[0xee; 100]).unwrap();
    let started = Instant::now();
    assert!(client.is_closed_by_server());
    assert!(started.elapsed() < Duration::from_secs(10));
    let mut data = vec![0u8; 4096];
    f.raw.read_at(&mut data, 0).unwrap();
    assert!(data == pattern(SIZE as usize, SIZE)[..4096]);

    // Idle between requests for several timeouts: still served.
    let (mut client, _, _) = RawClient::open(f.server.socket_path(), "raw", false);
    std::thread::sleep(Duration::from_millis(1600));
    client.send_request(CMD_READ, 0, 2, 0, 512);
    assert_eq!(client.read_simple_reply(512).0, 0);
}

#[test]
fn structured_replies_for_reads_errors_and_block_status() {
    let f = fixture();
    let mut client = RawClient::connect(f.server.socket_path());
    client.send_flags(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES);
    client.send_option(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(client.read_option_reply().1, REP_ACK);
    let mut meta = Vec::new();
    meta.extend_from_slice(&3u32.to_be_bytes());
    meta.extend_from_slice(b"raw");
    meta.extend_from_slice(&2u32.to_be_bytes());
    for query in ["qemu:dirty-bitmap:x", "base:allocation"] {
        meta.extend_from_slice(&(query.len() as u32).to_be_bytes());
        meta.extend_from_slice(query.as_bytes());
    }
    client.send_option(OPT_SET_META_CONTEXT, &meta);
    let (_, reply, payload) = client.read_option_reply();
    assert_eq!(reply, REP_META_CONTEXT);
    assert_eq!(&payload[4..], b"base:allocation");
    let context_id = u32::from_be_bytes(payload[..4].try_into().unwrap());
    assert_eq!(client.read_option_reply().1, REP_ACK);
    let mut go = Vec::new();
    go.extend_from_slice(&3u32.to_be_bytes());
    go.extend_from_slice(b"raw");
    go.extend_from_slice(&0u16.to_be_bytes());
    client.send_option(OPT_GO, &go);
    while client.read_option_reply().1 != REP_ACK {}

    let read_chunk = |client: &mut RawClient| {
        let mut header = [0u8; 20];
        std::io::Read::read_exact(&mut client.stream, &mut header).unwrap();
        assert_eq!(&header[..4], &STRUCTURED_REPLY_MAGIC.to_be_bytes());
        let flags = u16::from_be_bytes([header[4], header[5]]);
        let kind = u16::from_be_bytes([header[6], header[7]]);
        let len = u32::from_be_bytes(header[16..20].try_into().unwrap());
        let mut payload = vec![0u8; len as usize];
        std::io::Read::read_exact(&mut client.stream, &mut payload).unwrap();
        (flags, kind, payload)
    };
    client.send_request(CMD_READ, 0, 1, 512, 512);
    let (flags, kind, payload) = read_chunk(&mut client);
    assert_eq!((flags, kind), (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA));
    assert_eq!(&payload[..8], &512u64.to_be_bytes());
    assert!(payload[8..] == pattern(SIZE as usize, SIZE)[512..1024]);

    client.send_request(CMD_READ, 0, 2, SIZE, 512);
    let (flags, kind, payload) = read_chunk(&mut client);
    assert_eq!((flags, kind), (REPLY_FLAG_DONE, REPLY_TYPE_ERROR));
    assert_eq!(&payload[..4], &EINVAL.to_be_bytes());

    client.send_request(CMD_BLOCK_STATUS, 0, 3, 0, 1 << 20);
    let (flags, kind, payload) = read_chunk(&mut client);
    assert_eq!((flags, kind), (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS));
    assert_eq!(&payload[..4], &context_id.to_be_bytes());
    assert_eq!(&payload[4..8], &(1u32 << 20).to_be_bytes());
    assert_eq!(&payload[8..12], &0u32.to_be_bytes());
}
