//! A raw disk served as a one-part plaintext volume, then encrypted in place the way an
//! online encryption does it, the segment map following the LUKS2 header's live segments at
//! each step (`SegmentMap::follow`): the first bytes of the disk moved to the image's end
//! while the header takes their place, plaintext in place below the boundary, ciphertext one
//! data shift higher above it, hotzones fenced off while they are rewritten. Requests through
//! a queue (fast path, and the synchronous path it hands the rest to) and through the
//! synchronous methods must read back what was written at every step, and the backend must
//! end up as an ordinary encrypted payload behind the header.
// The block crate's test helpers (QEMU tools, the aio harness), one copy for both crates.
#[path = "../../block/tests/common/mod.rs"]
mod common;

use common::aio::{exercise, run};
use common::MemDevice;
use cryptblk_block::aio::{IoQueue, IoRequest, QueueOptions};
use cryptblk_block::open_queue;
use cryptblk_block::BlockDevice;
use cryptblk_crypto::{portable_engine, CipherSpec, CryptoPool, SecretKey, SectorCipher};
use cryptblk_luks::luks2::reencrypt::{ExtentCipher, KeyRole, SegmentExtent};
use cryptblk_volume::{BackendOffset, CryptDevice, CryptLayout, IvSector, SegmentCiphers};
use rand::{RngCore, SeedableRng};
use std::sync::Arc;

/// The disk the guest sees.
const DISK: u64 = 2 << 20;
/// The data shift (half of `--reduce-device-size`): the header's room, and how far up the
/// ciphertext lies.
const SHIFT: u64 = 256 << 10;
const HOTZONE: u64 = 192 << 10;

fn cipher(sector: usize) -> Arc<dyn SectorCipher> {
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", 64).unwrap();
    let key = SecretKey::new((0..64u8).map(|i| i.wrapping_mul(29) ^ 0xa5).collect());
    portable_engine().new_cipher(&spec, &key, sector).unwrap()
}

fn pool() -> Arc<CryptoPool> {
    Arc::new(CryptoPool::new(2))
}

/// The volume the encryption ends with: the payload behind the header.
fn encrypted(backend: &Arc<MemDevice>, sector: usize) -> CryptDevice {
    let layout = CryptLayout {
        data_offset: BackendOffset::new(SHIFT),
        payload_size: DISK,
        iv_offset: IvSector::new(0),
        read_only: false,
    };
    CryptDevice::new(backend.clone(), layout, cipher(sector), pool()).unwrap()
}

fn extent(
    id: usize,
    start: u64,
    end: u64,
    device_offset: u64,
    cipher: ExtentCipher,
) -> SegmentExtent {
    SegmentExtent {
        id: id.to_string(),
        logical_start: start,
        len: end - start,
        device_offset,
        cipher,
        in_reencryption: false,
    }
}

/// The live segments once `[boundary, DISK)` is encrypted, as the header lists them.
fn live(boundary: u64, sector: u32) -> Vec<SegmentExtent> {
    let crypt = |start: u64| ExtentCipher::Crypt {
        role: KeyRole::New,
        encryption: "aes-xts-plain64".into(),
        sector_size: sector,
        iv_tweak: start / 512,
    };
    if boundary == 0 {
        return vec![extent(0, 0, DISK, SHIFT, crypt(0))];
    }
    let mut out = vec![extent(0, 0, SHIFT, DISK + SHIFT, ExtentCipher::Plain)];
    if boundary > SHIFT {
        out.push(extent(1, SHIFT, boundary, SHIFT, ExtentCipher::Plain));
    }
    if boundary < DISK {
        out.push(extent(
            out.len(),
            boundary,
            DISK,
            boundary + SHIFT,
            crypt(boundary),
        ));
    }
    out
}

fn check(dev: &CryptDevice, queue: &mut dyn IoQueue, model: &mut [u8], seed: u64, unit: usize) {
    exercise(queue, model, 16, 10, seed, unit);
    run(queue, &IoRequest::flush(1)).unwrap();
    let mut all = vec![0u8; DISK as usize];
    dev.read_at(&mut all, 0).unwrap();
    assert!(all == model, "seed {seed}: the synchronous view differs");
}

