//! The encrypted volume against an in-memory model and against the cipher applied directly.
// The block crate's test helpers (QEMU tools, the aio harness), one copy for both crates.
#[path = "../../block/tests/common/mod.rs"]
mod common;

use common::MemDevice;
use cryptblk_block::{BlockDevice, BlockErrorKind, ExtentKind, OpenOptions, RawFile};
use cryptblk_crypto::{
    portable_engine, CipherSpec, CryptoPool, Direction, SecretKey, SectorCipher,
};
use cryptblk_volume::{BackendOffset, CryptDevice, CryptLayout, IvSector};
use rand::{Rng, SeedableRng};
use std::sync::Arc;

fn cipher(sector: usize) -> Arc<dyn SectorCipher> {
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    let key = SecretKey::new(
        (0..64u8)
            .map(|i| i.wrapping_mul(37).wrapping_add(11))
            .collect(),
    );
    portable_engine().new_cipher(&spec, &key, sector).unwrap()
}

fn pool() -> Arc<CryptoPool> {
    // A low split threshold makes even small tests exercise the multi-worker path.
    Arc::new(CryptoPool::new(3).with_inline_threshold(4096))
}

fn layout(data_offset: u64, payload: u64) -> CryptLayout {
    CryptLayout {
        data_offset: BackendOffset::new(data_offset),
        payload_size: payload,
        iv_offset: IvSector::new(0),
        read_only: false,
    }
}

#[test]
fn random_io_matches_model_and_leaves_header_alone() {
    for sector in [512usize, 4096] {
        let data_offset = 8192u64;
        let payload = 4 << 20;
        let backend = Arc::new(MemDevice::new((data_offset + payload) as usize));
        backend.data.write().unwrap()[..data_offset as usize].fill(0x77);
        let dev = CryptDevice::new(
            backend.clone(),
            layout(data_offset, payload),
            cipher(sector),
            pool(),
        )
        .unwrap();
        assert_eq!(dev.size(), payload);
        assert_eq!(dev.logical_block_size() as usize, sector);

        let mut model = vec![0u8; payload as usize];
        // Start from a fully written device so that every read decrypts real ciphertext.
        dev.write_at(&model, 0).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(sector as u64);
        for i in 0..400 {
            let aligned = i % 2 == 0;
            let mut len = rng.gen_range(1..3 * 1024 * 1024usize / if i % 10 == 0 { 1 } else { 64 });
            let mut off = rng.gen_range(0..payload as usize - len);
            if aligned {
                off -= off % sector;
                len = (len / sector).max(1) * sector;
            }
            if rng.gen_bool(0.5) {
                let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                let copy = data.clone();
                dev.write_at(&data, off as u64).unwrap();
                assert_eq!(data, copy, "caller's buffer modified");
                model[off..off + len].copy_from_slice(&data);
            } else {
                let mut buf = vec![0u8; len];
                dev.read_at(&mut buf, off as u64).unwrap();
                assert!(
                    buf == model[off..off + len],
                    "read {len}@{off} (sector {sector}) differs from model"
                );
            }
        }
        let mut all = vec![0u8; payload as usize];
        dev.read_at(&mut all, 0).unwrap();
        assert!(all == model);
        let raw = backend.snapshot();
        assert!(
            raw[..data_offset as usize].iter().all(|&b| b == 0x77),
            "header region touched"
        );
        // The payload on the backend is ciphertext, not the plaintext.
        assert!(raw[data_offset as usize..] != model[..]);
        // Decrypting the backend directly gives the model.
        let mut direct = raw[data_offset as usize..].to_vec();
        cipher(sector)
            .crypt(Direction::Decrypt, 0, &mut direct)
            .unwrap();
        assert!(direct == model);
    }
}

#[test]
fn iv_numbers_count_payload_sectors_plus_offset() {
    let sector = 4096usize;
    let c = cipher(sector);
    for iv_offset in [0u64, 1000] {
        let data_offset = 2 << 20;
        let backend = Arc::new(MemDevice::new(data_offset + 64 * sector));
        let l = CryptLayout {
            data_offset: BackendOffset::new(data_offset as u64),
            payload_size: 64 * sector as u64,
            iv_offset: IvSector::new(iv_offset),
            read_only: false,
        };
        let dev = CryptDevice::new(backend.clone(), l, c.clone(), pool()).unwrap();
        let plain: Vec<u8> = (0..sector).map(|i| (i * 7 % 251) as u8).collect();
        for n in [0usize, 1, 17, 63] {
            dev.write_at(&plain, (n * sector) as u64).unwrap();
            let mut expected = plain.clone();
            c.crypt(Direction::Encrypt, n as u64 + iv_offset, &mut expected)
                .unwrap();
            let raw = backend.snapshot();
            let at = data_offset + n * sector;
            assert!(
                raw[at..at + sector] == expected[..],
                "sector {n}, iv_offset {iv_offset}"
            );
            // And not what sector numbering in 512-byte units would give.
            let mut wrong = plain.clone();
            c.crypt(Direction::Encrypt, (n * 8) as u64 + iv_offset, &mut wrong)
                .unwrap();
            assert!(n == 0 || raw[at..at + sector] != wrong[..]);
        }
    }
}

