//! Running under systemd: `cryptblk serve` speaks the `Type=notify` protocol to the datagram
//! socket `$NOTIFY_SOCKET` names (READY=1 only once the LUKS disk is unlocked and every socket
//! is bound, STOPPING=1 when SIGTERM arrives, STATUS= lines), and the unit file in
//! contrib/systemd passes `systemd-analyze verify`.
mod common;

use common::*;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn receive(socket: &UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    let n = socket
        .recv(&mut buf)
        .expect("a notification within the timeout");
    String::from_utf8(buf[..n].to_vec()).unwrap()
}

#[test]
fn serve_notifies_ready_after_unlock_and_bind_then_stopping() {
    let t = TestDir::new();
    let key = t.key_with("key", "notify-test-passphrase");
    let image = t.luks2("disk.luks", "16M", &key);
    let notify = UnixDatagram::bind(t.path("notify")).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let serve = t.serve().disk(&image).vhost_user_at(&t.path("vm1.sock"));
    let serve = serve.env("NOTIFY_SOCKET", s(&t.path("notify")));
    let mut daemon = serve.clone().control().spawn();

    let first = receive(&notify);
    assert_eq!(first, "STATUS=opening and unlocking 1 disk(s)");
    let ready = receive(&notify);
    assert_eq!(ready, "READY=1\nSTATUS=serving 1 disk(s): disk.luks");
    // Ready means usable: the disk's socket and the control socket accept connections now.
    UnixStream::connect(daemon.vhost_socket())
        .expect("vhost-user-blk socket accepts after READY=1");
    UnixStream::connect(daemon.control()).expect("control socket accepts after READY=1");

    assert_eq!(daemon.terminate(), 0, "{}", daemon.log());
    let stopping = receive(&notify);
    assert!(
        stopping.starts_with("STOPPING=1\nSTATUS=stopping"),
        "{stopping}"
    );
    // Nothing after STOPPING=1.
    notify.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    assert!(notify.recv(&mut buf).is_err());

    // A wrong key never reports READY=1: the start fails first.
    std::fs::write(&key, b"not the passphrase").unwrap();
    assert_eq!(serve.run().code, 2);
    notify.set_nonblocking(false).unwrap();
    assert_eq!(receive(&notify), "STATUS=opening and unlocking 1 disk(s)");
    notify.set_nonblocking(true).unwrap();
    assert!(notify.recv(&mut buf).is_err(), "a failed start sent more");
}

#[test]
fn unit_file_passes_systemd_analyze_verify() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        cryptblk_testutil::skip("systemd-analyze is not installed (apt install systemd)");
        return;
    }
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../contrib/systemd/cryptblk.service");
    let text = std::fs::read_to_string(&unit).unwrap();
    // Core files would hold guest memory and keys.
    assert!(
        text.contains("\nLimitCORE=0\n"),
        "no LimitCORE=0 in the unit"
    );
    // verify checks that ExecStart's program exists: point it at the binary under test.
    let text = text.replace("/usr/bin/cryptblk", env!("CARGO_BIN_EXE_cryptblk"));
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("cryptblk.service");
    std::fs::write(&copy, text).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
