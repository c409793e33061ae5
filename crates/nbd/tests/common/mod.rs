//! Helpers shared by the NBD integration tests: external tools, devices, a server on a thread
//! and a byte-level NBD client for malformed-input tests.
#![allow(dead_code)]

use cryptblk_block::{open_luks_volume, BlockDevice, IoStats, OpenOptions, RawFile, VolumeOptions};
use cryptblk_crypto::CipherSpec;
use cryptblk_luks::{FormatOptions, HashAlg, LuksImage, PbkdfOptions};
use cryptblk_nbd::protocol::*;
use cryptblk_nbd::{Export, ExportRegistry, NbdAddress, NbdServer, StopHandle, TlsCreds};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub const PASSPHRASE: &[u8] = b"nbd test passphrase";

pub use cryptblk_testutil::tool;

/// Runs a tool, failing the test with its output unless it succeeds; returns stdout.
pub fn run(name: &str, args: &[&str]) -> String {
    let out = Command::new(tool(name))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {name}: {e}"));
    assert!(
        out.status.success(),
        "{name} {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a tool expected to fail; returns stderr.
pub fn run_failing(name: &str, args: &[&str]) -> String {
    let out = Command::new(tool(name))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {name}: {e}"));
    assert!(
        !out.status.success(),
        "{name} {args:?} unexpectedly succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Deterministic pseudo-random bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A raw file of `size` bytes whose first `data_len` bytes are a pattern and the rest a hole.
pub fn raw_file(path: &Path, size: u64, data_len: usize) -> Arc<RawFile> {
    let file = std::fs::File::create(path).unwrap();
    file.set_len(size).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &pattern(data_len, size), 0).unwrap();
    drop(file);
    Arc::new(
        RawFile::open(
            path,
            OpenOptions {
                writable: true,
                lock: false,
            },
        )
        .unwrap(),
    )
}

/// A LUKS2 aes-xts-plain64 (512-bit key) volume with `sector_size`-byte sectors and a cheap
/// PBKDF2 keyslot, opened writable.
pub fn luks2_volume(path: &Path, payload_size: u64, sector_size: u32) -> Arc<dyn BlockDevice> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .unwrap();
    let options = FormatOptions {
        pbkdf: PbkdfOptions::pbkdf2_iterations(HashAlg::Sha256, 1000),
        ..FormatOptions::luks2(
            CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap(),
            sector_size,
        )
    };
    LuksImage::format(&file, &options, PASSPHRASE, Some(payload_size)).unwrap();
    drop(file);
    let volume = open_luks_volume(
        path,
        PASSPHRASE,
        &VolumeOptions {
            writable: true,
            ..Default::default()
        },
    )
    .unwrap();
    Arc::new(volume)
}

pub fn export(name: &str, device: Arc<dyn BlockDevice>) -> Export {
    Export {
        name: name.into(),
        description: format!("test export {name}"),
        device,
        read_only: false,
        stats: Arc::new(IoStats::default()),
        tls_authz: None,
    }
}

/// A server running on its own thread; stopped and joined on drop.
pub struct TestServer {
    pub address: String,
    pub registry: Arc<ExportRegistry>,
    stop: StopHandle,
    thread: Option<JoinHandle<Result<(), cryptblk_nbd::Error>>>,
}

impl TestServer {
    pub fn start(
        address: NbdAddress,
        registry: Arc<ExportRegistry>,
        tls: Option<TlsCreds>,
        configure: impl FnOnce(NbdServer) -> NbdServer,
    ) -> TestServer {
        let server = configure(NbdServer::bind(&address, Arc::clone(&registry), tls).unwrap());
        let stop = server.stop_handle();
        let address = server.local_addr();
        let thread = std::thread::spawn(move || server.run());
        TestServer {
            address,
            registry,
            stop,
            thread: Some(thread),
        }
    }

    pub fn unix(dir: &Path, registry: Arc<ExportRegistry>) -> TestServer {
        Self::unix_with(dir, registry, |server| server)
    }

    pub fn unix_with(
        dir: &Path,
        registry: Arc<ExportRegistry>,
        configure: impl FnOnce(NbdServer) -> NbdServer,
    ) -> TestServer {
        let path = dir.join("nbd.sock");
        Self::start(NbdAddress::Unix(path), registry, None, configure)
    }

    pub fn socket_path(&self) -> &Path {
        Path::new(&self.address)
    }

    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.address)
    }

    /// Stops the server and waits for `run` to return.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.stop();
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap().unwrap();
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.shutdown();
        } else {
            self.stop.stop();
        }
    }
}

