//! Broken and hostile qcow2 images must produce errors, never panics, hangs or huge
//! allocations.
mod common;

use common::{qemu_img, qemu_io};
use cryptblk_block::{BlockDevice, BlockErrorKind, Qcow2};
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};

const CLUSTER: u64 = 4096;

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// A small v3 image with 4K clusters: data, a zero cluster and a compressed cluster.
fn sample(dir: &Path) -> (PathBuf, Vec<u8>) {
    let raw = dir.join("s.raw");
    std::fs::write(&raw, vec![0x42u8; 256 * 1024]).unwrap();
    let img = dir.join("sample.qcow2");
    qemu_img(&[
        "convert",
        "-c",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=4096",
        raw.to_str().unwrap(),
        img.to_str().unwrap(),
    ]);
    qemu_io(&img, &["write -P 0x17 8k 8k", "write -z 32k 4k"]);
    let bytes = std::fs::read(&img).unwrap();
    (img, bytes)
}

/// Opens and reads as much as is sensible; any error is fine, a panic fails the test.
fn exercise(path: &Path) {
    let Ok(dev) = Qcow2::open(path) else { return };
    let size = dev.size();
    let mut buf = vec![0u8; 64 * 1024];
    let mut off = 0u64;
    // Bounded: the size field may have been mutated to something huge.
    for _ in 0..8 {
        if off >= size {
            break;
        }
        let n = (buf.len() as u64).min(size - off) as usize;
        let _ = dev.read_at(&mut buf[..n], off);
        let _ = dev.block_status(off, size - off);
        off += n as u64;
    }
    let _ = dev.read_at(&mut buf[..512], size.saturating_sub(512));
}

#[test]
fn truncated_files_are_refused_or_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let (_, bytes) = sample(dir.path());
    let p = dir.path().join("trunc.qcow2");
    for len in [
        0usize,
        3,
        4,
        71,
        72,
        100,
        104,
        512,
        4096,
        8192,
        12288,
        bytes.len() / 2,
        bytes.len() - 1,
    ] {
        std::fs::write(&p, &bytes[..len.min(bytes.len())]).unwrap();
        exercise(&p);
        if len < 72 {
            let err = Qcow2::open(&p).unwrap_err();
            assert_eq!(err.kind(), BlockErrorKind::Corrupt, "{err}");
        }
    }
}

#[test]
fn header_fields_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    let (_, bytes) = sample(dir.path());
    let p = dir.path().join("bad.qcow2");
    type Mutation = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Mutation, BlockErrorKind, &str)> = vec![
        (
            "magic",
            Box::new(|b| b[0] = b'X'),
            BlockErrorKind::Corrupt,
            "magic",
        ),
        (
            "version",
            Box::new(|b| b[7] = 4),
            BlockErrorKind::Unsupported,
            "version 4",
        ),
        (
            "cluster_bits",
            Box::new(|b| b[23] = 30),
            BlockErrorKind::Corrupt,
            "cluster_bits",
        ),
        (
            "crypt",
            Box::new(|b| b[35] = 1),
            BlockErrorKind::Unsupported,
            "encryption",
        ),
        (
            "l1 too small",
            Box::new(|b| put64(b, 24, 1 << 40)),
            BlockErrorKind::Corrupt,
            "too small",
        ),
        (
            "l1 huge",
            Box::new(|b| b[36..40].copy_from_slice(&u32::MAX.to_be_bytes())),
            BlockErrorKind::Corrupt,
            "32 MiB",
        ),
        (
            "l1 beyond eof",
            Box::new(|b| put64(b, 40, 1 << 40)),
            BlockErrorKind::Corrupt,
            "beyond the end",
        ),
        (
            "corrupt bit",
            Box::new(|b| b[79] |= 2),
            BlockErrorKind::Corrupt,
            "marked corrupt",
        ),
        (
            "data file",
            Box::new(|b| b[79] |= 4),
            BlockErrorKind::Unsupported,
            "external data file",
        ),
        (
            "extl2",
            Box::new(|b| b[79] |= 16),
            BlockErrorKind::Unsupported,
            "extended L2",
        ),
        (
            "zstd",
            Box::new(|b| {
                b[79] |= 8;
                b[104] = 1;
            }),
            BlockErrorKind::Unsupported,
            "zstd",
        ),
        (
            "unknown bit",
            Box::new(|b| b[78] |= 1),
            BlockErrorKind::Unsupported,
            "bit 8",
        ),
    ];
    for (name, mutate, kind, text) in cases {
        let mut b = bytes.clone();
        mutate(&mut b);
        std::fs::write(&p, &b).unwrap();
        let err = Qcow2::open(&p)
            .err()
            .unwrap_or_else(|| panic!("{name}: opened"));
        assert_eq!(err.kind(), kind, "{name}: {err}");
        assert!(err.to_string().contains(text), "{name}: {err}");
        assert!(err.to_string().contains("bad.qcow2"), "{name}: {err}");
    }

    // The dirty bit alone is fine for reading.
    let mut b = bytes.clone();
    b[79] |= 1;
    std::fs::write(&p, &b).unwrap();
    let dev = Qcow2::open(&p).unwrap();
    let mut buf = [0u8; 4];
    dev.read_at(&mut buf, 8192).unwrap();
    assert_eq!(buf, [0x17; 4]);
}

