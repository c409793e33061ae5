//! `cryptblk serve --nbd`: the daemon's disks as NBD exports, driven by the real clients
//! (qemu-img, qemu-io, nbdinfo, nbdcopy); disks added at run time get an export too.
mod common;

use common::*;

#[test]
fn luks2_over_nbd_with_qemu_img_qemu_io_nbdinfo_and_nbdcopy() {
    let t = TestDir::new();
    let img = t.luks2("disk.luks", "16M", &t.key("key"));
    let source = t.path("source.raw");
    mixed_file(&source, 16 * MIB, 11);
    let mut daemon = t.serve().disk(&img).name("vol").nbd().start();
    let vol = daemon.nbd_uri("vol");

    // qemu-img writes the whole disk through the export, then compares it back.
    tool(
        "qemu-img",
        ["convert", "-n", "-f", "raw", "-O", "raw", s(&source), &vol],
    )
    .ok();
    tool(
        "qemu-img",
        ["compare", "-f", "raw", "-F", "raw", s(&source), &vol],
    )
    .ok();

    // nbdinfo: size and the LUKS sector as the minimum block size.
    let info = tool("nbdinfo", ["--json", &vol]);
    info.ok();
    let v: serde_json::Value = serde_json::from_str(&info.stdout).unwrap();
    let export = &v["exports"][0];
    assert_eq!(export["export-size"], 16 * MIB, "{}", info.stdout);
    assert_eq!(export["block_size_minimum"], 4096, "{}", info.stdout);
    // Discard is opt-in (holes in an encrypted image reveal unused blocks).
    assert_eq!(export["can_trim"], false, "{}", info.stdout);

    // qemu-io: a pattern written with FUA reads back.
    tool(
        "qemu-io",
        [
            "-f",
            "raw",
            "-c",
            "write -f -P 0x5a 1M 256k",
            "-c",
            "read -P 0x5a 1M 256k",
            &vol,
        ],
    )
    .ok();

    // nbdcopy out with four connections equals what was written.
    let copy = t.path("copy.raw");
    tool("nbdcopy", ["--connections=4", &vol, s(&copy)]).ok();
    let mut expected = read(&source);
    expected[MIB as usize..MIB as usize + 256 * 1024].fill(0x5a);
    assert_same_bytes(&read(&copy), &expected, "nbdcopy of the export");

    // After SIGTERM the image decrypts (by cryptblk convert) to the same bytes.
    assert_eq!(daemon.terminate(), code::OK);
    assert!(!daemon.nbd_socket().exists(), "NBD socket left behind");
    let plain = img.decrypt(&t.path("plain.raw"));
    assert_same_bytes(&plain, &expected, "decrypted image");
}

#[test]
fn disks_added_at_run_time_are_listed_as_exports() {
    let t = TestDir::new();
    let mut daemon = t.serve().control().nbd().start();
    let a = t.path("a.raw");
    random_file(&a, 2 * MIB, 1);
    let b = t.raw("b.raw", 4 * MIB);
    daemon.ctl_ok(&["disk-add", "a", "--image", s(&a), "--nbd-export"]);
    daemon.ctl_ok(&argv!("disk-add b --image {} --nbd-export --discard", b));
    let uri = |name: &str| daemon.nbd_uri(name);
    let trim = |name: &str| tool("nbdinfo", ["--can", "trim", &uri(name)]).code == 0;
    assert!(
        !trim("a") && trim("b"),
        "TRIM must follow the disk's discard setting"
    );
    let list = tool("nbdinfo", ["--list", "--json", &uri("")]);
    list.ok();
    let v: serde_json::Value = serde_json::from_str(&list.stdout).unwrap();
    let mut names: Vec<&str> = v["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["export-name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["a", "b"], "{}", list.stdout);
    // The sparse raw disk shows its hole to block-status clients.
    let map = tool("nbdinfo", ["--map", &uri("b")]);
    map.ok();
    assert!(map.stdout.contains("hole"), "{}", map.stdout);

    daemon.ctl_ok(&["disk-remove", "a"]);
    let out = tool("nbdinfo", ["--size", &uri("a")]);
    assert_ne!(out.code, 0, "a removed disk is still exported");
    let out = tool("nbdinfo", ["--size", &uri("b")]);
    out.ok();
    assert_eq!(out.stdout.trim(), (4 * MIB).to_string());
    assert_eq!(daemon.terminate(), code::OK);
}
