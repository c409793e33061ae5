//! Drives `Server` over a real vhost-user socket with the in-repo frontend in `common`:
//! the device a guest negotiates (features, config space, the write cache, without
//! EVENT_IDX), every request type and its status byte, out-of-range requests, read-only
//! exports, and a LUKS2 image. Bad chains and concurrent queues are in `serve_queues.rs`,
//! discard in `serve_discard.rs`.
mod common;

use common::{luks2_image, open_luks2_writable, open_raw, opts, pattern, raw_image};
use common::{Daemon, Guest, MIB, PW};
use common::{S_IOERR, S_OK, S_UNSUPP};
use cryptblk_block::BlockDevice;
use cryptblk_volume::{open_luks_volume, VolumeOptions};

#[test]
fn config_space_and_features() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), 8 * MIB);
    let daemon = Daemon::start(open_raw(&img, true), opts(2));
    let mut guest = Guest::connect(&daemon.socket, 2, 256);
    let f = guest.features;
    // VERSION_1, EVENT_IDX, SIZE_MAX, SEG_MAX, BLK_SIZE, FLUSH, TOPOLOGY, CONFIG_WCE, MQ,
    // WRITE_ZEROES.
    for bit in [32u32, 29, 1, 2, 6, 9, 10, 11, 12, 14] {
        assert!(f & (1 << bit) != 0, "feature bit {bit} missing: {f:#x}");
    }
    assert!(f & (1 << 5) == 0, "RO offered for a writable disk");
    assert!(f & (1 << 13) == 0, "DISCARD offered without being enabled");
    let cfg = guest.config(0, 60);
    assert!(cfg[36..48].iter().all(|&b| b == 0), "discard config set");
    assert_eq!(
        u32::from_le_bytes(cfg[48..52].try_into().unwrap()),
        64 * 1024
    );
    assert_eq!(u32::from_le_bytes(cfg[52..56].try_into().unwrap()), 1);
    assert_eq!(
        u64::from_le_bytes(cfg[0..8].try_into().unwrap()),
        8 * MIB / 512
    );
    assert_eq!(u32::from_le_bytes(cfg[8..12].try_into().unwrap()), 1 << 20);
    assert_eq!(u32::from_le_bytes(cfg[12..16].try_into().unwrap()), 254);
    assert_eq!(u32::from_le_bytes(cfg[20..24].try_into().unwrap()), 512);
    // Topology: physical_block_exp 0, alignment_offset 0, min_io_size 1 block, opt 0.
    assert_eq!(cfg[24..32], [0, 0, 1, 0, 0, 0, 0, 0]);
    assert_eq!(cfg[32], 1, "writeback cache on by default");
    assert_eq!(u16::from_le_bytes(cfg[34..36].try_into().unwrap()), 2);
    drop(guest);
    daemon.stop();
}

#[test]
fn raw_write_read_flush_get_id_unsupported() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), 8 * MIB);
    let daemon = Daemon::start(open_raw(&img, true), opts(1));
    let mut guest = Guest::connect(&daemon.socket, 1, 256);

    let data = pattern(64 * 1024, 1);
    assert_eq!(guest.write(0, 100, &data), S_OK);
    let (st, back) = guest.read(0, 100, data.len());
    assert_eq!(st, S_OK);
    assert_eq!(back, data);
    // A read split into small, odd-sized segments (512 multiples in total).
    let (descs, s) = guest.in_chain(0, 101, 4096, 1536);
    guest.run(0, &descs);
    assert_eq!(guest.status(s), S_OK);
    assert_eq!(guest.data_of(&descs), data[512..512 + 4096]);

    assert_eq!(guest.simple(0, common::VIRTIO_BLK_T_FLUSH, 0), S_OK);
    let (st, id) = guest.get_id(0);
    assert_eq!(st, S_OK);
    assert_eq!(&id, b"cryptblk-test-serial");
    assert_eq!(guest.simple(0, 0x1234, 0), S_UNSUPP);
    // DISCARD is not enabled: UNSUPP, with or without its range.
    assert_eq!(guest.simple(0, 11, 0), S_UNSUPP);
    assert_eq!(guest.discard(0, 0, 8, 0), S_UNSUPP);
    // WRITE_ZEROES without its range descriptor.
    assert_eq!(guest.simple(0, 13, 0), S_IOERR);
    // WRITE_ZEROES over sectors 110..118 of the data written at sector 100.
    assert_eq!(guest.write_zeroes(0, 110, 8, 0), S_OK);
    let mut data = data;
    data[10 * 512..18 * 512].fill(0);
    assert_eq!(guest.read(0, 100, data.len()), (S_OK, data.clone()));
    // Unknown range flags are UNSUPP; the unmap flag is accepted (zeroes written anyway).
    assert_eq!(guest.write_zeroes(0, 100, 1, 2), S_UNSUPP);
    assert_eq!(guest.write_zeroes(0, 120, 1, 1), S_OK);
    data[20 * 512..21 * 512].fill(0);
    // Beyond the capacity, and above max_write_zeroes_sectors.
    assert_eq!(guest.write_zeroes(0, 8 * MIB / 512 - 1, 2, 0), S_IOERR);
    assert_eq!(guest.write_zeroes(0, 0, 64 * 1024 + 1, 0), S_IOERR);
    assert_eq!(guest.write_zeroes(0, u64::MAX / 2, 1, 0), S_IOERR);

    drop(guest);
    daemon.stop();
    let on_disk = std::fs::read(&img).unwrap();
    assert_eq!(&on_disk[100 * 512..100 * 512 + data.len()], &data[..]);
}

