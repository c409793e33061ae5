//! Network-bound unlock against the real tools: a LUKS2 image bound by Debian's `clevis luks
//! bind` to a real `tangd` (on loopback, started and stopped by this test) is served with no
//! key; the tang server down or its keys replaced give an error naming the token and the
//! server, and the passphrase keyslot still opens the disk, before or after the token.
mod common;
#[path = "../../clevis/tests/support/tang_server.rs"]
mod tang_server;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tang_server::{require, TangServer};

fn uri(name: &str, socket: &Path) -> String {
    format!("nbd+unix:///{name}?socket={}", socket.display())
}

/// A LUKS2 image cryptsetup formats with `key` in keyslot 0.
/// The export `vol` on `socket` holds exactly `data` (qemu-img compare over NBD).
fn assert_served_data(data: &Path, socket: &Path) {
    tool(
        "qemu-img",
        [
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            s(data),
            &uri("vol", socket),
        ],
    )
    .ok();
}

/// qemu-img writes `data` over the export "vol" on `socket`.
fn write_served_data(data: &Path, socket: &Path) {
    tool(
        "qemu-img",
        [
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            s(data),
            &uri("vol", socket),
        ],
    )
    .ok();
}

fn cryptsetup_luks2(dir: &Path, key: &Path) -> PathBuf {
    let img = dir.join("disk.luks");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    let mut args = vec!["luksFormat", "--type", "luks2", "--batch-mode"];
    args.extend_from_slice(CS_CHEAP_PBKDF2);
    args.extend(["--key-file", s(key), s(&img)]);
    tool("cryptsetup", &args).ok();
    img
}

/// `clevis luks bind` of `img` to the tang at `url`, unlocking with `key`; returns the
/// passphrase clevis put in its keyslot (registered as a secret no output may show).
fn clevis_bind(dir: &Path, img: &Path, key: &Path, url: &str) -> String {
    require("clevis", "clevis");
    require("clevis-luks-bind", "clevis-luks");
    let cfg = format!("{{\"url\":\"{url}\"}}");
    tool(
        "clevis",
        [
            "luks",
            "bind",
            "-y",
            "-d",
            s(img),
            "-k",
            s(key),
            "tang",
            &cfg,
        ],
    )
    .ok();
    let pass = tool("clevis", ["luks", "pass", "-d", s(img), "-s", "1"]);
    pass.ok();
    let secret = pass.stdout.trim_end().to_owned();
    key_file(dir, "clevis-pass", &secret);
    secret
}

/// The `Tokens:` section of a luksDump-style text, up to `Digests:`.
fn tokens_section(dump: &str) -> String {
    let start = dump.find("Tokens:").expect("a Tokens: section");
    let end = dump[start..].find("Digests:").expect("a Digests: section") + start;
    dump[start..end].to_owned()
}

/// `cryptblk serve` of `img` over NBD with `extra` options, its log in `log`, ready once the
/// socket exists.
fn serve(img: &Path, sock: &Path, log: &Path, extra: &[&str]) -> ServeChild {
    let mut cmd = Command::new(bin());
    cmd.args(["serve", "--image", s(img), "--name", "vol"])
        .arg("--nbd")
        .arg(format!("unix:{}", s(sock)))
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .env_remove("RUST_LOG");
    let mut child = ServeChild(cmd.spawn().unwrap());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !sock.exists() {
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!(
                "serve exited early ({status}):\n{}",
                std::fs::read_to_string(log).unwrap()
            );
        }
        assert!(std::time::Instant::now() < deadline, "serve not ready");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child
}

