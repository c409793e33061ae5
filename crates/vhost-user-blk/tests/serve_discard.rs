//! DISCARD through `Server` over a real vhost-user socket with the in-repo frontend in
//! `common`: offered only when enabled on a writable export, holes punched in a raw image, and
//! on a LUKS2 image only whole encryption sectors discarded, the others still decrypting.
mod common;

use common::{luks2_image, open_luks2_writable, open_raw, opts, pattern, raw_image};
use common::{Daemon, Guest, MIB, PW};
use common::{S_IOERR, S_OK, S_UNSUPP};
use cryptblk_block::BlockDevice;
use cryptblk_vhost_user_blk::ServeOptions;
use cryptblk_volume::{open_luks_volume, VolumeOptions};

fn discard_opts() -> ServeOptions {
    ServeOptions {
        discard: true,
        ..opts(1)
    }
}

/// Writes `data` at `sector` in 128 KiB requests (a request must fit the queue).
fn write_big(guest: &mut Guest, sector: u64, data: &[u8]) {
    for (i, chunk) in data.chunks(128 * 1024).enumerate() {
        assert_eq!(guest.write(0, sector + i as u64 * 256, chunk), S_OK);
    }
}

/// Reads `len` bytes at `sector` in 128 KiB requests.
fn read_big(guest: &mut Guest, sector: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut s = sector;
    while out.len() < len {
        let n = (len - out.len()).min(128 * 1024);
        let (st, back) = guest.read(0, s, n);
        assert_eq!(st, S_OK);
        out.extend_from_slice(&back);
        s += n as u64 / 512;
    }
    out
}

/// Allocated bytes of a file (st_blocks is in 512-byte units).
fn allocated(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn discard_is_offered_only_when_enabled_and_writable() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), 8 * MIB);
    {
        let daemon = Daemon::start(open_raw(&img, true), discard_opts());
        let mut guest = Guest::connect(&daemon.socket, 1, 256);
        assert!(guest.features & (1 << 13) != 0, "DISCARD not offered");
        let cfg = guest.config(0, 60);
        let word = |o: usize| u32::from_le_bytes(cfg[o..o + 4].try_into().unwrap());
        assert_eq!(word(36), 64 * 1024, "max_discard_sectors");
        assert_eq!(word(40), 1, "max_discard_seg");
        assert_eq!(word(44), 1, "discard_sector_alignment");
        drop(guest);
        daemon.stop();
    }
    // Read-only export: not offered even when asked for, and DISCARD is UNSUPP.
    let mut o = discard_opts();
    o.read_only = true;
    let daemon = Daemon::start(open_raw(&img, false), o);
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    assert!(guest.features & (1 << 13) == 0, "DISCARD offered read-only");
    assert_eq!(guest.discard(0, 0, 8, 0), S_UNSUPP);
    drop(guest);
    daemon.stop();
}

#[test]
fn discard_on_raw_punches_holes() {
    let dir = tempfile::tempdir().unwrap();
    let img = raw_image(dir.path(), 8 * MIB);
    let daemon = Daemon::start(open_raw(&img, true), discard_opts());
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    let data = pattern(4 * MIB as usize, 21);
    write_big(&mut guest, 0, &data);
    assert_eq!(guest.simple(0, common::VIRTIO_BLK_T_FLUSH, 0), S_OK);
    let before = allocated(&img);
    assert!(before >= 4 * MIB, "{before}");

    // Sectors 2048..4096 (1 MiB at offset 1 MiB).
    assert_eq!(guest.discard(0, 2048, 2048, 0), S_OK);
    let after = allocated(&img);
    assert!(after + MIB <= before, "{before} -> {after}");
    {
        use std::os::unix::io::AsRawFd;
        let f = std::fs::File::open(&img).unwrap();
        // SAFETY: lseek only takes integer arguments on a file descriptor owned by `f`.
        let hole = unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_HOLE) };
        assert_eq!(hole as u64, MIB);
    }
    let back = read_big(&mut guest, 0, 4 * MIB as usize);
    let m = MIB as usize;
    assert_eq!(back[..m], data[..m]);
    assert!(back[m..2 * m].iter().all(|&b| b == 0));
    assert_eq!(back[2 * m..], data[2 * m..]);

    // Flags are not defined for discard; the range must fit the capacity; a zero-length
    // range is a no-op.
    assert_eq!(guest.discard(0, 0, 8, 1), S_UNSUPP);
    assert_eq!(guest.discard(0, 8 * MIB / 512 - 1, 2, 0), S_IOERR);
    assert_eq!(guest.discard(0, u64::MAX / 2, 1, 0), S_IOERR);
    assert_eq!(guest.discard(0, 0, 64 * 1024 + 1, 0), S_IOERR);
    assert_eq!(guest.discard(0, 0, 0, 0), S_OK);
    // Without its range descriptor.
    assert_eq!(guest.simple(0, 11, 0), S_IOERR);
    assert_eq!(read_big(&mut guest, 0, m), data[..m]);
    drop(guest);
    daemon.stop();
}

#[test]
fn discard_on_luks2_keeps_other_sectors() {
    let dir = tempfile::tempdir().unwrap();
    let img = luks2_image(dir.path());
    let daemon = Daemon::start(open_luks2_writable(&img), discard_opts());
    let mut guest = Guest::connect(&daemon.socket, 1, 256);
    let cfg = guest.config(0, 48);
    // 4096-byte logical blocks: discards aligned to 8 sectors.
    assert_eq!(u32::from_le_bytes(cfg[44..48].try_into().unwrap()), 8);

    let data = pattern(MIB as usize, 22);
    write_big(&mut guest, 0, &data);
    assert_eq!(guest.simple(0, common::VIRTIO_BLK_T_FLUSH, 0), S_OK);
    let before = allocated(&img);
    // Misaligned start or length: IOERR, nothing discarded.
    assert_eq!(guest.discard(0, 4, 256, 0), S_IOERR);
    assert_eq!(guest.discard(0, 256, 255, 0), S_IOERR);
    assert_eq!(read_big(&mut guest, 0, data.len()), data);
    // Sectors 256..768: 256 KiB at offset 128 KiB, whole 4 KiB blocks.
    assert_eq!(guest.discard(0, 256, 512, 0), S_OK);
    assert!(allocated(&img) + 256 * 1024 <= before);
    let back = read_big(&mut guest, 0, data.len());
    let (a, b) = (128 * 1024, 384 * 1024);
    assert_eq!(back[..a], data[..a]);
    assert_eq!(back[b..], data[b..]);
    // Like dm-crypt allow_discards: the discarded range reads as garbage, not the old data.
    assert_ne!(back[a..b], data[a..b]);
    drop(guest);
    daemon.stop();

    // The other sectors still decrypt correctly from a fresh open.
    let volume = open_luks_volume(&img, PW, &VolumeOptions::default()).unwrap();
    let mut fresh = vec![0u8; data.len()];
    volume.read_at(&mut fresh, 0).unwrap();
    assert_eq!(fresh[..a], data[..a]);
    assert_eq!(fresh[b..], data[b..]);
}
