//! `cryptblk convert`: byte-exact round trips, progress output, clean failure, writing into
//! existing targets, and bounded memory on large images.
mod common;

use common::*;
use std::os::unix::fs::FileExt;
use std::path::Path;

fn files_in(dir: &Path) -> Vec<String> {
    let entries = std::fs::read_dir(dir).unwrap();
    let mut names: Vec<String> = entries
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A LUKS1 keyslot made cheap (`--pbkdf pbkdf2` is LUKS2's option).
const LUKS1_CHEAP: &str = "--pbkdf-force-iterations 1000";

/// raw -> `target` (with `options`) -> raw gives the source back, encrypted in between; the
/// target's `dump --json`.
fn roundtrip(name: &str, target: &str, size: u64, options: &str) -> serde_json::Value {
    let t = TestDir::new();
    let (key, src, enc) = (t.key("key"), t.path("src.raw"), t.path("enc"));
    mixed_file(&src, size, size);
    let mut args = argv!("convert -O {} --key-file {}", target, key);
    args.extend(options.split_whitespace().map(Into::into));
    args.extend([src.clone().into(), enc.clone().into()]);
    cryptblk(&args).ok();

    let dump = dump_json(&enc);
    let data_offset = dump["data_offset"].as_u64();
    let data_offset = data_offset
        .or_else(|| dump["payload_offset_sectors"].as_u64().map(|n| n * 512))
        .unwrap();
    let enc_bytes = read(&enc);
    let what = format!("{name}: the LUKS image holds exactly the payload after its header");
    assert_eq!(enc_bytes.len() as u64, data_offset + size, "{what}");
    let source = read(&src);
    // Ciphertext, not plaintext: no 4 KiB block of random source data appears in place.
    let first_block = &enc_bytes[data_offset as usize..data_offset as usize + 4096];
    assert_ne!(
        first_block,
        &source[..4096],
        "{name}: payload is not encrypted"
    );

    let out = cryptblk_decrypt(&enc, &key, &t.path("out.raw"));
    assert_same_bytes(&out, &source, &format!("{name}: raw -> {target} -> raw"));
    let files = ["enc", "key", "out.raw", "src.raw"];
    assert_eq!(
        files_in(t.root()),
        files,
        "{name}: no stray temporary files"
    );
    dump
}

#[test]
fn roundtrip_luks2_4096_multiple() {
    let kdf = "--pbkdf argon2id --pbkdf-memory 64 --pbkdf-force-iterations 4";
    let dump = roundtrip("rt-l2-4k", "luks2", 4 * MIB, kdf);
    assert_eq!(dump["sector_size"], 4096);
}

#[test]
fn roundtrip_luks2_not_4096_multiple() {
    // 512-aligned but not 4096-aligned: cryptblk must fall back to 512-byte sectors and stay exact.
    let kdf = "--pbkdf pbkdf2 --pbkdf-force-iterations 1000";
    let dump = roundtrip("rt-l2-odd", "luks2", 3 * MIB + 5 * 512, kdf);
    assert_eq!(dump["sector_size"], 512);
}

#[test]
fn roundtrip_luks2_through_the_page_cache() {
    // The default writes new targets with O_DIRECT; -t writeback takes the buffered path.
    let options = "--pbkdf pbkdf2 --pbkdf-force-iterations 1000 -t writeback";
    roundtrip("rt-l2-wb", "luks2", 4 * MIB + 4096, options);
}

#[test]
fn roundtrip_luks2_cbc_essiv_sector512() {
    let options = "--pbkdf pbkdf2 --pbkdf-force-iterations 1000 \
                   --cipher aes-cbc-essiv:sha256 --sector-size 512";
    roundtrip("rt-l2-cbc", "luks2", 2 * MIB, options);
}

#[test]
fn roundtrip_luks1_4096_multiple() {
    let dump = roundtrip("rt-l1-4k", "luks1", 4 * MIB, LUKS1_CHEAP);
    assert_eq!(dump["version"], 1);
}

#[test]
fn roundtrip_luks1_not_4096_multiple() {
    roundtrip(
        "rt-l1-odd",
        "luks1",
        2 * MIB + 512,
        &format!("{LUKS1_CHEAP} --key-size 256"),
    );
}

/// LUKS -> LUKS re-encryption with a different passphrase and version.
#[test]
fn luks1_to_luks2_reencrypt() {
    let t = TestDir::new();
    let (k1, k2, src) = (t.key("k1"), t.key("k2"), t.path("src.raw"));
    mixed_file(&src, 3 * MIB, 3);
    let (l1, l2) = (t.path("a.luks1"), t.path("b.luks2"));
    cryptblk(argv!(
        "convert -O luks1 --pbkdf-force-iterations 1000 --key-file {} {} {}",
        k1,
        src,
        l1
    ))
    .ok();
    cryptblk_cheap(argv!(
        "convert -O luks2 --source-key-file {} --key-file {} {} {}",
        k1,
        k2,
        l1,
        l2
    ))
    .ok();
    assert_eq!(dump_json(&l2)["version"], 2);
    let out = cryptblk_decrypt(&l2, &k2, &t.path("out.raw"));
    assert_same_bytes(&out, &read(&src), "raw -> LUKS1 -> LUKS2 -> raw");
}

/// A line of the log (`TIMESTAMP LEVEL message`), which shares stderr with the progress
/// lines: e.g. the warning that a tmpfs image is served with aio=threads, when the tests'
/// temporary files are in RAM.
fn is_log_line(line: &str) -> bool {
    let mut words = line.split_whitespace();
    let stamped = words
        .next()
        .is_some_and(|w| w.ends_with('Z') && w.contains('T'));
    let levels = ["TRACE", "DEBUG", "INFO", "WARN", "ERROR"];
    stamped && words.next().is_some_and(|w| levels.contains(&w))
}

#[test]
fn progress_json_lines_end_with_done() {
    let t = TestDir::new();
    let (key, src, enc) = (t.key("key"), t.path("src.raw"), t.path("enc"));
    let size = 24 * MIB;
    mixed_file(&src, size, 5);
    let out = cryptblk_cheap(argv!(
        "convert --progress=json -O luks2 --key-file {} {} {}",
        key,
        src,
        enc
    ));
    out.ok();
    let lines = out
        .stderr
        .lines()
        .filter(|l| !l.starts_with("cryptblk: note:") && !is_log_line(l));
    let parse = |l: &str| -> serde_json::Value {
        let stderr = &out.stderr;
        serde_json::from_str(l)
            .unwrap_or_else(|e| panic!("progress line is not JSON ({e}): {l:?}\n{stderr}"))
    };
    let events: Vec<serde_json::Value> = lines.map(parse).collect();
    let last = events
        .last()
        .unwrap_or_else(|| panic!("no progress lines on stderr"));
    assert_eq!(last["event"], "done", "last progress event: {last}");
    assert_eq!(last["done_bytes"].as_u64(), Some(size), "{last}");
    assert_eq!(last["total_bytes"].as_u64(), Some(size), "{last}");
    let mut previous = 0;
    for e in &events {
        assert!(
            e["event"] == "progress" || e["event"] == "done",
            "unknown event {e}"
        );
        assert_eq!(e["total_bytes"].as_u64(), Some(size), "{e}");
        let done = e["done_bytes"].as_u64().expect("done_bytes");
        assert!(
            done >= previous && done <= size,
            "done_bytes must grow within the total: {e}"
        );
        previous = done;
    }
    let dones = events.iter().filter(|e| e["event"] == "done").count();
    assert_eq!(dones, 1, "exactly one done event");
}

#[test]
fn wrong_source_passphrase_leaves_nothing_behind() {
    let t = TestDir::new();
    let (key, bad, src, enc) = (t.key("key"), t.key("bad"), t.path("src.raw"), t.path("enc"));
    mixed_file(&src, MIB, 1);
    cryptblk_cheap(argv!("convert -O luks2 --key-file {} {} {}", key, src, enc)).ok();
    let before = files_in(t.root());

    let out = t.path("out.raw");
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        bad,
        enc,
        out
    ))
    .expect_code(code::WRONG_PASSPHRASE)
    .error_line(&["no keyslot matches"]);
    let what = "a failed convert must leave no target and no temp file";
    assert_eq!(files_in(t.root()), before, "{what}");

    // An existing file at the target name is not touched by a failed convert.
    let existing = t.path("keep.raw");
    std::fs::write(&existing, b"precious").unwrap();
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        bad,
        enc,
        existing
    ))
    .expect_code(code::WRONG_PASSPHRASE);
    assert_eq!(read(&existing), b"precious");
}

