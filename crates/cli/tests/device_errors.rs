//! A real device error inside a running `cryptblk serve`: the daemon runs with a file size
//! limit (RLIMIT_FSIZE) below the image's end, so the kernel fails its writes past that
//! point with EFBIG through io_uring, as a full or failing disk would. Each such write comes
//! back as the protocol's error (NBD error reply, virtio IOERR), the log names the disk, the
//! offset and the errno, and the daemon keeps serving the rest of the disk.
mod common;
use cryptblk_testutil::vhost_user as frontend;

use common::*;
use cryptblk_testutil::nbd::NbdClient;
use frontend::{pattern, Guest, S_IOERR, S_OK};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Writes at or past this file offset fail in the daemon.
const LIMIT: u64 = 20 * MIB;

/// `cryptblk serve ARGS` with writes past `LIMIT` refused by the kernel; stderr to `log`.
fn serve_limited(args: &[&str], log: &Path) -> Child {
    let mut cmd = Command::new(bin());
    cmd.arg("serve")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .env_remove("RUST_LOG");
    limit_file_size(&mut cmd, LIMIT);
    cmd.spawn().unwrap()
}

fn wait_for(child: &mut Child, socket: &Path, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "serve exited early: {status}\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "no socket at {}",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A raw image of 24 MiB or a LUKS2 image with 8 MiB of payload behind its 16 MiB header:
/// either way the file's last 4 MiB lie past `LIMIT`. Returns (image, key file, byte offset
/// of the disk where writes start to fail).
fn image(dir: &Path, luks: bool) -> (std::path::PathBuf, Option<std::path::PathBuf>, u64) {
    if luks {
        let key = key_file(dir, "key", &passphrase("device-errors"));
        let img = dir.join("disk.luks");
        format_luks2(&img, &key, "8M");
        (img, Some(key), LIMIT - 16 * MIB)
    } else {
        let img = dir.join("disk.raw");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(24 * MIB)
            .unwrap();
        (img, None, LIMIT)
    }
}

fn check_log(log: &Path, name: &str) {
    let text = std::fs::read_to_string(log).unwrap();
    assert!(
        text.contains("File too large") && text.contains(name),
        "the log does not name the disk and the error:\n{text}"
    );
}

#[test]
fn nbd_write_past_the_limit_fails_and_the_export_keeps_serving() {
    for luks in [false, true] {
        let dir = tempdir();
        let (img, key, bad) = image(dir.path(), luks);
        let sock = dir.path().join("nbd.sock");
        let log = dir.path().join("serve.log");
        let nbd = format!("unix:{}", s(&sock));
        let mut args = vec!["--image", s(&img), "--name", "edisk", "--nbd", &nbd];
        if let Some(key) = &key {
            args.extend(["--key-file", s(key)]);
        }
        let mut child = serve_limited(&args, &log);
        wait_for(&mut child, &sock, &log);
        let mut client = NbdClient::connect(&sock, "edisk").unwrap();
        let data = pattern(64 * 1024, 1);
        client.write(0, &data, false).unwrap();
        let err = client.write(bad + 64 * 1024, &data, true).unwrap_err();
        assert!(!err.is_disconnect(), "the connection broke: {err}");
        // The rest of the disk is served, reads past the limit too.
        client.write(MIB, &data, true).unwrap();
        assert_eq!(client.read(MIB, data.len() as u32).unwrap(), data);
        client.read(bad + 64 * 1024, 4096).unwrap();
        client.flush().unwrap();
        client.disconnect().unwrap();
        assert!(child.try_wait().unwrap().is_none(), "the daemon died");
        assert_eq!(cryptblk_testutil::terminate(child), 0);
        check_log(&log, "edisk");
    }
}

#[test]
fn vhost_user_write_past_the_limit_is_ioerr_and_the_disk_keeps_serving() {
    for luks in [false, true] {
        let dir = tempdir();
        let (img, key, bad) = image(dir.path(), luks);
        let sock = dir.path().join("vhost.sock");
        let log = dir.path().join("serve.log");
        let mut args = vec![
            "--vhost-user-blk",
            s(&sock),
            "--image",
            s(&img),
            "--name",
            "vdisk",
        ];
        if let Some(key) = &key {
            args.extend(["--key-file", s(key)]);
        }
        let mut child = serve_limited(&args, &log);
        wait_for(&mut child, &sock, &log);
        let mut guest = Guest::connect(&sock, 1, 256);
        let data = pattern(16 * 1024, 2);
        assert_eq!(guest.write(0, 0, &data), S_OK);
        assert_eq!(guest.write(0, (bad + 8192) / 512, &data), S_IOERR);
        assert_eq!(guest.write(0, MIB / 512, &data), S_OK);
        assert_eq!(guest.read(0, MIB / 512, data.len()), (S_OK, data.clone()));
        assert_eq!(guest.simple(0, frontend::VIRTIO_BLK_T_FLUSH, 0), S_OK);
        drop(guest);
        assert!(child.try_wait().unwrap().is_none(), "the daemon died");
        assert_eq!(cryptblk_testutil::terminate(child), 0);
        check_log(&log, "vdisk");
    }
}