fn encrypt_in_place(sector: usize) {
    let backend = Arc::new(MemDevice::new((DISK + 2 * SHIFT) as usize));
    let mut model = vec![0u8; DISK as usize];
    rand::rngs::StdRng::seed_from_u64(5).fill_bytes(&mut model);
    backend.write_at(&model, 0).unwrap();
    let dev = Arc::new(CryptDevice::plaintext(backend.clone(), false));
    // The image is already grown by the header area here (the daemon grows it at the start):
    // the disk is what the guest was told.
    dev.set_size(DISK).unwrap();
    assert!(dev.segments().is_plaintext() && dev.cipher().is_none());
    let map = dev.segments().clone();
    let as_block: Arc<dyn BlockDevice> = dev.clone();
    let mut queue = open_queue(&as_block, &QueueOptions { depth: 32 }).unwrap();
    // Plaintext serves any alignment, byte for byte at the same offsets.
    check(&dev, &mut *queue, &mut model, 1, 512);
    check(&dev, &mut *queue, &mut model, 2, 1);
    assert!(backend.snapshot()[..DISK as usize] == model[..]);

    let ciphers = SegmentCiphers {
        old: None,
        new: Some(cipher(sector)),
        pool: pool(),
    };
    // The start: the first SHIFT bytes go to the end, the header over them.
    map.fence(0, SHIFT).unwrap();
    {
        let lock = map.hotzone_write();
        let head = backend.snapshot()[..SHIFT as usize].to_vec();
        backend.write_at(&head, DISK + SHIFT).unwrap();
        backend.write_at(&vec![0x4c; SHIFT as usize], 0).unwrap();
        map.follow(&lock, &live(DISK, sector as u32), &ciphers, true)
            .unwrap();
    }
    assert!(map.is_split() && map.is_plaintext());
    check(&dev, &mut *queue, &mut model, 3, 512);
    assert!(
        backend.snapshot()[..SHIFT as usize]
            .iter()
            .all(|&b| b == 0x4c),
        "the header's bytes stay untouched"
    );

    // Hotzones down from the end, with I/O while each is fenced and after it.
    let mut boundary = DISK;
    let mut seed = 10;
    while boundary > 0 {
        let from = if boundary > SHIFT {
            boundary - HOTZONE.min(boundary - SHIFT)
        } else {
            0
        };
        map.fence(from, boundary).unwrap();
        check(&dev, &mut *queue, &mut model, seed, 512);
        {
            let lock = map.hotzone_write();
            // The plaintext source: in place, or (the first SHIFT bytes) the moved copy.
            let source = if from == 0 { DISK + SHIFT } else { from };
            let mut plain = vec![0u8; (boundary - from) as usize];
            backend.read_at(&mut plain, source).unwrap();
            encrypted(&backend, sector).write_at(&plain, from).unwrap();
            map.follow(&lock, &live(from, sector as u32), &ciphers, from > 0)
                .unwrap();
        }
        boundary = from;
        check(&dev, &mut *queue, &mut model, seed + 1, 512);
        check(&dev, &mut *queue, &mut model, seed + 2, sector);
        seed += 10;
    }
    assert!(!map.is_split() && !map.is_plaintext());
    assert!(dev.cipher().is_some());
    // The backend is an ordinary encrypted payload behind the header now.
    let mut all = vec![0u8; DISK as usize];
    encrypted(&backend, sector).read_at(&mut all, 0).unwrap();
    assert!(all == model, "the backend decrypts to what was written");
    assert!(
        backend.snapshot()[..SHIFT as usize]
            .iter()
            .all(|&b| b == 0x4c),
        "the header's bytes stay untouched"
    );
    // The volume keeps the size the guest saw.
    assert_eq!(dev.size(), DISK);
}

#[test]
fn a_raw_disk_encrypted_in_place_reads_back_at_every_step() {
    encrypt_in_place(512);
}

#[test]
fn a_raw_disk_encrypted_in_place_with_4k_sectors_reads_back_at_every_step() {
    encrypt_in_place(4096);
}

/// A layout whose parts are not the header's (a hotzone still flagged, a segment below its
/// volume offset) is refused, and the map keeps serving what it served.
#[test]
fn follow_refuses_what_it_cannot_serve() {
    let backend = Arc::new(MemDevice::new((DISK + 2 * SHIFT) as usize));
    let dev = CryptDevice::plaintext(backend, false);
    let map = dev.segments().clone();
    let ciphers = SegmentCiphers {
        old: None,
        new: None,
        pool: pool(),
    };
    let lock = map.hotzone_write();
    let mut flagged = live(DISK - HOTZONE, 512);
    flagged[2].in_reencryption = true;
    let e = map.follow(&lock, &flagged, &ciphers, true).unwrap_err();
    assert!(e.to_string().contains("recovered first"), "{e}");
    let e = map
        .follow(&lock, &live(DISK - HOTZONE, 512), &ciphers, true)
        .unwrap_err();
    assert!(e.to_string().contains("not unlocked"), "{e}");
    let mut below = live(DISK, 512);
    below[1].device_offset = 0;
    let e = map.follow(&lock, &below, &ciphers, true).unwrap_err();
    assert!(e.to_string().contains("below its volume offset"), "{e}");
    assert!(!map.is_split() && map.is_plaintext());
}