/// A qcow2 whose data clusters lie past the end of the file fails mid-copy: exit non-zero, no
/// target, no temp file, and an existing file of the target's name is left alone.
fn check_truncated_qcow2(target: &str) {
    let t = TestDir::new();
    let (key, src) = (t.key("key"), t.path("src.qcow2"));
    tool("qemu-img", argv!("create -q -f qcow2 {} 8M", src)).ok();
    tool("qemu-io", argv!("-c {} {}", "write -P 0x61 0 8M", src)).ok();
    let full = std::fs::metadata(&src).unwrap().len();
    assert!(full > 8 * MIB);
    // Keep the metadata and the first data clusters; cut the rest.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&src)
        .unwrap()
        .set_len(2 * MIB)
        .unwrap();
    let keep = t.path("keep.img");
    std::fs::write(&keep, b"existing target").unwrap();
    let before = files_in(t.root());

    for out_path in [t.path("out.img"), keep.clone()] {
        let out = if target == "raw" {
            cryptblk(argv!("convert -f qcow2 -O raw {} {}", src, out_path))
        } else {
            let convert = argv!(
                "convert -f qcow2 -O {} --key-file {} {} {}",
                target,
                key,
                src,
                out_path
            );
            cryptblk_cheap(convert)
        };
        assert_ne!(
            out.code, 0,
            "converting a truncated qcow2 to {target} succeeded: {out:?}"
        );
        let code = out.code;
        let what = format!("exit status {code} for a truncated source: {out:?}");
        assert!(code == code::DAMAGED || code == code::IO, "{what}");
        out.error_line(&[]);
        let what = format!("a failed convert to {target} left files behind");
        assert_eq!(files_in(t.root()), before, "{what}");
        let what = "a failed convert replaced an existing file";
        assert_eq!(read(&keep), b"existing target", "{what}");
    }
}