/// Speaks NBD byte by byte, so tests can send anything.
pub struct RawClient {
    pub stream: UnixStream,
}

impl RawClient {
    /// Connects and checks the server greeting; the client flags are not sent yet.
    pub fn connect(path: &Path) -> RawClient {
        let stream = UnixStream::connect(path).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut client = RawClient { stream };
        let mut greeting = [0u8; 18];
        client.stream.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[0..8], &NBD_MAGIC.to_be_bytes());
        assert_eq!(&greeting[8..16], &IHAVEOPT.to_be_bytes());
        assert_eq!(
            u16::from_be_bytes([greeting[16], greeting[17]]),
            FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES
        );
        client
    }

    /// Connects, negotiates fixed newstyle without zeroes and optionally structured replies,
    /// and enters transmission on `name` with NBD_OPT_GO. Returns (client, size, flags).
    pub fn open(path: &Path, name: &str, structured: bool) -> (RawClient, u64, u16) {
        let mut client = RawClient::connect(path);
        client.send_flags(CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES);
        if structured {
            client.send_option(OPT_STRUCTURED_REPLY, &[]);
            assert_eq!(client.read_option_reply().1, REP_ACK);
        }
        let mut data = Vec::new();
        data.extend_from_slice(&(name.len() as u32).to_be_bytes());
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        client.send_option(OPT_GO, &data);
        let (mut size, mut flags) = (0, 0);
        loop {
            let (option, reply, payload) = client.read_option_reply();
            assert_eq!(option, OPT_GO);
            match reply {
                REP_INFO => {
                    if u16::from_be_bytes([payload[0], payload[1]]) == INFO_EXPORT {
                        size = u64::from_be_bytes(payload[2..10].try_into().unwrap());
                        flags = u16::from_be_bytes([payload[10], payload[11]]);
                    }
                }
                REP_ACK => return (client, size, flags),
                other => panic!("NBD_OPT_GO for '{name}' failed with reply {other:#x}"),
            }
        }
    }

    pub fn send_flags(&mut self, flags: u32) {
        self.stream.write_all(&flags.to_be_bytes()).unwrap();
    }

    pub fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut message = Vec::new();
        message.extend_from_slice(&IHAVEOPT.to_be_bytes());
        message.extend_from_slice(&option.to_be_bytes());
        message.extend_from_slice(&(data.len() as u32).to_be_bytes());
        message.extend_from_slice(data);
        self.stream.write_all(&message).unwrap();
    }

    /// (option, reply type, payload)
    pub fn read_option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let mut header = [0u8; 20];
        self.stream.read_exact(&mut header).unwrap();
        assert_eq!(&header[0..8], &OPTION_REPLY_MAGIC.to_be_bytes());
        let option = u32::from_be_bytes(header[8..12].try_into().unwrap());
        let reply = u32::from_be_bytes(header[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(header[16..20].try_into().unwrap());
        let mut payload = vec![0u8; len as usize];
        self.stream.read_exact(&mut payload).unwrap();
        (option, reply, payload)
    }

    pub fn send_request(
        &mut self,
        command: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u32,
    ) {
        let header = encode_request_header(&RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        });
        self.stream.write_all(&header).unwrap();
    }

    /// Reads a simple reply: (error, cookie, `data_len` bytes of data when error is 0).
    pub fn read_simple_reply(&mut self, data_len: usize) -> (u32, u64, Vec<u8>) {
        let mut header = [0u8; 16];
        self.stream.read_exact(&mut header).unwrap();
        assert_eq!(&header[0..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
        let error = u32::from_be_bytes(header[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(header[8..16].try_into().unwrap());
        let mut data = Vec::new();
        if error == 0 {
            data.resize(data_len, 0);
            self.stream.read_exact(&mut data).unwrap();
        }
        (error, cookie, data)
    }

    /// True when the server has closed the connection (EOF or reset) within the timeout.
    pub fn is_closed_by_server(&mut self) -> bool {
        let mut byte = [0u8; 1];
        match self.stream.read(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}