#[test]
fn concurrent_writers_on_distinct_sectors_and_distinct_bytes() {
    let sector = 512usize;
    let payload = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("payload.img");
    drop(RawFile::create(&path, 4096 + payload as u64).unwrap());
    let backend = Arc::new(
        RawFile::open(
            &path,
            OpenOptions {
                writable: true,
                lock: true,
            },
        )
        .unwrap(),
    );
    let dev = Arc::new(
        CryptDevice::new(
            backend,
            layout(4096, payload as u64),
            cipher(sector),
            pool(),
        )
        .unwrap(),
    );
    dev.write_at(&vec![0u8; payload], 0).unwrap();

    let threads = 8usize;
    std::thread::scope(|s| {
        for t in 0..threads {
            let dev = dev.clone();
            s.spawn(move || {
                // Aligned: each thread owns every 8th 4 KiB block.
                for blk in (t..payload / 4096).step_by(threads) {
                    dev.write_at(&vec![t as u8 + 1; 4096], (blk * 4096) as u64)
                        .unwrap();
                }
            });
        }
    });
    let mut all = vec![0u8; payload];
    dev.read_at(&mut all, 0).unwrap();
    for (blk, chunk) in all.chunks(4096).enumerate() {
        assert!(
            chunk.iter().all(|&b| b == (blk % threads) as u8 + 1),
            "block {blk}"
        );
    }

    // Unaligned: every thread patches its own 64-byte slot of the same 32 sectors, many times.
    // Without serialised read-modify-write some slots would revert to older contents.
    let region = 32 * sector;
    std::thread::scope(|s| {
        for t in 0..threads {
            let dev = dev.clone();
            s.spawn(move || {
                for round in 0..20u8 {
                    for sec in 0..32 {
                        let off = sec * sector + t * 64 + 1;
                        dev.write_at(
                            &[round.wrapping_mul(3).wrapping_add(t as u8); 62],
                            off as u64,
                        )
                        .unwrap();
                    }
                }
            });
        }
    });
    let mut got = vec![0u8; region];
    dev.read_at(&mut got, 0).unwrap();
    for sec in 0..32 {
        for t in 0..threads {
            let off = sec * sector + t * 64 + 1;
            let want = 19u8.wrapping_mul(3).wrapping_add(t as u8);
            assert!(
                got[off..off + 62].iter().all(|&b| b == want),
                "sector {sec} slot {t} lost an update"
            );
        }
    }
}

#[test]
fn bounds_read_only_and_layout_checks() {
    let backend = Arc::new(MemDevice::new(1 << 20));
    // Payload rounded down to whole sectors.
    let dev =
        CryptDevice::new(backend.clone(), layout(4096, 100_000), cipher(4096), pool()).unwrap();
    assert_eq!(dev.size(), 98_304);
    assert_eq!(
        dev.read_at(&mut [0u8; 2], 98_303).unwrap_err().kind(),
        BlockErrorKind::OutOfRange
    );
    assert_eq!(
        dev.write_at(&[0u8; 4096], 98_304).unwrap_err().kind(),
        BlockErrorKind::OutOfRange
    );
    let st = dev.block_status(0, u64::MAX).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Data, 98_304));

    let err =
        CryptDevice::new(backend.clone(), layout(4096, 1 << 20), cipher(512), pool()).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::OutOfRange);

    let ro = CryptLayout {
        read_only: true,
        ..layout(0, 1 << 20)
    };
    let dev = CryptDevice::new(backend, ro, cipher(512), pool()).unwrap();
    assert!(dev.read_only());
    assert_eq!(
        dev.write_at(&[0u8; 512], 0).unwrap_err().kind(),
        BlockErrorKind::ReadOnly
    );
    dev.read_at(&mut [0u8; 1000], 3).unwrap();
}

