//! The server driven by real NBD clients: qemu-img, qemu-io, nbdinfo and nbdcopy.
mod common;

use common::{export, luks2_volume, pattern, raw_file, run, run_failing, TestServer};
use cryptblk_block::BlockDevice;
use cryptblk_nbd::ExportRegistry;
use std::sync::Arc;

const MIB: u64 = 1 << 20;

/// A 64 MiB sparse raw export "raw" (first 8 MiB data) and a 16 MiB LUKS2 export "luks"
/// with 4096-byte sectors and patterned contents.
fn two_exports(dir: &std::path::Path) -> (Arc<ExportRegistry>, Arc<dyn BlockDevice>) {
    let registry = ExportRegistry::new();
    let raw = raw_file(&dir.join("disk.raw"), 64 * MIB, 8 * MIB as usize);
    registry.add(export("raw", raw)).unwrap();
    let luks = luks2_volume(&dir.join("disk.luks"), 16 * MIB, 4096);
    luks.write_at(&pattern(16 * MIB as usize, 7), 0).unwrap();
    registry.add(export("luks", Arc::clone(&luks))).unwrap();
    (registry, luks)
}

#[test]
fn qemu_img_convert_and_compare_match_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, _) = two_exports(dir.path());
    let server = TestServer::unix(dir.path(), registry);
    let source = dir.path().join("disk.raw");

    let copy = dir.path().join("copy.raw");
    run(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &server.uri("raw"),
            copy.to_str().unwrap(),
        ],
    );
    assert!(std::fs::read(&copy).unwrap() == std::fs::read(&source).unwrap());
    run(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            source.to_str().unwrap(),
            &server.uri("raw"),
        ],
    );

    let luks_copy = dir.path().join("luks-copy.raw");
    run(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &server.uri("luks"),
            luks_copy.to_str().unwrap(),
        ],
    );
    assert!(std::fs::read(&luks_copy).unwrap() == pattern(16 * MIB as usize, 7));
    run(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            luks_copy.to_str().unwrap(),
            &server.uri("luks"),
        ],
    );
}

#[test]
fn qemu_io_writes_zeroes_discards_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, luks) = two_exports(dir.path());
    let server = TestServer::unix(dir.path(), registry);

    let raw_uri = server.uri("raw");
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            &raw_uri,
            "-c",
            "write -P 0xab 0 64k",
            "-c",
            "write -z 64k 64k",
            "-c",
            "discard 128k 64k",
            "-c",
            "write -P 0xcd -f 192k 4k",
            "-c",
            "read -P 0xab 0 64k",
            "-c",
            "read -P 0 64k 128k",
            "-c",
            "read -P 0xcd 192k 4k",
        ],
    );
    let file = std::fs::read(dir.path().join("disk.raw")).unwrap();
    assert!(file[..64 << 10].iter().all(|&b| b == 0xab));
    assert!(file[64 << 10..192 << 10].iter().all(|&b| b == 0));
    assert!(file[192 << 10..196 << 10].iter().all(|&b| b == 0xcd));

    let luks_uri = server.uri("luks");
    run(
        "qemu-io",
        &[
            "-f",
            "raw",
            &luks_uri,
            "-c",
            "write -P 0x5a 1M 64k",
            "-c",
            "write -z 2M 128k",
            "-c",
            "read -P 0x5a 1M 64k",
            "-c",
            "read -P 0 2M 128k",
            "-c",
            "discard 4M 64k",
        ],
    );
    let mut check = vec![0u8; 128 << 10];
    luks.read_at(&mut check[..64 << 10], MIB).unwrap();
    assert!(check[..64 << 10].iter().all(|&b| b == 0x5a));
    luks.read_at(&mut check, 2 * MIB).unwrap();
    assert!(check.iter().all(|&b| b == 0));
}

/// The first export of `nbdinfo --json` output.
fn nbdinfo_json(uri: &str) -> serde_json::Value {
    let text = run("nbdinfo", &["--json", uri]);
    let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
    parsed["exports"][0].clone()
}

