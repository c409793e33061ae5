//! Network-bound unlock against the real tools: a LUKS2 image bound by Debian's `clevis luks
//! bind` to a real `tangd` (on loopback, started and stopped by this test) is served with no
//! key; the tang server down or its keys replaced give an error naming the token and the
//! server, and the passphrase keyslot still opens the disk, before or after the token.
mod common;
#[path = "../../clevis/tests/support/tang_server.rs"]
mod tang_server;

use common::*;
use std::path::Path;
use tang_server::{require, TangServer};

/// The export `vol` of `daemon` holds exactly `data` (qemu-img compare over NBD).
fn assert_served_data(data: &Path, daemon: &Daemon) {
    let vol = daemon.nbd_uri("vol");
    tool(
        "qemu-img",
        ["compare", "-f", "raw", "-F", "raw", s(data), &vol],
    )
    .ok();
}

/// qemu-img writes `data` over the export "vol" of `daemon`.
fn write_served_data(data: &Path, daemon: &Daemon) {
    let vol = daemon.nbd_uri("vol");
    tool(
        "qemu-img",
        ["convert", "-n", "-f", "raw", "-O", "raw", s(data), &vol],
    )
    .ok();
}

/// `clevis luks bind` of `img` to the tang at `url`, unlocking with `key`; returns the
/// passphrase clevis put in its keyslot (registered as a secret no output may show).
fn clevis_bind(t: &TestDir, img: &Path, key: &Path, url: &str) -> String {
    require("clevis", "clevis");
    require("clevis-luks-bind", "clevis-luks");
    let cfg = format!("{{\"url\":\"{url}\"}}");
    tool(
        "clevis",
        argv!("luks bind -y -d {} -k {} tang {}", img, key, &cfg),
    )
    .ok();
    let pass = tool("clevis", ["luks", "pass", "-d", s(img), "-s", "1"]);
    pass.ok();
    t.key_with("clevis-pass", pass.stdout.trim_end()).passphrase
}

/// The `Tokens:` section of a luksDump-style text, up to `Digests:`.
fn tokens_section(dump: &str) -> String {
    let start = dump.find("Tokens:").expect("a Tokens: section");
    let end = dump[start..].find("Digests:").expect("a Digests: section") + start;
    dump[start..end].to_owned()
}

/// `cryptblk serve` of `img` as "vol" over NBD.
fn serve(t: &TestDir, img: &Path) -> Serve {
    t.serve().image(img).name("vol").nbd()
}

#[test]
fn a_disk_bound_by_clevis_to_tang_is_served_with_no_key() {
    let mut tang = TangServer::start();
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2_by_cryptsetup("disk.luks", 32 * MIB, &key);
    let data = t.path("data.raw");
    mixed_file(&data, 16 * MIB, 25);
    let sock = t.path("nbd.sock");

    // Data written through the passphrase before the binding.
    write_served_data(&data, &serve(&t, &img).key(&key).start());
    let clevis_secret = clevis_bind(&t, &img, &key, &tang.url);

    // `dump` lists the token as cryptsetup does.
    let ours = cryptblk(["dump", s(&img)]);
    ours.ok();
    let theirs = tool("cryptsetup", ["luksDump", s(&img)]);
    theirs.ok();
    assert_eq!(tokens_section(&ours.stdout), tokens_section(&theirs.stdout));
    assert_eq!(
        tokens_section(&ours.stdout),
        "Tokens:\n  0: clevis\n\tKeyslot:    1\n"
    );
    assert_eq!(
        dump_json(&img)["tokens"],
        serde_json::json!([{"id": "0", "type": "clevis", "keyslots": ["1"]}])
    );

    // No key given: the token unlocks it through tang, and the data reads back.
    let mut daemon = serve(&t, &img).start();
    assert_served_data(&data, &daemon);
    daemon.terminate();
    let text = daemon.log();
    assert!(
        text.contains("unlocked through clevis token") && text.contains(&tang.url),
        "{text}"
    );
    assert!(
        !text.contains(&clevis_secret),
        "the recovered passphrase was logged:\n{text}"
    );

    // A wrong key file: the token still opens it (key sources are tried in order).
    let wrong = t.key("wrong");
    let daemon = serve(&t, &img).key(&wrong).start();
    tool("nbdinfo", [&daemon.nbd_uri("vol")]).ok();
    drop(daemon);

    // tang down: no key given fails, naming the token and the server, exit 5 (I/O).
    let url = tang.url.clone();
    tang.stop();
    let out = cryptblk(argv!("serve --image {} --nbd unix:{}", img, sock));
    out.expect_code(code::IO);
    out.error_line(&["clevis token 0", &url, "unreachable"]);
    assert!(
        !sock.exists(),
        "no socket is bound when the disk cannot be opened"
    );

    // ... and the passphrase keyslot still opens it, with the data.
    assert_served_data(&data, &serve(&t, &img).key(&key).start());

    // Both failing: a wrong key file and tang down name both, exit 2 (the key file came first).
    let out = cryptblk(argv!(
        "serve --image {} --key-file {} --nbd unix:{}",
        img,
        wrong,
        sock
    ));
    out.expect_code(code::WRONG_PASSPHRASE);
    out.error_line(&["no keyslot matches", "clevis token 0", &url]);

    // The server back (same address) with other keys: the token's key is gone, said so.
    tang.restart();
    tang.replace_keys();
    assert_eq!(tang.url, url);
    let out = cryptblk(argv!("serve --image {} --nbd unix:{}", img, sock));
    out.expect_code(code::WRONG_PASSPHRASE);
    out.error_line(&["clevis token 0", &url, "has no key"]);
}

#[test]
fn disk_add_with_no_key_file_unlocks_through_the_token() {
    let mut tang = TangServer::start();
    let t = TestDir::new();
    let key = t.key("key");
    let img = t.luks2_by_cryptsetup("disk.luks", 32 * MIB, &key);
    clevis_bind(&t, &img, &key, &tang.url);
    let data = t.path("data.raw");
    mixed_file(&data, 16 * MIB, 26);
    let daemon = t.serve().control().nbd().start();

    let add = ["disk-add", "vol", "--image", s(&img), "--nbd-export"];
    let added = daemon.ctl_ok(&add);
    assert_eq!(added["format"], "luks", "{added}");
    write_served_data(&data, &daemon);
    daemon.ctl_ok(&["disk-remove", "vol"]);

    // tang down: the disk-add fails with the I/O code, naming the token and the server.
    let url = tang.url.clone();
    tang.stop();
    let out = daemon.ctl(&add);
    out.expect_code(code::IO);
    out.error_line(&["clevis token 0", &url, "unreachable"]);

    // Back up: the same disk-add works and the data written through the token is there.
    tang.restart();
    daemon.ctl_ok(&add);
    assert_served_data(&data, &daemon);
}
