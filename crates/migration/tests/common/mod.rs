//! Shared pieces of the migration tests: LUKS2 images with a plaintext model, verified I/O
//! threads, a TCP proxy that can cut connections, and test certificates.
#![allow(dead_code)]

use cryptblk_block::{BlockDevice, OpenOptions, RawFile};
use cryptblk_migration::{IncomingDisk, IncomingMigration};
use cryptblk_volume::DirtyTracker;
use cryptblk_volume::{open_luks_volume_on, LuksVolume, VolumeOptions};
use rand::{Rng, SeedableRng};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const PW: &[u8] = b"migration test passphrase";
pub const SECTOR: usize = 4096;

pub fn rw(path: &Path) -> RawFile {
    RawFile::open(
        path,
        OpenOptions {
            writable: true,
            lock: true,
        },
    )
    .unwrap()
}

/// A source disk: the LUKS2 image file, the guest's view through the dirty tracker, and what
/// the guest's data should be.
pub struct SourceDisk {
    pub raw: Arc<RawFile>,
    pub tracker: Arc<DirtyTracker>,
    pub model: Arc<Mutex<Vec<u8>>>,
    pub payload: u64,
}

pub fn luks2_source(path: &Path, payload: u64, seed: u64) -> SourceDisk {
    let (header, key) = cryptblk_testutil::luks::cheap_luks2(path, PW, payload, SECTOR as u32);
    let data_offset = header.data_offset();
    let raw = Arc::new(rw(path));
    let vol = LuksVolume::from_unlocked(
        raw.clone(),
        header,
        0,
        &key,
        Arc::new(cryptblk_crypto::CryptoPool::new(2)),
    )
    .unwrap();
    let tracker = Arc::new(DirtyTracker::new(Arc::new(vol), data_offset, SECTOR as u64).unwrap());
    // Data in the first three quarters, the rest never written (holes in the image).
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut model = vec![0u8; payload as usize];
    let filled = payload as usize * 3 / 4;
    rng.fill(&mut model[..filled]);
    tracker.write_at(&model[..filled], 0).unwrap();
    // Never-written sectors of an encrypted disk read as whatever their ciphertext (zeros)
    // decrypts to; the model holds what the disk really reads.
    tracker
        .read_at(&mut model[filled..], filled as u64)
        .unwrap();
    SourceDisk {
        raw,
        tracker,
        model: Arc::new(Mutex::new(model)),
        payload,
    }
}

/// The destination's disk once the header arrived: the LUKS volume over the image the
/// migration writes, behind the incoming gate.
pub fn destination_disk(incoming: &IncomingMigration) -> Arc<IncomingDisk> {
    let ready = incoming.wait_header(Duration::from_secs(30)).unwrap();
    let vol = open_luks_volume_on(
        ready.file,
        PW,
        &VolumeOptions {
            writable: true,
            ..Default::default()
        },
    )
    .unwrap();
    incoming.disk(Arc::new(vol)).unwrap()
}

/// Verified I/O against the model until `stop`: random multi-sector writes (read back) and
/// random reads, all compared with the model. Returns the number of operations.
pub fn spawn_io(
    dev: Arc<dyn BlockDevice>,
    model: Arc<Mutex<Vec<u8>>>,
    stop: Arc<AtomicBool>,
    seed: u64,
    write: bool,
    done: Arc<AtomicU64>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let sectors = dev.size() as usize / SECTOR;
        while !stop.load(Ordering::SeqCst) {
            let first = rng.gen_range(0..sectors);
            let n = rng.gen_range(1..=8.min(sectors - first));
            let off = first * SECTOR;
            let len = n * SECTOR;
            let mut exp = model.lock().unwrap();
            if write {
                let mut buf = vec![0u8; len];
                rng.fill(&mut buf[..]);
                dev.write_at(&buf, off as u64).unwrap();
                exp[off..off + len].copy_from_slice(&buf);
            }
            let mut back = vec![0u8; len];
            dev.read_at(&mut back, off as u64).unwrap();
            assert!(
                back == exp[off..off + len],
                "read at {off} ({len} bytes) differs from what was written"
            );
            drop(exp);
            done.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_micros(300));
        }
    })
}

/// Every sector of `dev` equals the model.
pub fn assert_matches_model(dev: &dyn BlockDevice, model: &[u8]) {
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0usize;
    while off < model.len() {
        let n = buf.len().min(model.len() - off);
        dev.read_at(&mut buf[..n], off as u64).unwrap();
        if buf[..n] != model[off..off + n] {
            let i = (0..n).find(|&i| buf[i] != model[off + i]).unwrap();
            panic!("destination differs from the model at byte {}", off + i);
        }
        off += n;
    }
}

/// A TCP forwarder between the source and the destination that the test can cut.
pub struct Proxy {
    pub addr: String,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    cut: Arc<AtomicBool>,
}

impl Proxy {
    pub fn start(target: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let cut = Arc::new(AtomicBool::new(false));
        let (c2, cut2) = (conns.clone(), cut.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                if cut2.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let server = TcpStream::connect(&target).unwrap();
                c2.lock().unwrap().push(client.try_clone().unwrap());
                c2.lock().unwrap().push(server.try_clone().unwrap());
                pump(client.try_clone().unwrap(), server.try_clone().unwrap());
                pump(server, client);
            }
        });
        Proxy { addr, conns, cut }
    }

    /// Breaks every connection through the proxy and refuses new ones.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

#[allow(unused_imports)]
pub use cryptblk_testutil::x509::make_credentials;
