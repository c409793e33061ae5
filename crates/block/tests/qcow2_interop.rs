//! Every byte cryptblk reads from a qcow2 image must equal what `qemu-img convert -O raw`
//! produces from the same image. Images are made by the real qemu-img / qemu-io.
mod common;

use common::{assert_same, qemu_img, qemu_io, qemu_raw, read_all};
use cryptblk_block::{
    open_image, probe_format, BlockDevice, BlockErrorKind, ExtentKind, Format, Qcow2,
};
use rand::{Rng, SeedableRng};
use std::path::Path;

const MIB: u64 = 1 << 20;

/// A sparse raw file with random data at scattered offsets and some explicit zero runs.
fn scattered_raw(path: &Path, size: u64, seed: u64) {
    scattered_raw_with(path, size, seed, 256)
}

/// As `scattered_raw`, with bytes drawn from `alphabet` values (small = compressible).
fn scattered_raw_with(path: &Path, size: u64, seed: u64, alphabet: u16) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    use std::os::unix::fs::FileExt;
    for _ in 0..24 {
        let len = rng.gen_range(1..200_000u64);
        let off = rng.gen_range(0..size - len);
        let data: Vec<u8> = (0..len).map(|_| rng.gen_range(0..alphabet) as u8).collect();
        f.write_all_at(&data, off).unwrap();
    }
    // Highly compressible data too, so that compressed clusters of varied sizes appear.
    f.write_all_at(&vec![0x5a; 300_000], size / 3).unwrap();
}

fn check_against_qemu(image: &Path, dir: &Path) {
    let expected = qemu_raw(image, dir);
    let dev = Qcow2::open(image).unwrap();
    assert_eq!(dev.size() as usize, expected.len());
    // Several read sizes: sub-cluster, odd, and large multi-cluster reads.
    for chunk in [4096usize, 65_537, 3 * MIB as usize] {
        assert_same(
            &read_all(&dev, chunk),
            &expected,
            &format!("{} chunk {chunk}", image.display()),
        );
    }
    // Random unaligned reads.
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for _ in 0..200 {
        let len = rng.gen_range(1..300_000usize).min(expected.len());
        let off = rng.gen_range(0..=expected.len() - len);
        let mut buf = vec![0u8; len];
        dev.read_at(&mut buf, off as u64).unwrap();
        assert_same(
            &buf,
            &expected[off..off + len],
            &format!("{} read {len}@{off}", image.display()),
        );
    }
    check_block_status_consistent(&dev, &expected);
}

/// block_status must tile the device, and ranges it calls Zero/Unallocated must read as zeros.
fn check_block_status_consistent(dev: &dyn BlockDevice, expected: &[u8]) {
    let mut off = 0u64;
    while off < dev.size() {
        let ext = dev.block_status(off, dev.size() - off).unwrap();
        assert!(ext.len > 0 && off + ext.len <= dev.size());
        if ext.kind != ExtentKind::Data {
            let r = &expected[off as usize..(off + ext.len) as usize];
            assert!(
                r.iter().all(|&b| b == 0),
                "{:?} extent at {off} is not zero",
                ext.kind
            );
        }
        off += ext.len;
    }
}

#[test]
fn v2_and_v3_converted_from_sparse_raw_all_cluster_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("src.raw");
    // Not a multiple of any cluster size: the last cluster is partial.
    scattered_raw(&raw, 24 * MIB + 12288, 1);
    for (compat, cluster) in [
        ("0.10", "65536"),
        ("1.1", "4096"),
        ("1.1", "65536"),
        ("1.1", "2M"),
        ("0.10", "512"),
    ] {
        let img = dir.path().join(format!("c{compat}-{cluster}.qcow2"));
        let opts = format!("compat={compat},cluster_size={cluster}");
        qemu_img(&[
            "convert",
            "-O",
            "qcow2",
            "-o",
            &opts,
            raw.to_str().unwrap(),
            img.to_str().unwrap(),
        ]);
        let dev = Qcow2::open(&img).unwrap();
        assert_eq!(dev.version(), if compat == "0.10" { 2 } else { 3 });
        assert_eq!(probe_format(&img).unwrap(), Format::Qcow2);
        check_against_qemu(&img, dir.path());
        // The converted image equals the source too (a sanity check of the harness).
        assert_same(
            &read_all(&dev, MIB as usize),
            &std::fs::read(&raw).unwrap(),
            "vs source raw",
        );
    }
}

#[test]
fn qemu_io_writes_and_zero_clusters_v3() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("z.qcow2");
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "-o",
        "compat=1.1,cluster_size=65536",
        img.to_str().unwrap(),
        "32M",
    ]);
    qemu_io(
        &img,
        &[
            "write -P 0xab 1M 64k",
            "write -P 0x11 3M 1M",
            "write -P 0x22 5000k 100k",
            "write -z 3M 256k", // zero flag over allocated clusters
            "write -z 20M 1M",  // zero clusters with no data behind
            "write -P 0x33 31M 1M",
        ],
    );
    let dev = Qcow2::open(&img).unwrap();
    let st = dev.block_status(20 * MIB, MIB).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Zero, MIB));
    let st = dev.block_status(3 * MIB, MIB).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Zero, 256 * 1024));
    let st = dev.block_status(MIB, 2 * MIB).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Data, 64 * 1024));
    let st = dev.block_status(8 * MIB, 4 * MIB).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Unallocated, 4 * MIB));
    check_against_qemu(&img, dir.path());
}