#[test]
fn truncated_qcow2_to_luks2_fails_cleanly() {
    check_truncated_qcow2("luks2");
}

#[test]
fn truncated_qcow2_to_raw_fails_cleanly() {
    check_truncated_qcow2("raw");
}

#[test]
fn write_into_existing_luks_keeps_header() {
    for version in ["luks2", "luks1"] {
        let t = TestDir::new();
        let (key, img, src) = (t.key("key"), t.path("img"), t.path("src.raw"));
        cryptblk_cheap(argv!(
            "format -q --type {} --key-file {} {} 6M",
            version,
            key,
            img
        ))
        .ok();
        let dump_before = dump_json(&img);
        let size_before = std::fs::metadata(&img).unwrap().len();

        mixed_file(&src, 4 * MIB, 9);
        cryptblk(argv!(
            "convert -n -O luks --key-file {} {} {}",
            key,
            src,
            img
        ))
        .ok();
        let dump_after = dump_json(&img);
        let what = format!("{version}: -n must keep the header (uuid)");
        assert_eq!(dump_after["uuid"], dump_before["uuid"], "{what}");
        let what = format!("{version}: -n must keep the keyslots");
        assert_eq!(dump_after["keyslots"], dump_before["keyslots"], "{what}");
        let what = format!("{version}: -n must not resize the image");
        assert_eq!(
            std::fs::metadata(&img).unwrap().len(),
            size_before,
            "{what}"
        );
        let out = cryptblk_decrypt(&img, &key, &t.path("out.raw"));
        assert_eq!(out.len() as u64, 6 * MIB);
        let what = format!("{version}: data written with -n");
        assert_same_bytes(&out[..4 * MIB as usize], &read(&src), &what);
    }
}

#[test]
fn write_into_existing_raw_keeps_tail() {
    let t = TestDir::new();
    let (target, src) = (t.path("target.raw"), t.path("src.raw"));
    std::fs::write(&target, vec![0xeeu8; 6 * MIB as usize]).unwrap();
    mixed_file(&src, 4 * MIB, 21);
    cryptblk(argv!("convert -n -f raw -O raw {} {}", src, target)).ok();
    let out = read(&target);
    assert_eq!(out.len() as u64, 6 * MIB, "-n must not truncate the target");
    let (data, tail) = out.split_at(4 * MIB as usize);
    assert_same_bytes(
        data,
        &read(&src),
        "-O raw -n data (zero runs and holes included)",
    );
    assert_filled(tail, 0xee, "bytes past the source's end are untouched");
}