/// A serve process, killed (by its PID) when dropped.
struct ServeChild(std::process::Child);

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_disk_bound_by_clevis_to_tang_is_served_with_no_key() {
    let mut tang = TangServer::start();
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("clevis-slot0"));
    let img = cryptsetup_luks2(dir.path(), &key);
    let data = dir.path().join("data.raw");
    mixed_file(&data, 16 * MIB, 25);
    let sock = dir.path().join("nbd.sock");
    let log = dir.path().join("serve.log");

    // Data written through the passphrase before the binding.
    {
        let _serve = serve(&img, &sock, &log, &["--key-file", s(&key)]);
        write_served_data(&data, &sock);
    }
    let _ = std::fs::remove_file(&sock);
    let clevis_secret = clevis_bind(dir.path(), &img, &key, &tang.url);

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
    {
        let _serve = serve(&img, &sock, &log, &[]);
        assert_served_data(&data, &sock);
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("unlocked through clevis token") && text.contains(&tang.url),
        "{text}"
    );
    assert!(
        !text.contains(&clevis_secret),
        "the recovered passphrase was logged:\n{text}"
    );
    let _ = std::fs::remove_file(&sock);

    // A wrong key file: the token still opens it (key sources are tried in order).
    let wrong = key_file(dir.path(), "wrong", &passphrase("clevis-wrong"));
    {
        let _serve = serve(&img, &sock, &log, &["--key-file", s(&wrong)]);
        tool("nbdinfo", [&uri("vol", &sock)]).ok();
    }
    let _ = std::fs::remove_file(&sock);

    // tang down: no key given fails, naming the token and the server, exit 5 (I/O).
    let url = tang.url.clone();
    tang.stop();
    let out = cryptblk([
        "serve",
        "--image",
        s(&img),
        "--nbd",
        &format!("unix:{}", s(&sock)),
    ]);
    out.expect_code(code::IO);
    out.error_line(&["clevis token 0", &url, "unreachable"]);
    assert!(
        !sock.exists(),
        "no socket is bound when the disk cannot be opened"
    );

    // ... and the passphrase keyslot still opens it, with the data.
    {
        let _serve = serve(&img, &sock, &log, &["--key-file", s(&key)]);
        assert_served_data(&data, &sock);
    }
    let _ = std::fs::remove_file(&sock);

    // Both failing: a wrong key file and tang down name both, exit 2 (the key file came first).
    let out = cryptblk([
        "serve",
        "--image",
        s(&img),
        "--key-file",
        s(&wrong),
        "--nbd",
        &format!("unix:{}", s(&sock)),
    ]);
    out.expect_code(code::WRONG_PASSPHRASE);
    out.error_line(&["no keyslot matches", "clevis token 0", &url]);

    // The server back (same address) with other keys: the token's key is gone, said so.
    tang.restart();
    tang.replace_keys();
    assert_eq!(tang.url, url);
    let out = cryptblk([
        "serve",
        "--image",
        s(&img),
        "--nbd",
        &format!("unix:{}", s(&sock)),
    ]);
    out.expect_code(code::WRONG_PASSPHRASE);
    out.error_line(&["clevis token 0", &url, "has no key"]);
}

#[test]
fn disk_add_with_no_key_file_unlocks_through_the_token() {
    let mut tang = TangServer::start();
    let dir = tempdir();
    let key = key_file(dir.path(), "key", &passphrase("clevis-ctl"));
    let img = cryptsetup_luks2(dir.path(), &key);
    clevis_bind(dir.path(), &img, &key, &tang.url);
    let data = dir.path().join("data.raw");
    mixed_file(&data, 16 * MIB, 26);
    let control = dir.path().join("ctl.sock");
    let nbd = dir.path().join("nbd.sock");
    let _daemon = ServeProcess::start(
        &[
            "--control",
            s(&control),
            "--nbd",
            &format!("unix:{}", s(&nbd)),
        ],
        &control,
    );

    let added = ctl_json(
        &control,
        &["disk-add", "vol", "--image", s(&img), "--nbd-export"],
    );
    assert_eq!(added["format"], "luks", "{added}");
    write_served_data(&data, &nbd);
    ctl(&control, &["disk-remove", "vol"]).ok();

    // tang down: the disk-add fails with the I/O code, naming the token and the server.
    let url = tang.url.clone();
    tang.stop();
    let out = ctl(
        &control,
        &["disk-add", "vol", "--image", s(&img), "--nbd-export"],
    );
    out.expect_code(code::IO);
    out.error_line(&["clevis token 0", &url, "unreachable"]);

    // Back up: the same disk-add works and the data written through the token is there.
    tang.restart();
    ctl(
        &control,
        &["disk-add", "vol", "--image", s(&img), "--nbd-export"],
    )
    .ok();
    assert_served_data(&data, &nbd);
}
