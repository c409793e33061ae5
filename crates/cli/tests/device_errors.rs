//! A real device error inside a running `cryptblk serve`: the daemon runs with a file size
//! limit (RLIMIT_FSIZE) below the image's end, so the kernel fails its writes past that
//! point with EFBIG through io_uring, as a full or failing disk would. Each such write comes
//! back as the protocol's error (NBD error reply, virtio IOERR), the log names the disk, the
//! offset and the errno, and the daemon keeps serving the rest of the disk.
mod common;

use common::*;
use frontend::{pattern, S_IOERR, S_OK};

/// Writes at or past this file offset fail in the daemon.
const LIMIT: u64 = 20 * MIB;

/// A raw image of 24 MiB or a LUKS2 image with 8 MiB of payload behind its 16 MiB header:
/// either way the file's last 4 MiB lie past `LIMIT`. Returns the image and the byte offset of
/// the disk where writes start to fail.
fn image(t: &TestDir, luks: bool) -> (Image, u64) {
    if luks {
        (t.luks2("disk.luks", "8M", &t.key("key")), LIMIT - 16 * MIB)
    } else {
        (t.raw("disk.raw", 24 * MIB), LIMIT)
    }
}

/// The daemon logged the failed write with the disk's name and the error.
fn check_log(daemon: &Daemon, name: &str) {
    let text = daemon.log();
    assert!(
        text.contains("File too large") && text.contains(name),
        "the log does not name the disk and the error:\n{text}"
    );
}

#[test]
fn nbd_write_past_the_limit_fails_and_the_export_keeps_serving() {
    for luks in [false, true] {
        let t = TestDir::new();
        let (img, bad) = image(&t, luks);
        let serve = t.serve().disk(&img).name("edisk").nbd();
        let mut daemon = serve.file_size_limit(LIMIT).start();
        let mut client = daemon.nbd("edisk");
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
        assert!(daemon.is_running(), "the daemon died");
        assert_eq!(daemon.terminate(), 0);
        check_log(&daemon, "edisk");
    }
}

#[test]
fn vhost_user_write_past_the_limit_is_ioerr_and_the_disk_keeps_serving() {
    for luks in [false, true] {
        let t = TestDir::new();
        let (img, bad) = image(&t, luks);
        let serve = t.serve().vhost_user().disk(&img).name("vdisk");
        let mut daemon = serve.file_size_limit(LIMIT).start();
        let mut guest = daemon.frontend(1, 256);
        let data = pattern(16 * 1024, 2);
        assert_eq!(guest.write(0, 0, &data), S_OK);
        assert_eq!(guest.write(0, (bad + 8192) / 512, &data), S_IOERR);
        assert_eq!(guest.write(0, MIB / 512, &data), S_OK);
        assert_eq!(guest.read(0, MIB / 512, data.len()), (S_OK, data.clone()));
        assert_eq!(guest.simple(0, frontend::VIRTIO_BLK_T_FLUSH, 0), S_OK);
        drop(guest);
        assert!(daemon.is_running(), "the daemon died");
        assert_eq!(daemon.terminate(), 0);
        check_log(&daemon, "vdisk");
    }
}
