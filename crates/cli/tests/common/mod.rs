//! What the `cryptblk` integration tests share: the fixture layer (crates/fixture: images,
//! the daemon handle, the test guest, running the binary and the real tools, see its
//! README.md), and the few helpers only these tests use.
#![allow(dead_code)]

pub use cryptblk_fixture::*;

pub mod backup;
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
    dst.ctl_ok(&argv!(incoming, dst_img, key; extra))["listen"].as_str().unwrap().to_string()
}

/// A live migration's two daemons: "src" serving `img` as disk "vol" (control socket and
/// NBD), and "dst" with a control socket and NBD and no disk yet.
pub fn source_and_destination(t: &TestDir, img: &Image) -> (Daemon, Daemon) {
    let src = t.serve_as("src").control().nbd().disk(img).name("vol").start();
    let dst = t.serve_as("dst").control().nbd().start();
    (src, dst)
}