#[test]
fn existing_target_too_small_is_refused() {
    let t = TestDir::new();
    let (target, src) = (t.path("small.raw"), t.path("src.raw"));
    std::fs::write(&target, vec![0x11u8; MIB as usize]).unwrap();
    mixed_file(&src, 2 * MIB, 2);
    let out = cryptblk(argv!("convert -n -O raw {} {}", src, target));
    assert_ne!(out.code, 0, "{out:?}");
    out.error_line(&[]);
    assert_filled(&read(&target), 0x11, "the refused target is unchanged");
}

/// Peak RSS of a 1 GiB sparse raw -> LUKS2 convert stays far below the image size.
#[test]
fn convert_1gib_rss_is_bounded() {
    let t = TestDir::new();
    let (key, src, enc, rss_file) = (
        t.key("key"),
        t.path("sparse.raw"),
        t.path("big.luks2"),
        t.path("rss"),
    );
    let size = 1u64 << 30;
    let f = std::fs::File::create(&src).unwrap();
    f.set_len(size).unwrap();
    // A little real data at both ends so the copy is not all holes.
    f.write_all_at(&[0x42u8; 65536], 0).unwrap();
    f.write_all_at(&[0x24u8; 65536], size - 65536).unwrap();
    let time = "-f %M -o {} {} convert -O luks2 --key-file {} {} {}";
    tool(
        "time",
        argv!(time, rss_file, bin(), key, src, enc; CHEAP_PBKDF2),
    )
    .ok();
    let text = std::fs::read_to_string(&rss_file).unwrap();
    let kib: Option<u64> = text.lines().rev().find_map(|l| l.trim().parse().ok());
    let kib = kib.unwrap_or_else(|| panic!("no RSS figure from /usr/bin/time: {text:?}"));
    let what = format!("peak RSS {kib} KiB while converting a 1 GiB image (limit 128 MiB)");
    assert!(kib < 128 * 1024, "{what}");
    let data_offset = dump_json(&enc)["data_offset"].as_u64().unwrap();
    assert_eq!(std::fs::metadata(&enc).unwrap().len(), data_offset + size);
    // Spot-check the end of the payload decrypts: convert back only a header + data check via -n
    // would be as large, so read the whole image back through cryptblk but into /dev/null-like raw.
    let back = t.path("back.raw");
    cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        key,
        enc,
        back
    ))
    .ok();
    let f = std::fs::File::open(&back).unwrap();
    let read_at = |at: u64, fill: u8| {
        let mut buf = vec![fill; 65536];
        f.read_exact_at(&mut buf, at).unwrap();
        buf
    };
    assert_filled(
        &read_at(size - 65536, 0),
        0x24,
        "the last 64 KiB round-trip",
    );
    assert_filled(&read_at(0, 0), 0x42, "the first 64 KiB round-trip");
    assert_filled(&read_at(size / 2, 0xff), 0, "holes round-trip as zeros");
}

#[test]
fn interrupt_removes_the_partial_target() {
    let t = TestDir::new();
    let (key, src, dst) = (t.key("key"), t.path("big.raw"), t.path("out.luks"));
    // Sparse, so it costs no disk; a LUKS target still has to encrypt and write every zero,
    // and 4 KiB chunks make that slow enough to be caught mid-way.
    std::fs::File::create(&src)
        .unwrap()
        .set_len(64 << 30)
        .unwrap();
    let child = std::process::Command::new(bin())
        .args(argv!("convert -O luks2 --chunk-size 4K --key-file {}", key))
        .args(CHEAP_PBKDF2)
        .args([s(&src), s(&dst)])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the copy is under way (the temporary target exists), then interrupt it.
    let started = std::time::Instant::now();
    while !files_in(t.root())
        .iter()
        .any(|f| f.ends_with(".cryptblk-partial"))
    {
        let waited = started.elapsed().as_secs();
        assert!(waited < 60, "convert never created its temporary target");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    // SAFETY: kill only sends a signal to the child we spawned and still own.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(8), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(stderr.contains("partial target was removed"), "{stderr}");
    let what = "an interrupted convert left files behind";
    assert_eq!(files_in(t.root()), ["big.raw", "key"], "{what}");
}
