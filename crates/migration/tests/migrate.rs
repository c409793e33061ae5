//! End-to-end migrations over real sockets: a sender thread and a receiver thread on the two
//! ends of a `UnixStream::pair()`, moving real raw and LUKS2 image files.

use cryptblk_block::{
    open_luks_volume, BlockDevice, ExtentKind, LuksVolume, OpenOptions, RawFile, VolumeOptions,
};
use cryptblk_migration::wire::{self, Frame, Hello, WireError};
use cryptblk_migration::{
    final_pass, receive, send_precopy, DirtyTracker, MigrationError, PrecopyOptions, ReceiveStats,
    SendStats, PROTOCOL_VERSION,
};
use rand::{Rng, SeedableRng};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PW: &[u8] = b"migration test passphrase";

fn rw(path: &Path) -> RawFile {
    RawFile::open(
        path,
        OpenOptions {
            writable: true,
            lock: true,
        },
    )
    .unwrap()
}

fn spawn_receiver(
    dst: &Path,
    mut stream: UnixStream,
) -> std::thread::JoinHandle<Result<ReceiveStats, MigrationError>> {
    let dst = dst.to_path_buf();
    std::thread::spawn(move || {
        let file = rw(&dst);
        receive(&file, &mut stream)
    })
}

/// Precopy then final pass of a quiescent source.
fn migrate(
    file: &RawFile,
    tracker: &DirtyTracker,
    dst: &Path,
    opts: &PrecopyOptions,
) -> (SendStats, ReceiveStats) {
    let (mut a, b) = UnixStream::pair().unwrap();
    let rx = spawn_receiver(dst, b);
    let pre = send_precopy(file, tracker, &mut a, opts).unwrap();
    let total = final_pass(file, tracker, &mut a, opts, &pre).unwrap();
    let got = rx.join().unwrap().unwrap();
    (total, got)
}

#[test]
fn raw_file_with_holes_migrates_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (dir.path().join("src.raw"), dir.path().join("dst.raw"));
    let size = 16u64 << 20;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    {
        let f = RawFile::create(&src, size).unwrap();
        // Data islands separated by holes, one of them unaligned and one at the very end.
        for (off, len) in [
            (0u64, 64 << 10),
            (1 << 20, 300_000),
            (5 << 20, 4096),
            (9 << 20, 2 << 20),
            (size - 8192, 8192),
        ] {
            let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            f.write_at(&data, off).unwrap();
        }
    }
    drop(RawFile::create(&dst, size).unwrap());
    let file = Arc::new(rw(&src));
    let tracker = DirtyTracker::new(file.clone(), 0, 4096).unwrap();
    let opts = PrecopyOptions {
        chunk_size: 256 << 10,
        ..Default::default()
    };
    let (sent, got) = migrate(&file, &tracker, &dst, &opts);

    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
    assert!(sent.zero_bytes > 0, "holes were sent as data: {sent:?}");
    assert!(sent.bytes_sent < size, "{sent:?}");
    assert_eq!(got.bytes_written, sent.bytes_sent);
    assert_eq!(
        got.received.count(),
        got.received.blocks(),
        "every block accounted for"
    );
    // Holes stay holes, where the filesystem has them at all.
    let dstf = RawFile::open(&dst, OpenOptions::default()).unwrap();
    if file.block_status(3 << 20, 4096).unwrap().kind == ExtentKind::Unallocated {
        assert_eq!(
            dstf.block_status(3 << 20, 4096).unwrap().kind,
            ExtentKind::Unallocated
        );
    }
}

/// A discard through the tracker becomes a hole on the destination, a write a chunk.
#[test]
fn raw_dirty_writes_and_discards_are_resent() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (dir.path().join("src.raw"), dir.path().join("dst.raw"));
    let size = 4u64 << 20;
    std::fs::write(&src, vec![0x5a; size as usize]).unwrap();
    drop(RawFile::create(&dst, size).unwrap());
    let file = Arc::new(rw(&src));
    let tracker = DirtyTracker::new(file.clone(), 0, 4096).unwrap();
    let (mut a, b) = UnixStream::pair().unwrap();
    let rx = spawn_receiver(&dst, b);
    let opts = PrecopyOptions {
        converge_bytes: u64::MAX, // stop after pass 1
        ..Default::default()
    };
    let pre = send_precopy(&*file, &tracker, &mut a, &opts).unwrap();
    assert_eq!(pre.passes, 1);
    tracker.write_at(&[0xc3; 100], 10_000).unwrap(); // dirties one 4 KiB block
    tracker.discard(1 << 20, 64 << 10).unwrap();
    assert_eq!(tracker.bitmap().count(), 1 + 16);
    let total = final_pass(&*file, &tracker, &mut a, &opts, &pre).unwrap();
    assert_eq!(total.passes, 2);
    assert_eq!(tracker.bitmap().count(), 0);
    rx.join().unwrap().unwrap();
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
}

