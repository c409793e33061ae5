//! Helpers shared by the NBD integration tests: external tools, devices and a server on a
//! thread (the byte-level NBD client is `cryptblk_testutil::nbd::RawClient`).
#![allow(dead_code)]

use cryptblk_block::{BlockDevice, IoStats, OpenOptions, RawFile};
use cryptblk_nbd::{Export, ExportRegistry, NbdAddress, NbdServer, StopHandle, TlsCreds};
use cryptblk_volume::{open_luks_volume, VolumeOptions};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::thread::JoinHandle;

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

pub use cryptblk_testutil::pattern;

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
    cryptblk_testutil::luks::cheap_luks2(path, PASSPHRASE, payload_size, sector_size);
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
        dirty_bitmaps: None,
        read_rate: None,
        trim_releases: false,
    }
}

/// A server running on its own thread; stopped and joined on drop.
/// The `--object` and `--image-opts` values with which QEMU's tools reach `export` on
/// loopback `port` over TLS, as the client whose credentials are in `creds`.
pub fn qemu_tls_opts(port: &str, export: &str, creds: &Path) -> [String; 2] {
    [
        format!(
            "tls-creds-x509,id=tls0,dir={},endpoint=client",
            creds.display()
        ),
        format!("driver=nbd,host=127.0.0.1,port={port},export={export},tls-creds=tls0"),
    ]
}

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

    /// A TCP server on loopback with credentials made in `dir/pki` (returned beside it), so
    /// every client must speak TLS.
    pub fn tls(dir: &Path, registry: Arc<ExportRegistry>) -> (TestServer, PathBuf) {
        let creds = dir.join("pki");
        std::fs::create_dir(&creds).unwrap();
        cryptblk_testutil::x509::make_credentials(&creds, "cryptblk test CA");
        let server = TestServer::start(
            NbdAddress::Tcp("127.0.0.1:0".into()),
            registry,
            Some(TlsCreds::load(&creds).unwrap()),
            |server| server,
        );
        (server, creds)
    }

    /// The TCP port of a server on loopback.
    pub fn port(&self) -> &str {
        self.address.rsplit_once(':').unwrap().1
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