/// A backend whose writes fail while `fail` is set.
struct Flaky {
    inner: MemDevice,
    fail: std::sync::atomic::AtomicBool,
}

impl BlockDevice for Flaky {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), cryptblk_block::BlockError> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), cryptblk_block::BlockError> {
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(cryptblk_block::BlockError::io(
                "write",
                std::io::Error::from_raw_os_error(5),
            )
            .at(offset));
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), cryptblk_block::BlockError> {
        Ok(())
    }
}

#[test]
fn backend_errors_propagate_and_the_device_recovers() {
    let backend = Arc::new(Flaky {
        inner: MemDevice::new(1 << 20),
        fail: true.into(),
    });
    let dev = CryptDevice::new(backend.clone(), layout(0, 1 << 20), cipher(512), pool()).unwrap();
    for (len, off) in [(3 << 20 >> 2, 0u64), (100, 7)] {
        let err = dev.write_at(&vec![9u8; len], off).unwrap_err();
        assert_eq!(err.kind(), BlockErrorKind::Io, "{err}");
    }
    backend
        .fail
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let data = vec![0x5au8; 5000];
    dev.write_at(&data, 333).unwrap();
    let mut back = vec![0u8; 5000];
    dev.read_at(&mut back, 333).unwrap();
    assert_eq!(back, data);
}

#[test]
fn discard_punches_whole_sectors_only_and_keeps_the_rest() {
    let sector = 4096u64;
    let data_offset = 8192u64;
    let payload = 1u64 << 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("discard.img");
    drop(RawFile::create(&path, data_offset + payload).unwrap());
    let rw = OpenOptions {
        writable: true,
        lock: true,
    };
    let backend = Arc::new(RawFile::open(&path, rw).unwrap());
    let dev = CryptDevice::new(
        backend.clone(),
        layout(data_offset, payload),
        cipher(sector as usize),
        pool(),
    )
    .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let model: Vec<u8> = (0..payload).map(|_| rng.gen()).collect();
    dev.write_at(&model, 0).unwrap();
    backend.write_at(&[0x77u8; 8192], 0).unwrap();

    // Sectors 4..8 are whole inside the range; the partial sectors 3 and 8 are left alone.
    let start = 3 * sector + 100;
    let end = 8 * sector + 5;
    dev.discard(start, end - start).unwrap();
    let st = backend
        .block_status(data_offset + 4 * sector, payload)
        .unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Unallocated, 4 * sector));
    let st = backend.block_status(0, payload).unwrap();
    assert_eq!(
        (st.kind, st.len),
        (ExtentKind::Data, data_offset + 4 * sector)
    );

    let mut back = vec![0u8; payload as usize];
    dev.read_at(&mut back, 0).unwrap();
    let (a, b) = ((4 * sector) as usize, (8 * sector) as usize);
    assert_eq!(back[..a], model[..a]);
    assert_eq!(back[b..], model[b..]);
    // Like dm-crypt allow_discards: the discarded range decrypts to garbage, not zeros.
    assert_ne!(back[a..b], model[a..b]);
    assert!(back[a..b].iter().any(|&x| x != 0));
    // The header region before the payload is untouched.
    let mut hdr = [0u8; 8192];
    backend.read_at(&mut hdr, 0).unwrap();
    assert!(hdr.iter().all(|&x| x == 0x77));

    // A range inside one sector discards nothing.
    dev.discard(10 * sector + 1, sector - 2).unwrap();
    dev.read_at(&mut back[..sector as usize], 10 * sector)
        .unwrap();
    assert_eq!(
        back[..sector as usize],
        model[(10 * sector) as usize..(11 * sector) as usize]
    );
    assert_eq!(
        dev.discard(payload - sector, 2 * sector)
            .unwrap_err()
            .kind(),
        BlockErrorKind::OutOfRange
    );

    let ro = CryptDevice::new(
        backend.clone(),
        CryptLayout {
            read_only: true,
            ..layout(data_offset, payload)
        },
        cipher(sector as usize),
        pool(),
    )
    .unwrap();
    assert_eq!(
        ro.discard(0, sector).unwrap_err().kind(),
        BlockErrorKind::ReadOnly
    );
    // A backend without discard support reports Unsupported through the volume.
    let mem = Arc::new(MemDevice::new((data_offset + payload) as usize));
    let on_mem = CryptDevice::new(mem, layout(data_offset, payload), cipher(512), pool()).unwrap();
    assert_eq!(
        on_mem.discard(0, 4096).unwrap_err().kind(),
        BlockErrorKind::Unsupported
    );
}