fn format_luks2(
    path: &Path,
    payload: u64,
) -> (cryptblk_luks::LuksImage, cryptblk_crypto::SecretKey) {
    use cryptblk_crypto::CipherSpec;
    use cryptblk_luks::{FormatOptions, HashAlg, LuksImage, LuksVersion, PbkdfKind, PbkdfOptions};
    let opts = FormatOptions {
        version: LuksVersion::V2,
        cipher: CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap(),
        hash: HashAlg::Sha256,
        pbkdf: PbkdfOptions {
            kind: PbkdfKind::Pbkdf2,
            hash: HashAlg::Sha256,
            iter_time_ms: 10,
            memory_kib: 0,
            parallel: 1,
            force_iterations: Some(1000),
        },
        sector_size: 4096,
        label: None,
        uuid: None,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .unwrap();
    LuksImage::format(&file, &opts, PW, Some(payload)).unwrap()
}

/// The real thing: a LUKS2 volume keeps taking verified writes while precopy copies its
/// ciphertext; after the writer stops, the final pass; then the destination, unlocked with the
/// same passphrase, must hold exactly what the guest wrote.
#[test]
fn luks2_volume_migrates_under_concurrent_writes() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (dir.path().join("src.luks"), dir.path().join("dst.luks"));
    let payload = 8u64 << 20;
    const SECTOR: usize = 4096;
    let (header, key) = format_luks2(&src, payload);
    let data_offset = header.data_offset();
    let raw = Arc::new(rw(&src));
    let file_size = raw.size();
    let vol = LuksVolume::from_unlocked(
        raw.clone(),
        header,
        0,
        &key,
        Arc::new(cryptblk_crypto::CryptoPool::new(2)),
    )
    .unwrap();
    let vol: Arc<dyn BlockDevice> = Arc::new(vol);
    let tracker = Arc::new(DirtyTracker::new(vol, data_offset, SECTOR as u64).unwrap());

    // Initial contents: every sector holds its own pattern.
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    let mut initial = vec![0u8; payload as usize];
    rng.fill(&mut initial[..]);
    tracker.write_at(&initial, 0).unwrap();
    let expected = Arc::new(Mutex::new(initial));

    drop(RawFile::create(&dst, file_size).unwrap());
    let (mut a, b) = UnixStream::pair().unwrap();
    let rx = spawn_receiver(&dst, b);

    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let writer = {
        let (tracker, expected, stop, writes) = (
            tracker.clone(),
            expected.clone(),
            stop.clone(),
            writes.clone(),
        );
        std::thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(3);
            let sectors = payload as usize / SECTOR;
            while !stop.load(Ordering::SeqCst) {
                let first = rng.gen_range(0..sectors);
                let n = rng.gen_range(1..=4.min(sectors - first));
                let off = first * SECTOR;
                let mut buf = vec![0u8; n * SECTOR];
                rng.fill(&mut buf[..]);
                // Only one writer, so holding the model's lock around the write is not needed
                // for ordering; it is held so the model and the disk never disagree.
                let mut exp = expected.lock().unwrap();
                tracker.write_at(&buf, off as u64).unwrap();
                let mut back = vec![0u8; buf.len()];
                tracker.read_at(&mut back, off as u64).unwrap();
                assert_eq!(back, buf, "verified write at {off}");
                exp[off..off + buf.len()].copy_from_slice(&buf);
                drop(exp);
                writes.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };

    // Slow enough that the writer overlaps every pass.
    let opts = PrecopyOptions {
        chunk_size: 128 << 10,
        max_passes: 4,
        converge_bytes: 0,
        max_bandwidth: Some(32 << 20),
    };
    let pre = send_precopy(&*raw, &tracker, &mut a, &opts).unwrap();
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    let writes_during = writes.load(Ordering::SeqCst);
    assert!(writes_during > 0, "the writer never ran during precopy");
    assert!(pre.passes >= 2, "{pre:?}");
    let total = final_pass(&*raw, &tracker, &mut a, &opts, &pre).unwrap();
    let got = rx.join().unwrap().unwrap();
    assert_eq!(got.header_len, data_offset);
    assert_eq!(total.dirty_left, 0);
    assert!(total.bytes_sent > file_size - data_offset, "{total:?}");

    // Ciphertext identical, and the destination decrypts to exactly what was written.
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
    drop(tracker);
    drop(raw);
    let dvol = open_luks_volume(&dst, PW, &VolumeOptions::default()).unwrap();
    let exp = expected.lock().unwrap();
    let mut buf = vec![0u8; SECTOR];
    for s in 0..payload as usize / SECTOR {
        dvol.read_at(&mut buf, (s * SECTOR) as u64).unwrap();
        assert!(
            buf == exp[s * SECTOR..(s + 1) * SECTOR],
            "sector {s} differs"
        );
    }
    eprintln!("{writes_during} guest writes during precopy; sent {total:?}");
}

/// Writes `frames` as a hostile sender would after a correct handshake, and returns the
/// receiver's error and what it told the sender.
fn hostile(dst: &Path, size: u64, frames: &[u8], handshake: bool) -> (MigrationError, String) {
    let (mut a, b) = UnixStream::pair().unwrap();
    let rx = spawn_receiver(dst, b);
    if handshake {
        wire::write_frame(
            &mut a,
            &Frame::Hello(Hello {
                version: PROTOCOL_VERSION,
                disk_size_bytes: size,
                granularity: 4096,
                header_len: 0,
            }),
        )
        .unwrap();
        assert!(matches!(wire::read_frame(&mut a).unwrap(), Frame::Hello(_)));
    }
    // The receiver may hang up before reading it all.
    let _ = a.write_all(frames);
    let err = rx.join().unwrap().unwrap_err();
    let mut told = String::new();
    loop {
        match wire::read_frame(&mut a) {
            Ok(Frame::Error { message }) => told = message,
            Ok(_) => continue,
            Err(_) => break,
        }
    }
    (err, told)
}

#[test]
fn bad_input_is_refused_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("dst.raw");
    let size = 1u64 << 20;
    let original = vec![0xaau8; size as usize];
    std::fs::write(&dst, &original).unwrap();
    let unchanged = || {
        assert!(
            std::fs::read(&dst).unwrap() == original,
            "destination modified"
        )
    };

    // Wrong checksum: one data bit flipped after the checksum was computed.
    let mut bad = Frame::chunk(8192, vec![1u8; 4096]).encode();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    let (err, told) = hostile(&dst, size, &bad, true);
    assert!(
        matches!(
            err,
            MigrationError::Wire(WireError::ChecksumMismatch { offset: 8192, .. })
        ),
        "{err}"
    );
    assert!(told.contains("checksum"), "{told}");
    unchanged();

    // A chunk reaching past the end of the disk (valid checksum).
    let beyond = Frame::chunk(size - 100, vec![2u8; 200]).encode();
    let (err, told) = hostile(&dst, size, &beyond, true);
    assert!(matches!(err, MigrationError::OutOfRange { .. }), "{err}");
    assert!(told.contains("outside"), "{told}");
    unchanged();
    // ... and a hole range past the end.
    let zero = Frame::Zero {
        offset: 4096,
        len: size,
    }
    .encode();
    let (err, _) = hostile(&dst, size, &zero, true);
    assert!(matches!(err, MigrationError::OutOfRange { .. }), "{err}");
    unchanged();

    // A good chunk followed by a bad one: the good one lands, the bad one does not.
    let mut two = Frame::chunk(0, vec![3u8; 512]).encode();
    let mut second = Frame::chunk(4096, vec![4u8; 512]).encode();
    second[HEADER_CHECKSUM_BYTE] ^= 0x80;
    two.extend_from_slice(&second);
    let (err, _) = hostile(&dst, size, &two, true);
    assert!(
        matches!(
            err,
            MigrationError::Wire(WireError::ChecksumMismatch { .. })
        ),
        "{err}"
    );
    let now = std::fs::read(&dst).unwrap();
    assert!(now[..512].iter().all(|&b| b == 3));
    assert!(now[512..].iter().zip(&original[512..]).all(|(a, b)| a == b));
    std::fs::write(&dst, &original).unwrap();

    // Version mismatch, as the receiver sees it.
    let hello = Frame::Hello(Hello {
        version: PROTOCOL_VERSION + 1,
        disk_size_bytes: size,
        granularity: 4096,
        header_len: 0,
    })
    .encode();
    let (err, told) = hostile(&dst, size, &hello, false);
    assert!(
        matches!(err, MigrationError::VersionMismatch { .. }),
        "{err}"
    );
    assert!(told.contains("version"), "{told}");
    unchanged();

    // Random garbage instead of a Hello, and after one.
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let garbage: Vec<u8> = (0..4096).map(|_| rng.gen()).collect();
    let (err, _) = hostile(&dst, size, &garbage, false);
    assert!(
        matches!(err, MigrationError::Wire(WireError::BadMagic(_))),
        "{err}"
    );
    let (err, told) = hostile(&dst, size, &garbage, true);
    assert!(
        matches!(err, MigrationError::Wire(WireError::BadMagic(_))),
        "{err}"
    );
    assert!(told.contains("magic"), "{told}");
    unchanged();
}