#[test]
fn nbdinfo_reports_sizes_block_limits_and_holes() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, _) = two_exports(dir.path());
    let server = TestServer::unix(dir.path(), registry);

    let luks = nbdinfo_json(&server.uri("luks"));
    assert_eq!(luks["export-size"], 16 * MIB, "{luks}");
    assert_eq!(luks["block_size_minimum"], 4096, "{luks}");
    assert_eq!(luks["block_size_preferred"], 4096, "{luks}");
    assert_eq!(luks["block_size_maximum"], 32 * MIB, "{luks}");

    let raw = nbdinfo_json(&server.uri("raw"));
    assert_eq!(raw["export-size"], 64 * MIB, "{raw}");
    assert_eq!(raw["block_size_minimum"], 512, "{raw}");
    assert_eq!(raw["is_read_only"], false, "{raw}");
    assert_eq!(raw["can_multi_conn"], true, "{raw}");

    // The sparse raw file: 8 MiB of data, then a hole reading as zeros.
    let map = run("nbdinfo", &["--map", &server.uri("raw")]);
    let lines: Vec<Vec<&str>> = map
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), 2, "{map}");
    assert_eq!(&lines[0][..3], &["0", "8388608", "0"], "{map}");
    assert_eq!(&lines[1][..3], &["8388608", "58720256", "3"], "{map}");
    assert!(lines[1][3].contains("hole"), "{map}");

    // Encrypted data is never reported as a hole.
    let map = run("nbdinfo", &["--map", &server.uri("luks")]);
    assert_eq!(map.lines().count(), 1, "{map}");
    assert!(map.contains("data"), "{map}");
}

#[test]
fn nbdinfo_lists_every_export_and_empty_name_needs_a_single_export() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, _) = two_exports(dir.path());
    let server = TestServer::unix(dir.path(), Arc::clone(&registry));
    let list = run(
        "nbdinfo",
        &["--list", &format!("nbd+unix://?socket={}", server.address)],
    );
    assert!(list.contains("export=\"luks\""), "{list}");
    assert!(list.contains("export=\"raw\""), "{list}");
    assert!(list.contains("test export raw"), "{list}");

    // With two exports the default (empty) name is ambiguous.
    let default_uri = format!("nbd+unix:///?socket={}", server.address);
    run_failing("nbdinfo", &["--size", &default_uri]);
    registry.remove("luks").unwrap();
    assert_eq!(
        run("nbdinfo", &["--size", &default_uri]).trim(),
        (64 * MIB).to_string()
    );
}

#[test]
fn nbdcopy_with_four_connections_in_and_out() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, luks) = two_exports(dir.path());
    let server = TestServer::unix(dir.path(), registry);

    let out = dir.path().join("out.raw");
    run(
        "nbdcopy",
        &[
            "--connections=4",
            &server.uri("luks"),
            out.to_str().unwrap(),
        ],
    );
    assert!(std::fs::read(&out).unwrap() == pattern(16 * MIB as usize, 7));

    let source = dir.path().join("in.raw");
    let data = pattern(16 * MIB as usize, 99);
    std::fs::write(&source, &data).unwrap();
    run(
        "nbdcopy",
        &[
            "--connections=4",
            source.to_str().unwrap(),
            &server.uri("luks"),
        ],
    );
    let mut back = vec![0u8; data.len()];
    luks.read_at(&mut back, 0).unwrap();
    assert!(back == data);
}

/// fio's NBD engine (libnbd, 32 requests in flight) writes with checksums and verifies them,
/// on the raw and the encrypted export.
#[test]
fn fio_verified_random_writes_at_queue_depth_32() {
    let dir = tempfile::tempdir().unwrap();
    let (registry, _) = two_exports(dir.path());
    let server = TestServer::unix(dir.path(), registry);
    for (name, block_size) in [("raw", "4k"), ("luks", "4k"), ("luks", "64k")] {
        let uri = server.uri(name);
        let output = run(
            "fio",
            &[
                "--name=verify",
                "--ioengine=nbd",
                &format!("--uri={uri}"),
                "--rw=randwrite",
                &format!("--bs={block_size}"),
                "--iodepth=32",
                "--size=8M",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                // fio would otherwise leave a state file in the working directory.
                "--verify_state_save=0",
            ],
        );
        assert!(output.contains("err= 0"), "{name} {block_size}: {output}");
    }
}