#[test]
fn compressed_clusters_all_cluster_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("src.raw");
    scattered_raw_with(&raw, 20 * MIB, 2, 4);
    for (compat, cluster) in [
        ("1.1", "4096"),
        ("1.1", "65536"),
        ("0.10", "65536"),
        ("1.1", "2M"),
    ] {
        let img = dir.path().join(format!("comp-{compat}-{cluster}.qcow2"));
        let opts = format!("compat={compat},cluster_size={cluster}");
        qemu_img(&[
            "convert",
            "-c",
            "-O",
            "qcow2",
            "-o",
            &opts,
            raw.to_str().unwrap(),
            img.to_str().unwrap(),
        ]);
        // The image really holds compressed clusters: `qemu-img map` gives those no offset.
        let map = common::output("qemu-img", &["map", "--output=json", img.to_str().unwrap()]);
        assert!(
            map.lines()
                .any(|l| l.contains("\"data\": true") && !l.contains("offset")),
            "no compressed clusters in {map}"
        );
        check_against_qemu(&img, dir.path());
    }
}

#[test]
fn backing_chain_reads_through_and_block_status_follows_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = d.join("base.qcow2");
    let mid = d.join("mid.qcow2");
    let top = d.join("top.qcow2");
    qemu_img(&["create", "-f", "qcow2", base.to_str().unwrap(), "16M"]);
    qemu_io(&base, &["write -P 0x01 0 4M", "write -P 0x02 8M 1M"]);
    // Relative backing names, resolved against the image's own directory.
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "-b",
        "base.qcow2",
        "-F",
        "qcow2",
        mid.to_str().unwrap(),
    ]);
    qemu_io(&mid, &["write -P 0x03 1M 64k", "write -z 2M 64k"]);
    // The top is bigger than its backing file: the tail reads as zeros.
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "-b",
        mid.to_str().unwrap(),
        "-F",
        "qcow2",
        top.to_str().unwrap(),
        "24M",
    ]);
    qemu_io(
        &top,
        &[
            "write -P 0x04 1M 4k",
            "write -P 0x05 3M 100k",
            "write -P 0x06 20M 64k",
        ],
    );

    let err = Qcow2::open_standalone(&top).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::Unsupported);
    assert!(err.to_string().contains("mid.qcow2"), "{err}");
    Qcow2::open_standalone(&base).unwrap();

    let dev = Qcow2::open(&top).unwrap();
    assert_eq!(dev.backing_path(), Some(mid.as_path()));
    check_against_qemu(&top, d);
    let st = dev.block_status(8 * MIB, 4 * MIB).unwrap();
    assert_eq!(
        (st.kind, st.len),
        (ExtentKind::Data, MIB),
        "data found in the base"
    );
    let st = dev.block_status(2 * MIB, 4 * MIB).unwrap();
    assert_eq!(
        (st.kind, st.len),
        (ExtentKind::Zero, 64 * 1024),
        "zero cluster in the middle layer"
    );
    let st = dev.block_status(12 * MIB, 2 * MIB).unwrap();
    assert_eq!((st.kind, st.len), (ExtentKind::Unallocated, 2 * MIB));
    let st = dev.block_status(17 * MIB, MIB).unwrap();
    assert_eq!(
        (st.kind, st.len),
        (ExtentKind::Zero, MIB),
        "beyond the backing file's end"
    );

    // A raw backing file works too.
    let rawbase = d.join("base.raw");
    scattered_raw(&rawbase, 8 * MIB, 3);
    let over = d.join("over-raw.qcow2");
    // A version 2 image: it carries the backing format extension too.
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "-o",
        "compat=0.10",
        "-b",
        "base.raw",
        "-F",
        "raw",
        over.to_str().unwrap(),
    ]);
    qemu_io(&over, &["write -P 0x07 2M 128k"]);
    assert_eq!(Qcow2::open(&over).unwrap().version(), 2);
    check_against_qemu(&over, d);

    // open_image picks the qcow2 reader and refuses to write.
    let dev = open_image(&top, Format::Qcow2, false).unwrap();
    assert_eq!(
        dev.write_at(&[0], 0).unwrap_err().kind(),
        BlockErrorKind::ReadOnly
    );
    assert_eq!(
        open_image(&top, Format::Qcow2, true).err().unwrap().kind(),
        BlockErrorKind::Unsupported
    );
}