/// Byte offset (within an encoded chunk frame) of the first checksum byte.
const HEADER_CHECKSUM_BYTE: usize = wire::HEADER_LEN + 8;

/// Both real endpoints refuse a size mismatch, each with a typed error.
#[test]
fn size_mismatch_is_refused_on_both_sides() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (dir.path().join("src.raw"), dir.path().join("dst.raw"));
    std::fs::write(&src, vec![1u8; 1 << 20]).unwrap();
    let original = vec![0xeeu8; 2 << 20];
    std::fs::write(&dst, &original).unwrap();
    let file = Arc::new(rw(&src));
    let tracker = DirtyTracker::new(file.clone(), 0, 4096).unwrap();
    let (mut a, b) = UnixStream::pair().unwrap();
    let rx = spawn_receiver(&dst, b);
    let err = send_precopy(&*file, &tracker, &mut a, &PrecopyOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            MigrationError::SizeMismatch {
                ours: 1048576,
                theirs: 2097152
            }
        ),
        "{err}"
    );
    let rerr = rx.join().unwrap().unwrap_err();
    assert!(
        matches!(rerr, MigrationError::SizeMismatch { .. }),
        "{rerr}"
    );
    assert!(rerr.to_string().contains("size mismatch"), "{rerr}");
    assert!(std::fs::read(&dst).unwrap() == original);
}

