//! Growing disks: `cryptblk resize` on images that are not served (LUKS1 made by qemu-img,
//! LUKS2 made by cryptsetup with a `dynamic` and with a fixed-length data segment, raw), checked
//! with cryptsetup luksDump, qemu-img and qemu-io; and `ctl disk-resize` on a served disk, seen
//! by new NBD clients while writes at the old end go on, with a resize the filesystem refuses
//! (a file size limit set on the daemon by `prlimit`) leaving the disk serving at its old size.
mod common;

use common::*;
use std::path::Path;

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

/// The "Data segments" part of `cryptsetup luksDump`.
fn luks_dump_segment(img: &Path) -> String {
    let out = tool("cryptsetup", ["luksDump", s(img)]);
    out.ok();
    let start = out.stdout.find("Data segments:").expect("no data segments");
    let end = out.stdout[start..].find("Keyslots:").unwrap() + start;
    out.stdout[start..end].to_string()
}

/// Rewrites the data segment of both LUKS2 header copies as fixed-length (`size` bytes), with
/// their checksums: cryptsetup writes such segments only in the middle of a reencryption, and
/// cryptblk never does, so the test makes one by hand (luksDump then reads it back).
fn make_segment_fixed(img: &Path, size: u64) {
    let mut bytes = std::fs::read(img).unwrap();
    let hdr_size = u64::from_be_bytes(bytes[8..16].try_into().unwrap()) as usize;
    for copy in [0, hdr_size] {
        let area = &mut bytes[copy..copy + hdr_size];
        let json_end = area[4096..].iter().position(|&b| b == 0).unwrap() + 4096;
        let mut meta: serde_json::Value = serde_json::from_slice(&area[4096..json_end]).unwrap();
        meta["segments"]["0"]["size"] = serde_json::Value::String(size.to_string());
        let json = serde_json::to_vec(&meta).unwrap();
        area[4096..].fill(0);
        area[4096..4096 + json.len()].copy_from_slice(&json);
        area[448..512].fill(0);
        let scratch = img.with_extension("area");
        std::fs::write(&scratch, &*area).unwrap();
        let digest = tool("sha256sum", [s(&scratch)]);
        digest.ok();
        let digest = hex::decode(&digest.stdout[..64]).unwrap();
        area[448..448 + 32].copy_from_slice(&digest);
    }
    std::fs::write(img, bytes).unwrap();
}

#[test]
fn offline_resize_of_a_qemu_made_luks1_image() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks1_by_qemu("img.luks", "6M", &key, "iter-time=10");
    let qemu = qemu_luks(&img, &key);
    qemu_io_cmds(&qemu, &["write -P 0x5a 0 64k", "write -P 0xa5 6080k 64k"]);
    let before = file_len(&img);

    let out = cryptblk(["resize", s(&img), "10M"]);
    out.ok();
    assert!(out.stderr.contains("6291456 -> 10485760"), "{}", out.stderr);
    assert_eq!(file_len(&img), before + 4 * MIB);
    let (secret, opts) = (qemu_secret(&key), qemu_luks_opts(&img));
    let info = tool(
        "qemu-img",
        argv!("info --object {} --image-opts {}", secret, opts),
    );
    info.ok();
    assert!(
        info.stdout
            .contains("virtual size: 10 MiB (10485760 bytes)"),
        "{}",
        info.stdout
    );
    // What was there is still there (the old end included), and QEMU writes past it.
    qemu_io_cmds(
        &qemu,
        &[
            "read -P 0x5a 0 64k",
            "read -P 0xa5 6080k 64k",
            "write -P 0x3c 10176k 64k",
            "read -P 0x3c 10176k 64k",
        ],
    );
    let dump = luks_dump_v1(&img);
    assert!(
        dump.lines()
            .any(|l| l.starts_with("Version:") && l.trim_end().ends_with('1')),
        "{dump}"
    );
    assert!(cryptsetup_accepts(&img, &key));
}

/// `cryptsetup luksDump` of a LUKS1 image (it has no segment list).
fn luks_dump_v1(img: &Path) -> String {
    let out = tool("cryptsetup", ["luksDump", s(img)]);
    out.ok();
    out.stdout
}

