//! `cryptblk reencrypt rbd:...` on a throwaway single-node Ceph cluster: a LUKS2 disk in RBD
//! gets a new volume key of another size (several hotzones, read ahead), refused while a
//! daemon serves it; a plaintext RBD image is encrypted in place offline, and another while a
//! daemon serves it (`ctl reencrypt-start --encrypt`), keeping its size. librbd's own
//! encryption (QEMU's rbd driver with `encrypt.format=luks2`) reads the results.
mod common;

use common::*;
use cryptblk_testutil::ceph;

/// qemu-io's arguments for `image` through librbd: decrypted by librbd with `key`, or raw.
fn librbd(cluster: &ceph::Cluster, image: &str, key: Option<&std::path::Path>) -> Vec<String> {
    let mut opts = format!(
        "driver=rbd,pool=rbd,image={image},conf={}",
        cluster.conf.display()
    );
    let mut args = Vec::new();
    if let Some(key) = key {
        args.push("--object".to_string());
        args.push(format!("secret,id=s0,file={}", s(key)));
        opts.push_str(",encrypt.format=luks2,encrypt.key-secret=s0");
    }
    args.push("--image-opts".to_string());
    args.push(opts);
    args
}

/// The volume key's size in bits (its keyslot's), and whether a reencryption is still
/// recorded (a `reencrypt` keyslot).
fn key_bits_and_reencrypting(image: &str) -> (u64, bool) {
    let out = cryptblk(["dump", "--json", image]);
    out.ok();
    let dump: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let keyslots = dump["keyslots"].as_array().unwrap();
    let bits: Vec<u64> = keyslots
        .iter()
        .filter(|k| k["type"] == "luks2")
        .map(|k| k["key_bits"].as_u64().unwrap())
        .collect();
    assert_eq!(bits.len(), 1, "{dump}");
    (bits[0], keyslots.iter().any(|k| k["type"] == "reencrypt"))
}

#[test]
fn rbd_images_are_reencrypted_and_encrypted_offline_and_online() {
    let Some(cluster) = ceph::start() else {
        return;
    };
    let t = TestDir::new();
    let key = t.key("key");

    // A LUKS2 disk (512-bit key) with data written by librbd at both ends.
    let name = cluster.name("rekeyed");
    format_luks2(std::path::Path::new(&name), &key, "24M");
    let encrypted = librbd(&cluster, "rekeyed", Some(&key));
    qemu_io_cmds(&encrypted, &["write -P 0x5a 0 1M", "write -P 0x3c 23M 1M"]);
    assert_eq!(key_bits_and_reencrypting(&name), (512, false));

    // Served by a daemon, the image is under its lock: "in use", nothing changed.
    let serve = t.serve().control().image(&name).key(&key).name("rekeyed");
    let mut daemon = serve.nbd().start();
    cryptblk(["reencrypt", "--key-file", s(&key), &name]).expect_code(code::IN_USE);
    assert_eq!(daemon.terminate(), 0);
    assert_eq!(key_bits_and_reencrypting(&name), (512, false));

    // A new 256-bit volume key, 4 MiB hotzones: librbd reads the data with it.
    cryptblk(argv!(
        "reencrypt --key-file {} --key-size 256 --hotzone-size 4M --pbkdf pbkdf2 --iter-time 10 {}",
        key,
        &name
    ))
    .ok();
    assert_eq!(key_bits_and_reencrypting(&name), (256, false));
    qemu_io_cmds(&encrypted, &["read -P 0x5a 0 1M", "read -P 0x3c 23M 1M"]);

    // A plaintext RBD image encrypted in place, 8 MiB given up at its end for the header.
    let plain = cluster.name("plain");
    cluster.rbd(&["create", "--size", "24M", "plain"]);
    let raw = librbd(&cluster, "plain", None);
    qemu_io_cmds(&raw, &["write -P 0x71 0 1M", "write -P 0x17 15M 1M"]);
    cryptblk(argv!("reencrypt --encrypt --reduce-device-size 8M --key-file {} --pbkdf pbkdf2 --iter-time 10 {}", key, &plain))
    .ok();
    assert!(!key_bits_and_reencrypting(&plain).1);
    // cryptsetup's layout: a 4 MiB header (half the reduction) before a dynamic payload of
    // 20 MiB whose first 16 MiB (the image less the reduction) hold the data.
    let dump = cryptblk(["dump", "--json", &plain]);
    dump.ok();
    let dump: serde_json::Value = serde_json::from_str(&dump.stdout).unwrap();
    assert_eq!(dump["data_offset"], 4 << 20, "{dump}");
    let decrypted = librbd(&cluster, "plain", Some(&key));
    let info = tool("qemu-img", [&["info".to_string()][..], &decrypted].concat());
    info.ok();
    assert!(
        info.stdout.contains("virtual size: 20 MiB"),
        "{}",
        info.stdout
    );
    qemu_io_cmds(&decrypted, &["read -P 0x71 0 1M", "read -P 0x17 15M 1M"]);

    // A plaintext RBD image served over NBD, encrypted while a client writes it: the disk
    // keeps its 24 MiB, the image ends as the 4 MiB header and the disk.
    let online = cluster.name("online");
    cluster.rbd(&["create", "--size", "24M", "online"]);
    let serve = t.serve_as("online").control().image(&online).name("online");
    let mut daemon = serve.nbd().start();
    let mut c = daemon.nbd("online");
    let pattern = |byte: u8| vec![byte; MIB as usize];
    c.write(0, &pattern(0x61), false).unwrap();
    c.write(23 * MIB, &pattern(0x62), false).unwrap();
    c.flush().unwrap();
    let start = "reencrypt-start online --encrypt --key-file {} --reduce-device-size 8M";
    let st = daemon.ctl_ok(&argv!(start, key; CTL_CHEAP_KDF, ["--max-bandwidth", "8M"]));
    assert_eq!(st["mode"], "encrypt", "{st}");
    // Written while it runs, on both sides of wherever the boundary is.
    c.write(12 * MIB, &pattern(0x63), false).unwrap();
    c.write(MIB, &pattern(0x64), false).unwrap();
    c.flush().unwrap();
    daemon.wait_reencrypt("online", "the end", |st| st["phase"] == "finished");
    for (at, byte) in [(0, 0x61), (MIB, 0x64), (12 * MIB, 0x63), (23 * MIB, 0x62)] {
        assert!(
            c.read(at, MIB as u32).unwrap() == pattern(byte),
            "{byte:#x} at {at}"
        );
    }
    drop(c);
    assert_eq!(daemon.terminate(), 0);
    assert!(!key_bits_and_reencrypting(&online).1);
    let decrypted = librbd(&cluster, "online", Some(&key));
    let info = tool("qemu-img", [&["info".to_string()][..], &decrypted].concat());
    info.ok();
    assert!(
        info.stdout.contains("virtual size: 24 MiB"),
        "{}",
        info.stdout
    );
    qemu_io_cmds(
        &decrypted,
        &[
            "read -P 0x61 0 1M",
            "read -P 0x64 1M 1M",
            "read -P 0x63 12M 1M",
            "read -P 0x62 23M 1M",
        ],
    );
    // Attached again with its passphrase, it is an ordinary LUKS2 disk of the same size.
    daemon.restart_with(|serve| serve.key(&key));
    let mut c = daemon.nbd("online");
    assert_eq!(c.export.size, 24 * MIB);
    assert!(c.read(12 * MIB, MIB as u32).unwrap() == pattern(0x63));
    drop(c);
    assert_eq!(daemon.terminate(), 0);
}