/// The real sender refuses a receiver that speaks another version.
#[test]
fn sender_refuses_other_version() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.raw");
    std::fs::write(&src, vec![1u8; 1 << 20]).unwrap();
    let file = Arc::new(rw(&src));
    let tracker = DirtyTracker::new(file.clone(), 0, 4096).unwrap();
    let (mut a, mut b) = UnixStream::pair().unwrap();
    let peer = std::thread::spawn(move || {
        let Frame::Hello(h) = wire::read_frame(&mut b).unwrap() else {
            panic!("expected Hello")
        };
        wire::write_frame(
            &mut b,
            &Frame::Hello(Hello {
                version: h.version + 7,
                ..h
            }),
        )
        .unwrap();
        wire::read_frame(&mut b).unwrap()
    });
    let err = send_precopy(&*file, &tracker, &mut a, &PrecopyOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            MigrationError::VersionMismatch {
                ours: PROTOCOL_VERSION,
                ..
            }
        ),
        "{err}"
    );
    let Frame::Error { message } = peer.join().unwrap() else {
        panic!("the sender did not explain")
    };
    assert!(message.contains("version"), "{message}");
}

/// The limit is a floor on time taken; only a lower bound is asserted, so slow machines pass.
#[test]
fn bandwidth_limit_is_respected() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (dir.path().join("src.raw"), dir.path().join("dst.raw"));
    let size = 4u64 << 20;
    std::fs::write(&src, vec![7u8; size as usize]).unwrap();
    drop(RawFile::create(&dst, size).unwrap());
    let file = Arc::new(rw(&src));
    let tracker = DirtyTracker::new(file.clone(), 0, 4096).unwrap();
    let rate = 8u64 << 20;
    let opts = PrecopyOptions {
        chunk_size: 256 << 10,
        max_bandwidth: Some(rate),
        ..Default::default()
    };
    let t = Instant::now();
    let (sent, _) = migrate(&file, &tracker, &dst, &opts);
    let elapsed = t.elapsed();
    assert_eq!(sent.bytes_sent, size);
    // 4 MiB at 8 MiB/s: at least 0.5 s (a little slack for timer granularity).
    assert!(elapsed >= Duration::from_millis(450), "{elapsed:?}");
    assert!(
        sent.throughput_bytes_per_sec <= rate as f64 * 1.15,
        "{sent:?}"
    );
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
}