#[test]
fn missing_backing_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("gone-base.qcow2");
    let top = dir.path().join("top.qcow2");
    qemu_img(&["create", "-f", "qcow2", base.to_str().unwrap(), "1M"]);
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "-b",
        "gone-base.qcow2",
        "-F",
        "qcow2",
        top.to_str().unwrap(),
    ]);
    std::fs::remove_file(&base).unwrap();
    let err = Qcow2::open(&top).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("gone-base.qcow2") && msg.contains("not found"),
        "{msg}"
    );
    assert!(msg.contains("top.qcow2"), "{msg}");
}

#[test]
fn backing_loop_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.qcow2");
    let b = dir.path().join("b.qcow2");
    qemu_img(&["create", "-f", "qcow2", a.to_str().unwrap(), "1M"]);
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "-b",
        "a.qcow2",
        "-F",
        "qcow2",
        b.to_str().unwrap(),
    ]);
    // Point a at b with -u (unsafe: no checks), making a loop.
    qemu_img(&[
        "rebase",
        "-u",
        "-f",
        "qcow2",
        "-b",
        "b.qcow2",
        "-F",
        "qcow2",
        a.to_str().unwrap(),
    ]);
    let err = Qcow2::open(&b).unwrap_err();
    assert!(err.to_string().contains("loops"), "{err}");
}

#[test]
fn encrypted_qcow2_is_unsupported_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("enc.qcow2");
    common::qemu_img_kdf(&[
        "create",
        "-f",
        "qcow2",
        "--object",
        "secret,id=sec0,data=pw",
        "-o",
        "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10",
        img.to_str().unwrap(),
        "1M",
    ]);
    let err = Qcow2::open(&img).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::Unsupported);
    assert!(err.to_string().contains("encryption"), "{err}");
}

#[test]
fn concurrent_readers_share_one_image() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("src.raw");
    scattered_raw(&raw, 16 * MIB, 4);
    let img = dir.path().join("conc.qcow2");
    // Small clusters and many L2 tables stress the shared L2 cache.
    qemu_img(&[
        "convert",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=4096",
        raw.to_str().unwrap(),
        img.to_str().unwrap(),
    ]);
    let expected = qemu_raw(&img, dir.path());
    let dev = std::sync::Arc::new(Qcow2::open(&img).unwrap());
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let dev = dev.clone();
            let expected = &expected;
            s.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(100 + t);
                for _ in 0..300 {
                    let len = rng.gen_range(1..100_000usize);
                    let off = rng.gen_range(0..expected.len() - len);
                    let mut buf = vec![0u8; len];
                    dev.read_at(&mut buf, off as u64).unwrap();
                    assert!(
                        buf == expected[off..off + len],
                        "thread {t}: read {len}@{off}"
                    );
                }
            });
        }
    });
}

#[test]
fn probe_recognises_formats() {
    let dir = tempfile::tempdir().unwrap();
    let q = dir.path().join("p.qcow2");
    qemu_img(&["create", "-f", "qcow2", q.to_str().unwrap(), "1M"]);
    assert_eq!(probe_format(&q).unwrap(), Format::Qcow2);
    let l = dir.path().join("p.luks");
    common::cryptsetup_format(&l, "luks1", 512, 3 << 20, b"x");
    assert_eq!(probe_format(&l).unwrap(), Format::Luks);
    let r = dir.path().join("p.raw");
    std::fs::write(&r, b"QFI").unwrap(); // too short to be qcow2
    assert_eq!(probe_format(&r).unwrap(), Format::Raw);
    std::fs::write(&r, b"").unwrap();
    assert_eq!(probe_format(&r).unwrap(), Format::Raw);
    assert_eq!(
        probe_format(dir.path().join("nope")).unwrap_err().kind(),
        BlockErrorKind::Io
    );
    // A raw image opens writable through open_image.
    std::fs::write(&r, vec![0u8; 4096]).unwrap();
    let dev = open_image(&r, Format::Raw, true).unwrap();
    dev.write_at(&[1, 2, 3], 100).unwrap();
    assert_eq!(&std::fs::read(&r).unwrap()[100..103], &[1, 2, 3]);
}

#[test]
fn backing_chain_depth_is_limited() {
    let dir = tempfile::tempdir().unwrap();
    let name = |i: usize| dir.path().join(format!("l{i}.qcow2"));
    qemu_img(&["create", "-f", "qcow2", name(0).to_str().unwrap(), "1M"]);
    qemu_io(&name(0), &["write -P 0x61 0 4k"]);
    for i in 1..=cryptblk_block::MAX_BACKING_DEPTH {
        let backing = format!("l{}.qcow2", i - 1);
        qemu_img(&[
            "create",
            "-f",
            "qcow2",
            "-b",
            &backing,
            "-F",
            "qcow2",
            name(i).to_str().unwrap(),
        ]);
    }
    // MAX_BACKING_DEPTH images in all: still fine, and the base's data shows through.
    let deepest_ok = Qcow2::open(name(cryptblk_block::MAX_BACKING_DEPTH - 1)).unwrap();
    let mut buf = [0u8; 4];
    deepest_ok.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, [0x61; 4]);
    let err = Qcow2::open(name(cryptblk_block::MAX_BACKING_DEPTH)).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::Unsupported);
    assert!(err.to_string().contains("deeper than"), "{err}");
}