#[test]
fn table_entries_beyond_eof_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (img, bytes) = sample(dir.path());
    let l1_off = be64(&bytes, 40) as usize;
    let l2_off = (be64(&bytes, l1_off) & 0x00ff_ffff_ffff_fe00) as usize;
    let p = dir.path().join("eof.qcow2");
    let far = 1u64 << 40;
    let mut buf = [0u8; 512];

    // L1 entry pointing past EOF.
    let mut b = bytes.clone();
    put64(&mut b, l1_off, far);
    std::fs::write(&p, &b).unwrap();
    let err = Qcow2::open(&p).unwrap().read_at(&mut buf, 0).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("L2 table"), "{err}");

    // Data cluster past EOF (cluster 2 is the uncompressed 0x17 data).
    let mut b = bytes.clone();
    put64(&mut b, l2_off + 2 * 8, (1 << 63) | far);
    std::fs::write(&p, &b).unwrap();
    let dev = Qcow2::open(&p).unwrap();
    let err = dev.read_at(&mut buf, 2 * CLUSTER).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::Corrupt, "{err}");
    assert_eq!(err.offset(), Some(2 * CLUSTER));
    dev.read_at(&mut buf, 0).unwrap();

    // Unaligned data cluster offset.
    let mut b = bytes.clone();
    put64(&mut b, l2_off + 2 * 8, (1 << 63) | (4096 * 3 + 512));
    std::fs::write(&p, &b).unwrap();
    assert_eq!(
        Qcow2::open(&p)
            .unwrap()
            .read_at(&mut buf, 2 * CLUSTER)
            .unwrap_err()
            .kind(),
        BlockErrorKind::Corrupt
    );

    // Compressed cluster past EOF (cluster 0 is compressed in the sample).
    let entry0 = be64(&bytes, l2_off);
    assert_ne!(
        entry0 & (1 << 62),
        0,
        "sample cluster 0 should be compressed"
    );
    let mut b = bytes.clone();
    put64(&mut b, l2_off, (1 << 62) | (1 << 40));
    std::fs::write(&p, &b).unwrap();
    assert_eq!(
        Qcow2::open(&p)
            .unwrap()
            .read_at(&mut buf, 0)
            .unwrap_err()
            .kind(),
        BlockErrorKind::Corrupt
    );

    // Compressed data that does not inflate.
    let host = (entry0 & ((1u64 << 58) - 1)) as usize;
    let mut b = bytes.clone();
    for x in &mut b[host..host + 16] {
        *x ^= 0xff;
    }
    std::fs::write(&p, &b).unwrap();
    assert_eq!(
        Qcow2::open(&p)
            .unwrap()
            .read_at(&mut buf, 0)
            .unwrap_err()
            .kind(),
        BlockErrorKind::Corrupt
    );
    drop(img);
}

#[test]
fn random_mutations_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let (_, bytes) = sample(dir.path());
    let l1_off = be64(&bytes, 40) as usize;
    let l2_off = (be64(&bytes, l1_off) & 0x00ff_ffff_ffff_fe00) as usize;
    let p = dir.path().join("mut.qcow2");
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xc0ffee);
    // Mutations concentrate where the parser looks: header, L1 and L2 tables.
    let regions = [(0usize, 512usize), (l1_off, 64), (l2_off, 512)];
    for _ in 0..400 {
        let mut b = bytes.clone();
        for _ in 0..rng.gen_range(1..6) {
            let (start, len) = regions[rng.gen_range(0..regions.len())];
            let i = (start + rng.gen_range(0..len)).min(b.len() - 1);
            b[i] = match rng.gen_range(0..3) {
                0 => rng.gen(),
                1 => b[i] ^ (1 << rng.gen_range(0..8)),
                _ => 0xff,
            };
        }
        std::fs::write(&p, &b).unwrap();
        exercise(&p);
    }
}
