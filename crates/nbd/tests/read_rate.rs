//! An export with a read rate ceiling (`Export::read_rate`) serves reads no faster than it,
//! all connections together, with every byte right, and its clients are not cut off for the
//! time they wait, on plain and on TLS connections.
mod common;

use common::{export, pattern, raw_file, TestServer};
use cryptblk_nbd::protocol::*;
use cryptblk_nbd::{ExportRegistry, ReadPacer};
use cryptblk_testutil::nbd::RawClient;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 8 * MIB;
const RATE: u64 = 4 * MIB;

/// Sends `count` 1 MiB reads from `first` MiB on at once and checks every reply's data.
fn read_mibs(client: &mut RawClient, first: u64, count: u64) {
    let mut requests = Vec::new();
    for i in 0..count {
        requests.extend_from_slice(&encode_request_header(&RequestHeader {
            flags: 0,
            command: CMD_READ,
            cookie: first + i,
            offset: (first + i) * MIB,
            length: MIB as u32,
        }));
    }
    client.stream.write_all(&requests).unwrap();
    let expected = pattern(SIZE as usize, SIZE);
    for _ in 0..count {
        let (error, cookie, data) = client.read_simple_reply(MIB as usize);
        assert_eq!(error, 0, "read {cookie}");
        let at = (cookie * MIB) as usize;
        assert!(data[..] == expected[at..at + MIB as usize], "read {cookie}");
    }
}

fn paced_server(dir: &std::path::Path) -> TestServer {
    let registry = ExportRegistry::new();
    let mut paced = export("disk", raw_file(&dir.join("a.raw"), SIZE, SIZE as usize));
    paced.read_rate = Some(Arc::new(ReadPacer::new(RATE)));
    registry.add(paced).unwrap();
    // A short stall limit: waiting for the rate must not count as the client's stall.
    TestServer::unix_with(dir, registry, |server| {
        server.with_io_timeout(Duration::from_millis(300))
    })
}

/// At the rate, `bytes` read in requests of at most `largest` bytes take this long at least:
/// the first request goes at once, and the rate lets each go its burst early.
fn least_time(bytes: u64, largest: u64) -> Duration {
    Duration::from_secs_f64((bytes - largest) as f64 / RATE as f64) - cryptblk_nbd::READ_RATE_BURST
}

#[test]
fn a_connection_reads_no_faster_than_the_rate() {
    let dir = tempfile::tempdir().unwrap();
    let server = paced_server(dir.path());
    let (mut client, _, _) = RawClient::open(server.socket_path(), "disk", false);
    let started = Instant::now();
    read_mibs(&mut client, 0, 8);
    let took = started.elapsed();
    assert!(
        took >= least_time(SIZE, MIB),
        "8 MiB at 4 MiB/s in {took:?}"
    );
    assert!(took < Duration::from_secs(30), "{took:?}");
}

#[test]
fn connections_share_the_rate() {
    let dir = tempfile::tempdir().unwrap();
    let server = paced_server(dir.path());
    let socket = server.socket_path().to_path_buf();
    let started = Instant::now();
    let readers: Vec<_> = [0, 4]
        .into_iter()
        .map(|first| {
            let socket = socket.clone();
            std::thread::spawn(move || {
                let (mut client, _, _) = RawClient::open(&socket, "disk", false);
                read_mibs(&mut client, first, 4);
            })
        })
        .collect();
    for reader in readers {
        reader.join().unwrap();
    }
    let took = started.elapsed();
    assert!(
        took >= least_time(SIZE, MIB),
        "2 x 4 MiB at 4 MiB/s in {took:?}"
    );
}

#[test]
fn a_tls_connection_reads_no_faster_than_the_rate() {
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    let mut paced = export(
        "disk",
        raw_file(&dir.path().join("a.raw"), SIZE, SIZE as usize),
    );
    paced.read_rate = Some(Arc::new(ReadPacer::new(RATE)));
    registry.add(paced).unwrap();
    let (server, creds) = TestServer::tls(dir.path(), registry);
    let [object, image] = common::qemu_tls_opts(server.port(), "disk", &creds);
    let copy = dir.path().join("copy.raw");
    let started = Instant::now();
    common::run(
        "qemu-img",
        &[
            "convert",
            "--object",
            &object,
            "--image-opts",
            &image,
            "-O",
            "raw",
            copy.to_str().unwrap(),
        ],
    );
    let took = started.elapsed();
    // qemu-img reads 2 MiB at a time (the bound allows 4); unpaced, the copy takes a few
    // milliseconds.
    assert!(
        took >= least_time(SIZE, 4 * MIB),
        "8 MiB at 4 MiB/s over TLS in {took:?}"
    );
    assert!(std::fs::read(&copy).unwrap() == pattern(SIZE as usize, SIZE));
}