#[test]
fn offline_resize_of_luks2_dynamic_and_fixed_segments() {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("resize-luks2"));
    let plain = dir.path().join("plain.raw");
    mixed_file(&plain, 4 * MIB, 25);
    let plain = read(&plain);
    let mut extra = CS_CHEAP_PBKDF2.to_vec();
    extra.extend(["--sector-size", "4096"]);
    let dynamic = cryptsetup_encrypt_in_place(dir.path(), "dynamic.luks", &plain, &key, &extra);
    let fixed = dir.path().join("fixed.luks");
    std::fs::copy(&dynamic, &fixed).unwrap();
    let offset: u64 = luks_dump_segment(&dynamic)
        .lines()
        .find_map(|l| l.trim().strip_prefix("offset: ")?.strip_suffix(" [bytes]"))
        .and_then(|n| n.parse().ok())
        .expect("the data segment's offset");
    let old = file_len(&dynamic) - offset;
    let (grown, shrunk) = (old + 4 * MIB, old + 2 * MIB);
    let size_arg = |n: u64| format!("{}K", n / 1024);

    // dynamic: the image grows, the header stays as it was.
    assert!(luks_dump_segment(&dynamic).contains("length: (whole device)"));
    cryptblk(["resize", s(&dynamic), &size_arg(grown)]).ok();
    assert_eq!(file_len(&dynamic), offset + grown);
    assert!(luks_dump_segment(&dynamic).contains("length: (whole device)"));
    let data = cryptblk_decrypt(&dynamic, &key, &dir.path().join("dynamic.raw"));
    assert_eq!(data.len() as u64, grown);
    assert_same_bytes(
        &data[..plain.len()],
        &plain,
        "dynamic: the data before the old end",
    );
    assert!(cryptsetup_accepts(&dynamic, &key));

    // fixed: both header copies carry the new length.
    make_segment_fixed(&fixed, old);
    let segment = luks_dump_segment(&fixed);
    assert!(
        segment.contains(&format!("length: {old} [bytes]")),
        "{segment}"
    );
    let out = cryptblk(["resize", s(&fixed), &size_arg(grown)]);
    out.ok();
    assert!(out.stderr.contains("both header copies"), "{}", out.stderr);
    assert_eq!(file_len(&fixed), offset + grown);
    let segment = luks_dump_segment(&fixed);
    assert!(
        segment.contains(&format!("length: {grown} [bytes]")),
        "{segment}"
    );
    // The secondary copy alone (the primary's magic wiped on a copy of the image).
    let secondary = dir.path().join("secondary.luks");
    let mut bytes = std::fs::read(&fixed).unwrap();
    bytes[..6].fill(0);
    std::fs::write(&secondary, bytes).unwrap();
    let segment = luks_dump_segment(&secondary);
    assert!(
        segment.contains(&format!("length: {grown} [bytes]")),
        "{segment}"
    );
    let data = cryptblk_decrypt(&fixed, &key, &dir.path().join("fixed.raw"));
    assert_eq!(data.len() as u64, grown);
    assert_same_bytes(
        &data[..plain.len()],
        &plain,
        "fixed: the data before the old end",
    );
    assert!(cryptsetup_accepts(&fixed, &key));

    // Shrinking: only when allowed, and then the header and the image follow.
    cryptblk(["resize", s(&fixed), &size_arg(shrunk)]).expect_code(1);
    assert!(luks_dump_segment(&fixed).contains(&format!("length: {grown} [bytes]")));
    cryptblk(["resize", "--allow-shrink", s(&fixed), &size_arg(shrunk)]).ok();
    assert!(luks_dump_segment(&fixed).contains(&format!("length: {shrunk} [bytes]")));
    assert_eq!(file_len(&fixed), offset + shrunk);
}

#[test]
fn offline_resize_refusals_leave_the_image_as_it_was() {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("resize-refused"));
    let luks = dir.path().join("disk.luks");
    format_luks2(&luks, &key, "8M");
    let len = file_len(&luks);

    // Off the 4096-byte sector grid: the message says what would do.
    let out = cryptblk(["resize", s(&luks), "9001K"]);
    out.expect_code(1);
    assert!(
        out.stderr.contains("4096-byte sector size"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("use 9220096"), "{}", out.stderr);
    // A shrink not allowed.
    let out = cryptblk(["resize", s(&luks), "4M"]);
    out.expect_code(1);
    assert!(out.stderr.contains("--allow-shrink"), "{}", out.stderr);
    // A file size limit refuses the new length: an I/O error, nothing changed.
    let limit = format!("--fsize={len}");
    let out = tool("prlimit", [&limit, bin(), "resize", s(&luks), "64M"]);
    out.expect_code(5);
    assert!(out.stderr.contains("File too large"), "{}", out.stderr);
    assert_eq!(file_len(&luks), len);
    assert!(cryptsetup_accepts(&luks, &key));
    // Not a format cryptblk resizes.
    let qcow2 = dir.path().join("disk.qcow2");
    tool("qemu-img", ["create", "-q", "-f", "qcow2", s(&qcow2), "1M"]).ok();
    let out = cryptblk(["resize", s(&qcow2), "2M"]);
    out.expect_code(1);
    assert!(out.stderr.contains("qemu-img resize"), "{}", out.stderr);

    // A raw image that a daemon serves is locked: in use.
    let t = TestDir::new();
    let raw = t.raw("disk.raw", MIB);
    let mut daemon = t.serve().disk(&raw).nbd().start();
    cryptblk(["resize", s(&raw), "2M"]).expect_code(6);
    assert_eq!(daemon.terminate(), 0);
    cryptblk(["resize", s(&raw), "2M"]).ok();
    let info = tool("qemu-img", ["info", "-f", "raw", s(&raw)]);
    assert!(
        info.stdout.contains("virtual size: 2 MiB"),
        "{}",
        info.stdout
    );
}

