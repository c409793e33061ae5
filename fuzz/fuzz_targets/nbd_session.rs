//! A whole NBD session from an untrusted client: the fuzz input is everything the client
//! sends (handshake, options, requests, payloads), fed to a real `NbdServer` over a UNIX
//! socket. Any panic on a server thread aborts the process (libFuzzer's panic hook); after
//! every input the server must still complete a fresh, valid handshake.
#![no_main]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cryptblk_block::{BlockError, IoStats, OpenOptions, RawFile};
use cryptblk_nbd::{DirtyBitmaps, Export, ExportRegistry, NbdAddress, NbdServer};
use libfuzzer_sys::fuzz_target;

/// Bitmap "a": the 64 KiB regions at 128 KiB and 512 KiB changed, so a session can select
/// `qemu:dirty-bitmap:a` and reach the dirty-extent replies.
struct Bitmaps;

impl DirtyBitmaps for Bitmaps {
    fn names(&self) -> Vec<String> {
        vec!["a".into()]
    }

    fn dirty_runs(&self, _: &str, from: u64, limit: usize) -> Result<Vec<(u64, u64)>, BlockError> {
        Ok([(128 << 10, 64 << 10), (512 << 10, 64 << 10)]
            .into_iter()
            .filter(|&(offset, len)| offset + len > from)
            .take(limit)
            .collect())
    }
}

struct Fixture {
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("disk.raw");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let device = RawFile::open(
            &image,
            OpenOptions {
                writable: true,
                lock: false,
            },
        )
        .unwrap();
        let device = Arc::new(device);
        let registry = ExportRegistry::new();
        // "r": read-only, its TRIM a release (as a backup export's), so both paths are driven.
        registry
            .add(Export {
                name: "r".into(),
                description: "fuzz read-only".into(),
                device: device.clone(),
                read_only: true,
                stats: Arc::new(IoStats::default()),
                tls_authz: None,
                dirty_bitmaps: None,
                read_rate: None,
                trim_releases: true,
            })
            .unwrap();
        registry
            .add(Export {
                name: "x".into(),
                description: "fuzz".into(),
                device,
                read_only: false,
                stats: Arc::new(IoStats::default()),
                tls_authz: None,
                dirty_bitmaps: Some(Arc::new(Bitmaps)),
                read_rate: None,
                trim_releases: false,
            })
            .unwrap();
        let socket = dir.path().join("nbd.sock");
        let server = NbdServer::bind(&NbdAddress::Unix(socket.clone()), registry, None)
            .unwrap()
            .with_io_timeout(Duration::from_millis(200));
        std::thread::spawn(move || server.run().unwrap());
        Fixture { socket, _dir: dir }
    })
}

/// Sends `input` as a client would, then drains whatever the server answers.
fn session(socket: &PathBuf, input: &[u8]) {
    let mut stream = UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    // The server may close early (a protocol error): later writes then fail, which is fine.
    let _ = stream.write_all(input);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut sink = [0u8; 64 * 1024];
    while let Ok(n) = stream.read(&mut sink) {
        if n == 0 {
            break;
        }
    }
}

/// The server still speaks NBD: the greeting starts with NBDMAGIC.
fn assert_alive(socket: &PathBuf) {
    let mut stream = UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut greeting = [0u8; 8];
    stream.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting, b"NBDMAGIC");
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    session(&f.socket, data);
    assert_alive(&f.socket);
});
