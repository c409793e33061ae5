//! `cryptblk demo`, the README's first command, on a small sample: it must succeed, show the
//! round trip verified, serve the encrypted image and its plaintext to a real vhost-user-blk
//! client with a throughput row per workload, and stop its daemon cleanly (no socket left).
//! The plain twin it compares against is as allocated as the encrypted image (the sample's
//! holes would be read as zeros without touching the storage), and the demo says so.
use std::os::unix::fs::MetadataExt;
use std::process::Command;

#[test]
fn demo_encrypts_verifies_and_serves() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("demo");
    let out = Command::new(env!("CARGO_BIN_EXE_cryptblk"))
        .args(["--threads", "2", "demo", "--size", "16M", "--dir"])
        .arg(&work)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "demo failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    for expected in [
        "identical (16.0 MiB), and the LUKS2 image holds only ciphertext",
        "wrote 1 MiB to the encrypted disk and read it back: identical",
        "daemon stopped with SIGTERM",
        "Demo OK.",
    ] {
        assert!(stdout.contains(expected), "no {expected:?} in:\n{stdout}");
    }
    // One row per workload, both disks measured (a number above zero in each column).
    let rows: Vec<&str> = stdout.lines().filter(|l| l.contains(", depth ")).collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    for row in rows {
        let numbers: Vec<f64> = row
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        // Block size is in the label ("4k"), not a number; depth, encrypted, plain, ratio.
        assert_eq!(numbers.len(), 4, "{row}");
        assert!(
            numbers[1] > 0.0 && numbers[2] > 0.0 && numbers[3] > 0.0,
            "{row}"
        );
    }
    // Both disks served hold every payload byte on the storage: the twin is not the sparse
    // sample (a quarter holes) but a dense copy.
    let allocated = |name: &str| std::fs::metadata(work.join(name)).unwrap().blocks() * 512;
    assert!(allocated("sample.raw") <= 12 << 20, "the sample has holes");
    assert_eq!(allocated("plain.raw"), 16 << 20);
    assert!(allocated("sample.luks2") >= 16 << 20);
    let config = std::fs::read_to_string(work.join("disks.toml")).unwrap();
    assert!(
        config.contains("plain.raw") && !config.contains("sample.raw"),
        "{config}"
    );
    let measured: Vec<&str> = stdout.lines().filter(|l| l.contains("measured:")).collect();
    assert_eq!(measured.len(), 1, "{stdout}");
    for said in [
        "plain twin 16.0 MiB allocated (no holes)",
        "interleaved halves",
        "ratio = encrypted / plain",
    ] {
        assert!(measured[0].contains(said), "no {said:?} in {}", measured[0]);
    }
    for socket in ["encrypted.sock", "plain.sock"] {
        assert!(!work.join(socket).exists(), "{socket} left behind");
    }
}
