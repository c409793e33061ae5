//! What the `cryptblk` integration tests share: the fixture layer (crates/fixture: images,
//! the daemon handle, the test guest, running the binary and the real tools, see its
//! README.md), and the few helpers only these tests use.
#![allow(dead_code)]

pub use cryptblk_fixture::*;
use std::path::PathBuf;

pub mod backup;
pub mod cli_errors;
pub mod crash;
pub mod online;
pub mod reencrypt;
pub mod secret;
pub mod xts;

/// `ctl migrate-incoming vol` on `dst` into `dst_img` (its NBD export on, `extra` added);
/// returns the address the destination listens on.
pub fn migrate_incoming(
    dst: &Daemon,
    dst_img: &std::path::Path,
    key: &std::path::Path,
    extra: &[&str],
) -> String {
    let incoming =
        "migrate-incoming vol --image {} --key-file {} --listen tcp:127.0.0.1:0 --nbd-export";
    dst.ctl_ok(&argv!(incoming, dst_img, key; extra))["listen"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A live migration's two daemons: "src" serving `img` as disk "vol" (control socket and
/// NBD), and "dst" with a control socket and NBD and no disk yet.
pub fn source_and_destination(t: &TestDir, img: &Image) -> (Daemon, Daemon) {
    let src = t
        .serve_as("src")
        .control()
        .nbd()
        .disk(img)
        .name("vol")
        .start();
    let dst = t.serve_as("dst").control().nbd().start();
    (src, dst)
}

/// A config file `disks.toml` serving `count` LUKS2 disks `d0`, `d1`, ... (images `dI.luks` of
/// `size`, vhost-user sockets `dI.sock`, `extra` added to each) at cryptblk's default key
/// derivation (argon2id, about 2 s each): one `cryptblk format` copied, each copy given a UUID
/// of its own by `cryptsetup luksUUID` (a header change without a key derivation; the key
/// cache names keys by UUID).
pub fn default_kdf_disks(t: &TestDir, key: &Key, count: usize, size: &str, extra: &str) -> PathBuf {
    let first = t.path("d0.luks");
    cryptblk(argv!("format -q --key-file {} {} {}", key, first, size)).ok();
    let mut config = String::new();
    for i in 0..count {
        let (image, socket) = (t.path(&format!("d{i}.luks")), t.path(&format!("d{i}.sock")));
        if i > 0 {
            tool("cp", argv!("--sparse=always {} {}", first, image)).ok();
        }
        let uuid = tool("uuidgen", ["-r"]).stdout.trim().to_string();
        cryptsetup(argv!("luksUUID -q --uuid {} {}", uuid, image)).ok();
        let (image, key, socket) = (s(&image), s(key), s(&socket));
        config.push_str(&format!(
            "[[disk]]\nname = \"d{i}\"\nimage = \"{image}\"\nkey-file = \"{key}\"\n\
             vhost-user-blk = \"{socket}\"\n{extra}\n"
        ));
    }
    let file = t.path("disks.toml");
    std::fs::write(&file, config).unwrap();
    file
}
