//! Passphrases handed to `cryptblk serve --control` as file descriptors (SCM_RIGHTS) instead
//! of key files: `ctl --key-fd N` with a pipe on descriptor N, `ctl --key-file -` from stdin,
//! and raw requests that name a descriptor they did not pass or pass too many.
mod common;

use common::*;
use serde_json::{json, Value};
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// `serve --control --nbd`, its log at debug level (to catch any leak).
fn daemon(t: &TestDir) -> Daemon {
    t.serve().control().nbd().log_level("debug").start()
}

/// A pipe already holding `bytes`, its write end closed: what `vault read ... |` gives.
fn pipe_holding(bytes: &[u8]) -> OwnedFd {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: pipe2 just created both; nothing else owns them.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    std::fs::File::from(w).write_all(bytes).unwrap();
    r
}

/// `cryptblk ctl --socket CONTROL ARGS` with each `(n, bytes)` of `fds` as a pipe holding
/// `bytes` on descriptor n, as `3< <(vault read ...)` would set it up.
fn ctl_with_fds<S: AsRef<OsStr> + std::fmt::Debug>(
    control: &Path,
    args: &[S],
    fds: &[(RawFd, &[u8])],
) -> Out {
    // Moved above the targets first, so no dup2 overwrites a pipe another one still needs.
    let pipes: Vec<(RawFd, OwnedFd)> = fds
        .iter()
        .map(|(n, b)| {
            let pipe = pipe_holding(b);
            // SAFETY: F_DUPFD_CLOEXEC makes a new descriptor, owned by nobody else.
            let high = unsafe { libc::fcntl(pipe.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 100) };
            assert!(high >= 100);
            // SAFETY: just created above.
            (*n, unsafe { OwnedFd::from_raw_fd(high) })
        })
        .collect();
    let moves: Vec<(RawFd, RawFd)> = pipes.iter().map(|(n, p)| (p.as_raw_fd(), *n)).collect();
    let mut cmd = Command::new(bin());
    cmd.args(["ctl", "--socket", s(control)])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("RUST_LOG");
    // SAFETY: between fork and exec the closure only calls dup2, which is async-signal-safe,
    // on descriptors open in the parent (the pipes live until after spawn); dup2 clears
    // close-on-exec on the copy, so the child keeps exactly the descriptors it was told of.
    unsafe {
        cmd.pre_exec(move || {
            for (from, to) in &moves {
                if libc::dup2(*from, *to) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let output = cmd.output().unwrap();
    drop(pipes);
    Out {
        what: format!("ctl {args:?}"),
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Sends one request line with `fds` attached (SCM_RIGHTS) and returns the response.
fn raw_request(control: &Path, request: Value, fds: &[RawFd]) -> Value {
    let stream = UnixStream::connect(control).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let line = format!("{request}\n");
    let mut iov = libc::iovec {
        iov_base: line.as_ptr().cast_mut().cast(),
        iov_len: line.len(),
    };
    #[repr(C, align(8))]
    struct Control([u8; 128]);
    let mut control_buf = Control([0; 128]);
    let payload = std::mem::size_of_val(fds) as u32;
    // SAFETY: the msghdr points at `iov` and `control_buf`, which outlive the call; the
    // control buffer is aligned for cmsghdr and 128 bytes hold a header and up to 16
    // descriptors; the descriptors are open.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            msg.msg_control = control_buf.0.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(payload) as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast(), fds.len());
        }
        libc::sendmsg(stream.as_raw_fd(), &msg, 0)
    };
    assert_eq!(sent, line.len() as isize);
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply).unwrap();
    serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{e}: {reply:?}"))
}

#[test]
fn a_passphrase_in_a_pipe_opens_a_disk_and_changes_its_keyslots() {
    let t = TestDir::new();
    // Only to format the image (and to let the helpers check no output shows it).
    let key = t.key("setup.key");
    let pass = key.passphrase.clone();
    let img = t.luks2("vol.luks", "8M", &key);
    let daemon = daemon(&t);
    let ctl_sock = daemon.control().to_path_buf();

    // A wrong passphrase by descriptor: the usual wrong-key error, nothing attached.
    let wrong = passphrase("keyfd-wrong");
    let add = argv!("disk-add vol --image {} --nbd-export --key-fd 3", img);
    let out = ctl_with_fds(&ctl_sock, &add, &[(3, wrong.as_bytes())]);
    out.expect_code(code::WRONG_PASSPHRASE);
    assert!(!out.stderr.contains(&wrong), "{}", out.stderr);

    // The right one: attached; data written over NBD reads back.
    let out = ctl_with_fds(&ctl_sock, &add, &[(3, pass.as_bytes())]);
    out.ok();
    daemon.qemu_io("vol", &["write -P 0x3c 64k 128k", "read -P 0x3c 64k 128k"]);

    // key-add with both passphrases by descriptor.
    let new = passphrase("keyfd-new");
    let out = ctl_with_fds(
        &ctl_sock,
        &[
            "key-add",
            "vol",
            "--key-fd",
            "3",
            "--new-key-fd",
            "4",
            "--pbkdf",
            "pbkdf2",
            "--iter-time",
            "1",
        ],
        &[(3, pass.as_bytes()), (4, new.as_bytes())],
    );
    out.ok();
    assert!(!out.stdout.contains(&new) && !out.stderr.contains(&new));
    // cryptsetup waits for the lock the daemon holds on a served image: check it detached.
    daemon.ctl_ok(&["disk-remove", "vol"]);
    let new_key = t.key_with("check.key", &new);
    assert!(
        img.opens_with(&new_key),
        "the new keyslot does not open the image"
    );

    // `--key-file -`: ctl passes its stdin; the new passphrase opens the disk, data intact.
    let out = cryptblk_stdin(
        argv!(
            "ctl --socket {} disk-add vol --image {} --nbd-export --key-file -",
            ctl_sock,
            img
        ),
        new.as_bytes(),
    );
    out.ok();
    daemon.qemu_io("vol", &["read -P 0x3c 64k 128k"]);

    // key-remove by descriptor: the keyslot the new passphrase opens goes, the old stays.
    let out = ctl_with_fds(
        &ctl_sock,
        &["key-remove", "vol", "--key-fd", "3"],
        &[(3, new.as_bytes())],
    );
    out.ok();
    daemon.ctl_ok(&["disk-remove", "vol"]);
    assert!(!img.opens_with(&new_key), "key-remove did not remove it");
    assert!(img.opens_with(&key));

    daemon.assert_never_shows(&pass);
    daemon.assert_never_shows(&new);
    daemon.assert_never_shows(&wrong);
}

#[test]
fn descriptors_not_passed_or_too_many_are_refused_and_closed() {
    let t = TestDir::new();
    let key = t.key("setup.key");
    let pass = key.passphrase.clone();
    let img = t.luks2("vol.luks", "8M", &key);
    let daemon = daemon(&t);
    // Every connection below ends, so the daemon comes back to this many descriptors.
    let before = daemon.open_fds().len();

    // key-fd naming a descriptor that did not come with the request.
    let reply = raw_request(
        daemon.control(),
        json!({"jsonrpc": "2.0", "id": 1, "method": "disk-add",
               "params": {"name": "vol", "image": s(&img), "key-fd": 0}}),
        &[],
    );
    assert_eq!(reply["error"]["code"], -32602, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("key-fd 0: no file descriptor was passed"),
        "{message}"
    );
    // Both a key file and a descriptor: refused, naming both.
    let pipe = pipe_holding(pass.as_bytes());
    let reply = raw_request(
        daemon.control(),
        json!({"jsonrpc": "2.0", "id": 2, "method": "disk-add",
               "params": {"name": "vol", "image": s(&img), "key-fd": 0, "key-file": s(&key)}}),
        &[pipe.as_raw_fd()],
    );
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("key-file and key-fd"),
        "{reply}"
    );

    // Five descriptors where four are allowed: refused, not run, all closed.
    let pipes: Vec<OwnedFd> = (0..5).map(|_| pipe_holding(pass.as_bytes())).collect();
    let raw: Vec<RawFd> = pipes.iter().map(|p| p.as_raw_fd()).collect();
    let reply = raw_request(
        daemon.control(),
        json!({"jsonrpc": "2.0", "id": 3, "method": "disk-add",
               "params": {"name": "vol", "image": s(&img), "key-fd": 0}}),
        &raw,
    );
    assert_eq!(reply["error"]["code"], -32600, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("more than 4 file descriptors"),
        "{reply}"
    );
    let list = daemon.ctl_ok(&["disk-list"]);
    assert_eq!(list["disks"].as_array().map(Vec::len), Some(0), "{list}");
    // Descriptors a request does not name are closed too.
    let reply = raw_request(
        daemon.control(),
        json!({"jsonrpc": "2.0", "id": 4, "method": "disk-list"}),
        &raw[..2],
    );
    assert!(reply.get("result").is_some(), "{reply}");
    for _ in 0..3 {
        raw_request(
            daemon.control(),
            json!({"jsonrpc": "2.0", "id": 5, "method": "disk-list"}),
            &raw,
        );
    }
    let back = wait_until(Duration::from_secs(5), || {
        (daemon.open_fds().len() == before).then_some(before)
    });
    let now = back.unwrap_or_else(|| daemon.open_fds().len());
    assert_eq!(now, before, "the daemon kept passed descriptors");
    daemon.assert_never_shows(&pass);
}
