//! What local users can reach of a running daemon: its memory (not dumpable, so no core file
//! and no ptrace or /proc/PID/mem for its own user), and its vhost-user-blk sockets (only
//! the peers a disk allows).
mod common;

use common::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// (owner of /proc/PID/status, the process's real uid). The kernel makes a process's /proc
/// entries root's while it is not dumpable.
fn proc_owner_and_uid(pid: u32) -> (u32, u32) {
    let status = Path::new("/proc").join(pid.to_string()).join("status");
    let owner = std::fs::metadata(&status).unwrap().uid();
    let text = std::fs::read_to_string(&status).unwrap();
    let uid = text
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    (owner, uid)
}

/// `serve --control` (and `extra`) as an unprivileged user: nobody when the test runs as root
/// (root's /proc entries are root's whether dumpable or not), else the test's own user. What
/// /proc says of it while it runs.
fn serve_and_look(t: &TestDir, extra: &[&str]) -> (u32, u32) {
    let mut serve = t.serve_as(&format!("look{}", extra.len())).control();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        serve = serve.under(&[
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ]);
    }
    let mut daemon = serve.args(extra).start();
    let seen = proc_owner_and_uid(daemon.pid());
    assert_eq!(daemon.terminate(), 0);
    seen
}

#[test]
fn serve_is_not_dumpable_unless_asked() {
    let t = TestDir::new();
    std::fs::set_permissions(t.root(), PermissionsExt::from_mode(0o777)).unwrap();
    let (owner, uid) = serve_and_look(&t, &[]);
    assert_ne!(uid, 0, "the daemon under test must not run as root");
    assert_eq!(
        owner, 0,
        "serve (uid {uid}) is dumpable: its /proc entries belong to it"
    );
    let (owner, uid) = serve_and_look(&t, &["--allow-core-dumps"]);
    assert_eq!(owner, uid, "--allow-core-dumps left serve not dumpable");
}

/// `--socket-peer-uid` names a user that must exist: an unknown one is a usage error before
/// anything is bound.
#[test]
fn an_unknown_socket_peer_is_a_usage_error() {
    let t = TestDir::new();
    let image = t.raw("raw.img", 1 << 20);
    let socket = t.path("vm.sock");
    let peer = ["--socket-peer-uid", "no-such-user-cryptblk"];
    let out = t
        .serve()
        .disk(&image)
        .vhost_user_at(&socket)
        .args(&peer)
        .run();
    let stderr = &out.stderr;
    assert_eq!(out.code, 1, "{stderr}");
    assert!(
        stderr.contains("socket-peer-uid: no user \"no-such-user-cryptblk\""),
        "{stderr}"
    );
    assert!(!socket.exists());
}
