//! The volume's segment map during an online reencryption: the new cipher below the boundary,
//! the old one above, the hotzone fenced off. Requests through the queue (fast path and the
//! synchronous path it hands crossings to) and through the synchronous methods must read back
//! what was written, and land on the backend under the right key, at every stage: split,
//! a hotzone announced, the boundary moved, finished.
// The block crate's test helpers (QEMU tools, the aio harness), one copy for both crates.
#[path = "../../block/tests/common/mod.rs"]
mod common;

use common::aio::{exercise, run};
use common::MemDevice;
use cryptblk_block::aio::{IoQueue, IoRequest, QueueOptions};
use cryptblk_block::open_queue;
use cryptblk_block::BlockDevice;
use cryptblk_crypto::{portable_engine, CipherSpec, CryptoPool, SecretKey, SectorCipher};
use cryptblk_volume::{BackendOffset, CryptDevice, CryptLayout, IvSector};
use rand::{RngCore, SeedableRng};
use std::sync::Arc;

const DATA_OFFSET: u64 = 4096;
const PAYLOAD: u64 = 2 << 20;

fn cipher(sector: usize, seed: u8) -> Arc<dyn SectorCipher> {
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    let key = SecretKey::new((0..64u8).map(|i| i.wrapping_mul(seed) ^ 0x5a).collect());
    portable_engine().new_cipher(&spec, &key, sector).unwrap()
}

fn device(backend: &Arc<MemDevice>, c: Arc<dyn SectorCipher>) -> CryptDevice {
    let layout = CryptLayout {
        data_offset: BackendOffset::new(DATA_OFFSET),
        payload_size: PAYLOAD,
        iv_offset: IvSector::new(0),
        read_only: false,
    };
    CryptDevice::new(backend.clone(), layout, c, Arc::new(CryptoPool::new(2))).unwrap()
}

/// What the backend holds, decrypted with `old` above `boundary` and `new` below it.
fn decrypted(backend: &Arc<MemDevice>, boundary: u64) -> Vec<u8> {
    let mut out = vec![0u8; PAYLOAD as usize];
    let (lo, hi) = out.split_at_mut(boundary as usize);
    device(backend, cipher(4096, 7)).read_at(lo, 0).unwrap();
    device(backend, cipher(512, 3))
        .read_at(hi, boundary)
        .unwrap();
    out
}

/// Rewrites `[from, to)` from the old cipher to the new one, as a reencryption's step does.
fn rewrite(backend: &Arc<MemDevice>, from: u64, to: u64) {
    let mut buf = vec![0u8; (to - from) as usize];
    device(backend, cipher(512, 3))
        .read_at(&mut buf, from)
        .unwrap();
    device(backend, cipher(4096, 7))
        .write_at(&buf, from)
        .unwrap();
}

fn check(dev: &CryptDevice, queue: &mut dyn IoQueue, model: &mut [u8], seed: u64) {
    // 512-byte units: below the boundary (4096-byte sectors) these mix in read-modify-write.
    exercise(queue, model, 16, 12, seed, 512);
    exercise(queue, model, 16, 12, seed + 1, 4096);
    run(queue, &IoRequest::flush(1)).unwrap();
    let mut all = vec![0u8; PAYLOAD as usize];
    dev.read_at(&mut all, 0).unwrap();
    assert!(all == model, "seed {seed}: the synchronous view differs");
}

#[test]
fn requests_follow_the_boundary_through_a_reencryption() {
    let backend = Arc::new(MemDevice::new((DATA_OFFSET + PAYLOAD) as usize));
    let dev = Arc::new(device(&backend, cipher(512, 3)));
    let mut model = vec![0u8; PAYLOAD as usize];
    rand::rngs::StdRng::seed_from_u64(1).fill_bytes(&mut model);
    dev.write_at(&model, 0).unwrap();
    let map = dev.segments().clone();
    let as_block: Arc<dyn BlockDevice> = dev.clone();
    let mut queue = open_queue(&as_block, &QueueOptions { depth: 32 }).unwrap();

    // Split at 512 KiB: what is below was rewritten "before", the rest is old.
    let mut at = 512 * 1024;
    rewrite(&backend, 0, at);
    map.split(cipher(4096, 7), at).unwrap();
    check(&dev, &mut *queue, &mut model, 10);
    assert!(
        decrypted(&backend, at) == model,
        "keys on the backend after split"
    );

    // Hotzones of 192 KiB, as the driver runs them, with I/O between.
    let mut seed = 20;
    while at < PAYLOAD {
        let end = (at + 192 * 1024).min(PAYLOAD);
        map.announce(end).unwrap();
        check(&dev, &mut *queue, &mut model, seed);
        {
            let lock = map.hotzone_write();
            rewrite(&backend, at, end);
            map.advance(&lock, end).unwrap();
        }
        at = end;
        assert!(
            decrypted(&backend, at) == model,
            "keys on the backend at {at}"
        );
        check(&dev, &mut *queue, &mut model, seed + 5);
        seed += 10;
    }
    map.finish().unwrap();
    check(&dev, &mut *queue, &mut model, 99);
    assert!(
        decrypted(&backend, PAYLOAD) == model,
        "all under the new key"
    );
    assert!(!map.is_split());
}

/// A disk grown after its reencryption finished: the payload's new end holds for the new
/// cipher's queue path and for the synchronous path it hands unaligned requests to (one size
/// shared by every core of the payload and the segment map).
#[test]
fn a_resize_after_a_reencryption_reaches_both_paths() {
    let backend = Arc::new(MemDevice::new((DATA_OFFSET + 2 * PAYLOAD) as usize));
    let dev = Arc::new(device(&backend, cipher(512, 3)));
    let map = dev.segments().clone();
    rewrite(&backend, 0, PAYLOAD);
    map.split(cipher(4096, 7), PAYLOAD).unwrap();
    map.finish().unwrap();
    assert!(
        dev.set_size(2 * PAYLOAD - 512).is_err(),
        "a size off the new cipher's 4096-byte sectors"
    );
    dev.set_size(2 * PAYLOAD).unwrap();
    assert_eq!(dev.size(), 2 * PAYLOAD);
    let as_block: Arc<dyn BlockDevice> = dev.clone();
    let mut queue = open_queue(&as_block, &QueueOptions { depth: 32 }).unwrap();
    let mut model = vec![0u8; (2 * PAYLOAD) as usize];
    dev.read_at(&mut model, 0).unwrap();
    // 512-byte units go through the synchronous path (read-modify-write of 4096-byte sectors).
    exercise(&mut *queue, &mut model, 16, 12, 7, 512);
    exercise(&mut *queue, &mut model, 16, 12, 8, 4096);
    run(&mut *queue, &IoRequest::flush(1)).unwrap();
    let mut all = vec![0u8; model.len()];
    dev.read_at(&mut all, 0).unwrap();
    assert!(all == model, "the grown payload reads back as written");
}
