//! Many requests in flight on one connection: a slow device is served in parallel by the
//! connection's workers, and replies may arrive in any order but all arrive.
mod common;

use common::{export, pattern, raw_file, TestServer};
use cryptblk_block::{BlockDevice, BlockError};
use cryptblk_nbd::protocol::*;
use cryptblk_nbd::ExportRegistry;
use cryptblk_testutil::nbd::RawClient;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DELAY: Duration = Duration::from_millis(40);

/// Every read and write takes `DELAY`, like a disk that misses its cache.
struct SlowDevice(Arc<dyn BlockDevice>);

impl BlockDevice for SlowDevice {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        std::thread::sleep(DELAY);
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        std::thread::sleep(DELAY);
        self.0.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.0.flush()
    }
}

/// Sends `count` 4 KiB reads at once and returns the data by cookie plus the elapsed time.
fn burst_of_reads(client: &mut RawClient, count: u64) -> (HashMap<u64, Vec<u8>>, Duration) {
    let started = Instant::now();
    let mut requests = Vec::new();
    for cookie in 0..count {
        requests.extend_from_slice(&encode_request_header(&RequestHeader {
            flags: 0,
            command: CMD_READ,
            cookie,
            offset: cookie * 4096,
            length: 4096,
        }));
    }
    client.stream.write_all(&requests).unwrap();
    let mut replies = HashMap::new();
    for _ in 0..count {
        let (error, cookie, data) = client.read_simple_reply(4096);
        assert_eq!(error, 0);
        assert!(
            replies.insert(cookie, data).is_none(),
            "cookie {cookie} twice"
        );
    }
    (replies, started.elapsed())
}

#[test]
fn a_slow_device_is_served_in_parallel_and_every_reply_arrives() {
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    let raw = raw_file(&dir.path().join("a.raw"), 1 << 20, 1 << 20);
    registry
        .add(export("slow", Arc::new(SlowDevice(raw))))
        .unwrap();
    let server = TestServer::unix_with(dir.path(), registry, |server| server.with_queue_depth(32));
    let (mut client, _, _) = RawClient::open(server.socket_path(), "slow", false);
    let expected = pattern(1 << 20, 1 << 20);

    // The first requests teach the connection that the device is slow.
    burst_of_reads(&mut client, 16);
    let (replies, elapsed) = burst_of_reads(&mut client, 32);
    for (cookie, data) in &replies {
        let at = *cookie as usize * 4096;
        assert!(data[..] == expected[at..at + 4096], "read {cookie}");
    }
    // Serially this takes 32 x 40 ms = 1.28 s; eight workers need about a quarter of that.
    assert!(elapsed < Duration::from_millis(900), "took {elapsed:?}");
}

#[test]
fn inline_only_connections_serve_pipelined_requests() {
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    let raw = raw_file(&dir.path().join("a.raw"), 1 << 20, 1 << 20);
    registry.add(export("fast", raw)).unwrap();
    let server = TestServer::unix_with(dir.path(), registry, |server| server.with_queue_depth(1));
    let (mut client, _, _) = RawClient::open(server.socket_path(), "fast", false);
    // Writes and reads mixed in one burst, answered in order on the reader thread.
    let mut burst = Vec::new();
    for cookie in 0..64u64 {
        burst.extend_from_slice(&encode_request_header(&RequestHeader {
            flags: 0,
            command: CMD_WRITE,
            cookie,
            offset: cookie * 512,
            length: 512,
        }));
        burst.extend_from_slice(&[cookie as u8; 512]);
    }
    client.stream.write_all(&burst).unwrap();
    for cookie in 0..64u64 {
        assert_eq!(client.read_simple_reply(0), (0, cookie, vec![]));
    }
    client.send_request(CMD_READ, 0, 99, 0, 64 * 512);
    let (_, _, data) = client.read_simple_reply(64 * 512);
    for (i, chunk) in data.chunks(512).enumerate() {
        assert!(chunk.iter().all(|&b| b == i as u8));
    }
    let mut rest = [0u8; 1];
    client.send_request(CMD_DISC, 0, 100, 0, 0);
    assert_eq!(client.stream.read(&mut rest).unwrap(), 0);
}

#[test]
fn pipelined_writes_of_every_size_land_intact() {
    // Payloads smaller than, straddling and larger than the server's read buffer, sent as one
    // burst: the server runs some straight from its read buffer and copies the others, and
    // every byte must land where its request said.
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    let raw = raw_file(&dir.path().join("a.raw"), 8 << 20, 0);
    registry.add(export("disk", raw)).unwrap();
    let server = TestServer::unix(dir.path(), registry);
    let (mut client, _, _) = RawClient::open(server.socket_path(), "disk", false);
    let sizes = [
        512,
        4096,
        65536,
        200 << 10,
        300 << 10,
        128 << 10 | 512,
        1536,
    ];
    let mut expected = Vec::new();
    let mut burst = Vec::new();
    let mut offset = 0u64;
    for cookie in 0..24u64 {
        let len = sizes[cookie as usize % sizes.len()];
        let data = pattern(len, cookie + 1);
        burst.extend_from_slice(&encode_request_header(&RequestHeader {
            flags: 0,
            command: CMD_WRITE,
            cookie,
            offset,
            length: len as u32,
        }));
        burst.extend_from_slice(&data);
        expected.extend_from_slice(&data);
        offset += len as u64;
    }
    client.stream.write_all(&burst).unwrap();
    let mut answered: Vec<u64> = (0..24)
        .map(|_| {
            let (error, cookie, _) = client.read_simple_reply(0);
            assert_eq!(error, 0, "write {cookie} failed");
            cookie
        })
        .collect();
    answered.sort_unstable();
    assert_eq!(answered, (0..24).collect::<Vec<_>>());
    client.send_request(CMD_READ, 0, 99, 0, expected.len() as u32);
    let (_, _, data) = client.read_simple_reply(expected.len());
    assert!(data == expected, "data read back differs from the writes");
}
