//! Export registry management while clients are connected, and server start/stop.
mod common;

use common::{export, pattern, raw_file, TestServer};
use cryptblk_block::{BlockDevice, BlockError};
use cryptblk_nbd::protocol::*;
use cryptblk_nbd::{Error, ExportRegistry, NbdAddress, NbdServer};
use cryptblk_testutil::nbd::RawClient;
use std::collections::HashSet;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A device whose writes take a while, so that requests are reliably in flight.
struct SlowDevice {
    inner: Arc<dyn BlockDevice>,
    delay: Duration,
}

impl BlockDevice for SlowDevice {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        std::thread::sleep(self.delay);
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.inner.flush()
    }
}

#[test]
fn add_remove_and_names() {
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    let device = raw_file(&dir.path().join("a.raw"), 1 << 20, 0);
    registry.add(export("b", device.clone())).unwrap();
    registry.add(export("a", device.clone())).unwrap();
    assert!(matches!(
        registry.add(export("a", device)),
        Err(Error::ExportExists(name)) if name == "a"
    ));
    assert_eq!(registry.names(), ["a", "b"]);
    assert!(matches!(
        registry.remove("zzz"),
        Err(Error::NoSuchExport(_))
    ));
    registry.remove("a").unwrap();
    assert_eq!(registry.names(), ["b"]);
    assert_eq!(registry.connections("b"), 0);
}

#[test]
fn removing_an_export_drains_its_connections() {
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    let raw = raw_file(&dir.path().join("a.raw"), 8 << 20, 0);
    let slow: Arc<dyn BlockDevice> = Arc::new(SlowDevice {
        inner: raw.clone(),
        delay: Duration::from_millis(100),
    });
    let disk = export("disk", slow);
    let stats = Arc::clone(&disk.stats);
    registry.add(disk).unwrap();
    registry.add(export("other", raw.clone())).unwrap();
    let server = TestServer::unix(dir.path(), Arc::clone(&registry));

    let (mut client, _, _) = RawClient::open(server.socket_path(), "disk", false);
    let (mut bystander, _, _) = RawClient::open(server.socket_path(), "other", false);
    assert_eq!(registry.connections("disk"), 1);
    const WRITES: u64 = 8;
    for i in 0..WRITES {
        client.send_request(CMD_WRITE, 0, i, i * 65536, 65536);
        client.stream.write_all(&pattern(65536, i + 1)).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while stats.in_flight() == 0 {
        assert!(Instant::now() < deadline, "writes never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    let remover = {
        let registry = Arc::clone(&registry);
        std::thread::spawn(move || registry.remove("disk").unwrap())
    };

    // Once remove returns, every request the server took has been answered successfully
    // and the connection is closed: all of it is already waiting in the socket.
    remover.join().unwrap();
    client.stream.set_nonblocking(true).unwrap();
    let mut answered = HashSet::new();
    let mut received = Vec::new();
    loop {
        let mut chunk = [0u8; 4096];
        match std::io::Read::read(&mut client.stream, &mut chunk) {
            Ok(0) => break,
            Ok(n) => received.extend_from_slice(&chunk[..n]),
            Err(e) => panic!("connection not closed when remove returned: {e}"),
        }
    }
    assert_eq!(received.len() % 16, 0);
    for reply in received.chunks(16) {
        assert_eq!(&reply[4..8], &[0, 0, 0, 0], "write failed");
        answered.insert(u64::from_be_bytes(reply[8..16].try_into().unwrap()));
    }
    assert!(!answered.is_empty());
    assert_eq!(stats.in_flight(), 0);
    for cookie in &answered {
        let mut data = vec![0u8; 65536];
        raw.read_at(&mut data, cookie * 65536).unwrap();
        assert!(data == pattern(65536, cookie + 1), "write {cookie} lost");
    }

    // The export is gone for new clients; others are unaffected.
    assert_eq!(registry.connections("disk"), 0);
    let mut late = RawClient::connect(server.socket_path());
    late.send_flags(CLIENT_FLAG_FIXED_NEWSTYLE);
    let mut go = Vec::new();
    go.extend_from_slice(&4u32.to_be_bytes());
    go.extend_from_slice(b"disk");
    go.extend_from_slice(&0u16.to_be_bytes());
    late.send_option(OPT_GO, &go);
    assert_eq!(late.read_option_reply().1, REP_ERR_UNKNOWN);
    bystander.send_request(CMD_READ, 0, 1, 0, 512);
    assert_eq!(bystander.read_simple_reply(512).0, 0);
}

#[test]
fn stop_finishes_in_flight_requests_and_removes_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let registry = ExportRegistry::new();
    let raw = raw_file(&dir.path().join("a.raw"), 8 << 20, 0);
    let slow: Arc<dyn BlockDevice> = Arc::new(SlowDevice {
        inner: raw.clone(),
        delay: Duration::from_millis(200),
    });
    registry.add(export("disk", slow)).unwrap();

    // A stale socket file from a crashed server is replaced.
    let path = dir.path().join("nbd.sock");
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let server = NbdServer::bind(&NbdAddress::Unix(path.clone()), registry.clone(), None).unwrap();
    // A live socket is not.
    assert!(matches!(
        NbdServer::bind(&NbdAddress::Unix(path.clone()), registry.clone(), None),
        Err(Error::Bind { .. })
    ));
    let stop = server.stop_handle();
    let runner = std::thread::spawn(move || server.run());

    let (mut client, _, _) = RawClient::open(&path, "disk", false);
    client.send_request(CMD_WRITE, 0, 7, 0, 4096);
    client.stream.write_all(&[0x42; 4096]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    stop.stop();
    runner.join().unwrap().unwrap();
    assert_eq!(client.read_simple_reply(0), (0, 7, vec![]));
    assert!(client.is_closed_by_server());
    assert!(!path.exists(), "socket file left behind");
    let mut data = vec![0u8; 4096];
    raw.read_at(&mut data, 0).unwrap();
    assert_eq!(data, vec![0x42; 4096]);
}

#[test]
fn addresses_parse_with_clear_errors() {
    assert_eq!(
        "unix:/run/x.sock".parse::<NbdAddress>().unwrap(),
        NbdAddress::Unix("/run/x.sock".into())
    );
    let error = "udp:1.2.3.4:5"
        .parse::<NbdAddress>()
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("unix:/path/to/socket or tcp:HOST:PORT"),
        "{error}"
    );
}