#[test]
fn out_of_range_and_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), MIB);
    {
        let daemon = Daemon::start(open_raw(&img, true), opts(1));
        let mut guest = Guest::connect(&daemon.socket, 1, 256);
        let sectors = MIB / 512;
        // Last sector is fine, one past it is not, nor a request straddling the end.
        assert_eq!(guest.write(0, sectors - 1, &[7u8; 512]), S_OK);
        assert_eq!(guest.write(0, sectors, &[7u8; 512]), S_IOERR);
        assert_eq!(guest.read(0, sectors - 1, 1024).0, S_IOERR);
        assert_eq!(guest.read(0, u64::MAX / 256, 512).0, S_IOERR);
        // Not a multiple of 512.
        assert_eq!(guest.write(0, 0, &[1u8; 100]), S_IOERR);
        drop(guest);
        daemon.stop();
    }
    let mut o = opts(1);
    o.read_only = true;
    let daemon = Daemon::start(open_raw(&img, false), o);
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    assert!(guest.features & (1 << 5) != 0, "RO not offered");
    assert_eq!(guest.write(0, 0, &[9u8; 512]), S_IOERR);
    assert!(
        guest.features & (1 << 14) == 0,
        "WRITE_ZEROES offered read-only"
    );
    assert_eq!(guest.write_zeroes(0, MIB / 512 - 1, 1, 0), S_IOERR);
    let (st, back) = guest.read(0, MIB / 512 - 1, 512);
    assert_eq!(st, S_OK);
    assert_eq!(back, vec![7u8; 512]);
    drop(guest);
    daemon.stop();
    assert!(std::fs::read(&img).unwrap()[..512].iter().all(|&b| b == 0));
}

#[test]
fn without_event_idx_and_with_write_through_cache() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), MIB);
    let daemon = Daemon::start(open_raw(&img, true), opts(1));
    let mut guest = Guest::connect_without(&daemon.socket, 1, 64, 1 << 29);
    assert!(!guest.event_idx());
    // The guest turns the write cache off (CONFIG_WCE): writes are flushed as they complete.
    guest.set_config(32, &[0]);
    assert_eq!(guest.config(32, 1), vec![0]);
    for i in 0..50u64 {
        let data = pattern(4096, i);
        assert_eq!(guest.write(0, i * 8, &data), S_OK);
        assert_eq!(guest.read(0, i * 8, 4096), (S_OK, data));
    }
    guest.set_config(32, &[1]);
    assert_eq!(guest.config(32, 1), vec![1]);
    drop(guest);
    daemon.stop();
}

#[test]
fn luks2_image_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let img = luks2_image(dir.path());
    let daemon = Daemon::start(open_luks2_writable(&img), opts(1));
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    let f = guest.features;
    assert!(
        f & (1 << 1) != 0 && f & (1 << 10) != 0,
        "SIZE_MAX/TOPOLOGY: {f:#x}"
    );
    let cfg = guest.config(0, 32);
    assert_eq!(
        u64::from_le_bytes(cfg[0..8].try_into().unwrap()),
        4 * MIB / 512
    );
    assert_eq!(u32::from_le_bytes(cfg[8..12].try_into().unwrap()), 1 << 20);
    assert_eq!(u32::from_le_bytes(cfg[20..24].try_into().unwrap()), 4096);
    // Topology in logical blocks: physical = logical (exp 0), min_io_size one 4 KiB block,
    // so a guest computes io_min = 4096 and issues whole encryption sectors.
    assert_eq!(cfg[24], 0, "physical_block_exp");
    assert_eq!(cfg[25], 0, "alignment_offset");
    assert_eq!(u16::from_le_bytes(cfg[26..28].try_into().unwrap()), 1);
    assert_eq!(u32::from_le_bytes(cfg[28..32].try_into().unwrap()), 0);

    let data = pattern(128 * 1024, 5);
    assert_eq!(guest.write(0, 16, &data), S_OK);
    // A sub-sector (512-byte) write inside a 4096-byte encryption sector.
    let small = pattern(512, 6);
    assert_eq!(guest.write(0, 16 + 3, &small), S_OK);
    let mut want = data.clone();
    want[3 * 512..4 * 512].copy_from_slice(&small);
    assert_eq!(guest.read(0, 16, data.len()), (S_OK, want.clone()));
    // Encrypted zeroes over 512-byte sectors 40..57 (not aligned to the 4096-byte sectors).
    assert_eq!(guest.write_zeroes(0, 40, 17, 0), S_OK);
    want[24 * 512..41 * 512].fill(0);
    assert_eq!(guest.read(0, 16, data.len()), (S_OK, want.clone()));
    assert_eq!(guest.simple(0, common::VIRTIO_BLK_T_FLUSH, 0), S_OK);
    drop(guest);
    daemon.stop();

    // The image decrypts to the same data when opened afresh, and is really encrypted.
    let volume = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap();
    let mut back = vec![0u8; want.len()];
    volume.read_at(&mut back, 16 * 512).unwrap();
    assert_eq!(back, want);
    let raw = std::fs::read(&img).unwrap();
    assert!(!raw.windows(64).any(|w| w == &want[..64]));
}