fn nbd_size(vol: &str) -> u64 {
    let out = tool("nbdinfo", ["--size", vol]);
    out.ok();
    out.stdout.trim().parse().unwrap()
}

#[test]
fn disk_resize_of_a_served_luks2_disk_over_nbd() {
    let t = TestDir::new();
    let img = t.luks2("disk.luks", "8M", &t.key("key"));
    let mut daemon = t.serve().control().disk(&img).name("vol").nbd().start();
    let vol = daemon.nbd_uri("vol");
    assert_eq!(nbd_size(&vol), 8 * MIB);

    // A client keeps writing the last MiB before the old end while the disk grows three
    // times: every write lands (its connection keeps the size it was told).
    let target = ["-f".to_string(), "raw".to_string(), vol.clone()];
    let writer = std::thread::spawn(move || {
        let writes: Vec<String> = (0..256u64)
            .map(|i| format!("write -P {} {} 4k", i % 250 + 1, 7 * MIB + i * 4096))
            .collect();
        qemu_io_cmds(
            &target,
            &writes.iter().map(String::as_str).collect::<Vec<_>>(),
        )
    });
    for size in ["9M", "10M", "12M"] {
        let result = daemon.ctl_ok(&["disk-resize", "vol", size]);
        assert_eq!(result["name"], "vol");
        // No vhost-user frontend: nobody to tell.
        assert_eq!(result["guest-notified"], false);
    }
    writer.join().unwrap();
    let reads: Vec<String> = (0..256u64)
        .map(|i| format!("read -P {} {} 4k", i % 250 + 1, 7 * MIB + i * 4096))
        .collect();
    daemon.qemu_io("vol", &reads.iter().map(String::as_str).collect::<Vec<_>>());
    // New connections see the new size, and it takes data.
    assert_eq!(nbd_size(&vol), 12 * MIB);
    daemon.qemu_io("vol", &["write -P 0x6b 11M 1M", "read -P 0x6b 11M 1M"]);
    let list = daemon.ctl_ok(&["disk-list"]);
    assert_eq!(list["disks"][0]["size"], 12 * MIB);

    // The filesystem refuses the next size (a file size limit on the daemon): the error says
    // so, and the disk goes on at its old size.
    let len = file_len(&img);
    let pid = daemon.pid().to_string();
    let limit = format!("--fsize={len}:{len}");
    tool("prlimit", ["--pid", &pid, &limit]).ok();
    let refused = daemon.ctl(&["disk-resize", "vol", "16M"]);
    refused.expect_code(5);
    assert!(
        refused.stderr.contains("File too large"),
        "{}",
        refused.stderr
    );
    assert!(refused.stderr.contains("refused"), "{}", refused.stderr);
    assert_eq!(file_len(&img), len);
    assert_eq!(nbd_size(&vol), 12 * MIB);
    daemon.qemu_io(
        "vol",
        &[
            "write -P 0x2e 12284k 4k",
            "read -P 0x2e 12284k 4k",
            "read -P 0x6b 11M 1020k",
        ],
    );
    // A shrink is refused unless allowed.
    let shrink = daemon.ctl(&["disk-resize", "vol", "4M"]);
    shrink.expect_code(1);
    assert!(shrink.stderr.contains("allow-shrink"), "{}", shrink.stderr);
    assert_eq!(daemon.terminate(), 0);

    // On the host, the image decrypts to 12 MiB with everything written.
    let data = img.decrypt(&t.path("out.raw"));
    assert_eq!(data.len() as u64, 12 * MIB);
    for i in 0..256usize {
        let at = 7 * MIB as usize + i * 4096;
        assert!(
            data[at..at + 4096]
                .iter()
                .all(|&b| b == (i % 250 + 1) as u8),
            "the write at {at} was lost"
        );
    }
    assert!(data[11 * MIB as usize..12 * MIB as usize - 4096]
        .iter()
        .all(|&b| b == 0x6b));
    assert!(data[12 * MIB as usize - 4096..].iter().all(|&b| b == 0x2e));
}
