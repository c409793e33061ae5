//! What local users can reach of a running daemon: its memory (not dumpable, so no core file
//! and no ptrace or /proc/PID/mem for its own user), and its vhost-user-blk sockets (only
//! the peers a disk allows).
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};

use cryptblk_testutil::wait_for_path as wait_for;

/// `cryptblk ARGS` as an unprivileged user: nobody when the test runs as root (root's
/// /proc entries are root's whether dumpable or not), else the test's own user.
fn unprivileged_cryptblk() -> Command {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(env!("CARGO_BIN_EXE_cryptblk"));
        cmd
    } else {
        Command::new(env!("CARGO_BIN_EXE_cryptblk"))
    }
}

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

fn serve_and_look(dir: &Path, extra: &[&str]) -> (u32, u32) {
    let control = dir.join(format!("control{}.sock", extra.len()));
    let mut serve = unprivileged_cryptblk()
        .arg("serve")
        .arg("--control")
        .arg(&control)
        .args(extra)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(&control, &mut serve);
    let seen = proc_owner_and_uid(serve.id());
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
    assert!(serve.wait().unwrap().success());
    seen
}

#[test]
fn serve_is_not_dumpable_unless_asked() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), PermissionsExt::from_mode(0o777)).unwrap();
    let (owner, uid) = serve_and_look(dir.path(), &[]);
    assert_ne!(uid, 0, "the daemon under test must not run as root");
    assert_eq!(
        owner, 0,
        "serve (uid {uid}) is dumpable: its /proc entries belong to it"
    );
    let (owner, uid) = serve_and_look(dir.path(), &["--allow-core-dumps"]);
    assert_eq!(owner, uid, "--allow-core-dumps left serve not dumpable");
}

/// `--socket-peer-uid` names a user that must exist: an unknown one is a usage error before
/// anything is bound.
#[test]
fn an_unknown_socket_peer_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("raw.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let socket = dir.path().join("vm.sock");
    let out = Command::new(env!("CARGO_BIN_EXE_cryptblk"))
        .arg("serve")
        .arg("--image")
        .arg(&image)
        .arg("--vhost-user-blk")
        .arg(&socket)
        .args(["--socket-peer-uid", "no-such-user-cryptblk"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("socket-peer-uid: no user \"no-such-user-cryptblk\""),
        "{stderr}"
    );
    assert!(!socket.exists());
}
