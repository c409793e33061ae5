//! `cryptblk serve --nbd`: the daemon's disks as NBD exports, driven by the real clients
//! (qemu-img, qemu-io, nbdinfo, nbdcopy); disks added at run time get an export too.
mod common;

use common::*;
use std::path::{Path, PathBuf};

fn spawn_serve(args: &[&str], ready: &Path) -> ServeProcess {
    ServeProcess::start(args, ready)
}

fn terminate(serve: ServeProcess) -> i32 {
    serve.terminate()
}

fn uri(name: &str, socket: &Path) -> String {
    format!("nbd+unix:///{name}?socket={}", socket.display())
}

fn luks2(dir: &Path, key: &Path, size: &str) -> PathBuf {
    let img = dir.join("disk.luks");
    format_luks2(&img, key, size);
    img
}

#[test]
fn luks2_over_nbd_with_qemu_img_qemu_io_nbdinfo_and_nbdcopy() {
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("nbd"));
    let img = luks2(dir.path(), &key, "16M");
    let source = dir.path().join("source.raw");
    mixed_file(&source, 16 * MIB, 11);
    let sock = dir.path().join("nbd.sock");
    let child = spawn_serve(
        &[
            "--image",
            s(&img),
            "--key-file",
            s(&key),
            "--name",
            "vol",
            "--nbd",
            &format!("unix:{}", s(&sock)),
        ],
        &sock,
    );
    let vol = uri("vol", &sock);

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
    let copy = dir.path().join("copy.raw");
    tool("nbdcopy", ["--connections=4", &vol, s(&copy)]).ok();
    let mut expected = read(&source);
    expected[MIB as usize..MIB as usize + 256 * 1024].fill(0x5a);
    assert_same_bytes(&read(&copy), &expected, "nbdcopy of the export");

    // After SIGTERM the image decrypts (by cryptblk convert) to the same bytes.
    assert_eq!(terminate(child), code::OK);
    assert!(!sock.exists(), "NBD socket left behind");
    let plain = cryptblk_decrypt(&img, &key, &dir.path().join("plain.raw"));
    assert_same_bytes(&plain, &expected, "decrypted image");
}

#[test]
fn disks_added_at_run_time_are_listed_as_exports() {
    let dir = tempdir();
    let control = dir.path().join("ctl.sock");
    let sock = dir.path().join("nbd.sock");
    let child = spawn_serve(
        &[
            "--control",
            s(&control),
            "--nbd",
            &format!("unix:{}", s(&sock)),
        ],
        &control,
    );
    let (a, b) = (dir.path().join("a.raw"), dir.path().join("b.raw"));
    random_file(&a, 2 * MIB, 1);
    std::fs::File::create(&b).unwrap().set_len(4 * MIB).unwrap();
    cryptblk([
        "ctl",
        "-s",
        s(&control),
        "disk-add",
        "a",
        "--image",
        s(&a),
        "--nbd-export",
    ])
    .ok();
    cryptblk([
        "ctl",
        "-s",
        s(&control),
        "disk-add",
        "b",
        "--image",
        s(&b),
        "--nbd-export",
        "--discard",
    ])
    .ok();
    let trim = |name: &str| tool("nbdinfo", ["--can", "trim", &uri(name, &sock)]).code == 0;
    assert!(
        !trim("a") && trim("b"),
        "TRIM must follow the disk's discard setting"
    );
    let list = tool("nbdinfo", ["--list", "--json", &uri("", &sock)]);
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
    let map = tool("nbdinfo", ["--map", &uri("b", &sock)]);
    map.ok();
    assert!(map.stdout.contains("hole"), "{}", map.stdout);

    cryptblk(["ctl", "-s", s(&control), "disk-remove", "a"]).ok();
    let out = tool("nbdinfo", ["--size", &uri("a", &sock)]);
    assert_ne!(out.code, 0, "a removed disk is still exported");
    let out = tool("nbdinfo", ["--size", &uri("b", &sock)]);
    out.ok();
    assert_eq!(out.stdout.trim(), (4 * MIB).to_string());
    assert_eq!(terminate(child), code::OK);
}
