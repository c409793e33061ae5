//! Live migration between two `cryptblk serve` daemons, driven through `cryptblk ctl`, with
//! the disk written and read by a real NBD client (qemu-io) on the source during precopy and
//! on the destination during postcopy; the received image must decrypt to exactly what was
//! written.
mod common;

use common::*;
use std::path::PathBuf;
use std::time::Duration;

/// Writes `pattern` at `off` through qemu-io on `daemon`'s export "vol", reads it back, and
/// records it in `expected`.
fn write(daemon: &Daemon, expected: &mut [u8], pattern: u8, off: u64, len: u64) {
    daemon.qemu_io(
        "vol",
        &[
            &format!("write -P {pattern:#x} {off} {len}"),
            &format!("read -P {pattern:#x} {off} {len}"),
        ],
    );
    expected[off as usize..(off + len) as usize].fill(pattern);
}

/// Two daemons: the source serving "vol", a 32 MiB LUKS2 disk whose contents (written
/// through its NBD export from random data when `fill`) the test knows, and a destination with
/// no disk yet.
struct TwoDaemons {
    t: TestDir,
    img: Image,
    dst_img: PathBuf,
    size: u64,
    src: Daemon,
    dst: Daemon,
    expected: Vec<u8>,
}

fn two_daemons(seed: u64, fill: bool) -> TwoDaemons {
    let t = TestDir::new();
    let img = t.luks2("src.luks", "32M", &t.key("key"));
    let dst_img = t.path("dst.luks");
    let size = 32 * MIB;
    let (src, dst) = source_and_destination(&t, &img);
    let mut expected = Vec::new();
    if fill {
        let initial = t.path("initial.raw");
        random_file(&initial, size, seed);
        expected = read(&initial);
        let uri = src.nbd_uri("vol");
        tool(
            "qemu-img",
            ["convert", "-n", "-f", "raw", "-O", "raw", s(&initial), &uri],
        )
        .ok();
    }
    TwoDaemons {
        t,
        img,
        dst_img,
        size,
        src,
        dst,
        expected,
    }
}

fn two_daemon_migration(postcopy: bool, tls: bool) {
    let TwoDaemons {
        t,
        img,
        dst_img,
        src,
        dst,
        mut expected,
        ..
    } = two_daemons(21, true);
    let key = img.key();
    let creds = t.path("creds");
    let mut tls_args: Vec<&str> = Vec::new();
    if tls {
        std::fs::create_dir(&creds).unwrap();
        cryptblk_testutil::x509::make_credentials(&creds, "cryptblk migration test CA");
        tls_args = vec!["--tls-creds", s(&creds)];
    }

    let listen = migrate_incoming(&dst, &dst_img, key, &tls_args);

    let mut start = vec![
        "migrate-start",
        "vol",
        "--to",
        &listen,
        "--max-bandwidth",
        "12M",
    ];
    if postcopy {
        start.extend(["--postcopy", "--preempt"]);
    }
    start.extend_from_slice(&tls_args);
    let st = src.ctl_ok(&start);
    assert_eq!(st["phase"], "precopy", "{st:#}");

    // Guest writes on the source while precopy copies (and recopies) the disk.
    for (i, off) in [0u64, 5 * MIB, 17 * MIB + 4096, 31 * MIB]
        .into_iter()
        .enumerate()
    {
        write(&src, &mut expected, 0x30 + i as u8, off, 256 * 1024);
        std::thread::sleep(Duration::from_millis(100));
    }
    let st = src.ctl_ok(&["migrate-status", "vol"]);
    assert_eq!(st["outgoing"]["phase"], "precopy", "{st:#}");

    if postcopy {
        // As a destination VM would: connected before the switchover.
        dst.wait_nbd_export("vol");
        src.ctl_ok(&["migrate-postcopy", "vol"]);
        let st = dst.wait_migrate("vol", "postcopy");
        assert!(
            st["incoming"]["missing-blocks"].as_u64().unwrap() > 0,
            "postcopy should begin with blocks missing: {st:#}"
        );
        // The destination serves the disk once it has unlocked the received header (a key
        // derivation, slower than the switch on a loaded machine).
        dst.wait_ctl(&["disk-list"], "the received disk", BOUND, |list| {
            list["disks"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|d| d["name"] == "vol" && d["state"] != "adding")
        });
        // The destination serves at once: reads of what the source wrote (fetched on demand),
        // and new writes, partial sectors included.
        dst.qemu_io(
            "vol",
            &[
                &format!("read -P 0x33 {} 262144", 31 * MIB),
                &format!("read -P 0x31 {} 262144", 5 * MIB),
            ],
        );
        write(&dst, &mut expected, 0x55, 20 * MIB, 64 * 1024);
        write(&dst, &mut expected, 0x66, 30 * MIB + 512, 1024);
        let st = dst.wait_migrate("vol", "completed");
        let on_demand = &st["incoming"]["on-demand"];
        assert!(on_demand["requests"].as_u64().unwrap() > 0, "{st:#}");
        assert!(
            on_demand["latency-us"]["p99"].as_u64().unwrap() > 0,
            "{st:#}"
        );
        src.wait_migrate("vol", "completed");
    } else {
        src.ctl_ok(&["migrate-switchover", "vol"]);
        src.wait_migrate("vol", "completed");
        dst.wait_migrate("vol", "completed");
    }
    // The source is fenced: a client there gets errors, not stale data.
    let out = src.qemu_io_out("vol", &["read 0 4096"]);
    assert!(
        out.code != 0 || out.stdout.contains("error") || out.stderr.contains("error"),
        "the source still serves after the handover: {}{}",
        out.stdout,
        out.stderr
    );
    let st = src.ctl_ok(&["migrate-status", "vol"]);
    assert!(st["outgoing"]["downtime-ms"].as_f64().is_some(), "{st:#}");

    // The destination keeps serving after completion; then, detached, its image decrypts to
    // exactly what was written on both sides.
    write(&dst, &mut expected, 0x77, 0, 4096);
    dst.ctl_ok(&["disk-remove", "vol"]);
    let got = cryptblk_decrypt(&dst_img, key, &t.path("dst.raw"));
    assert_same_bytes(&got, &expected, "destination image");
}

#[test]
fn precopy_between_two_daemons() {
    two_daemon_migration(false, false);
}

#[test]
fn postcopy_preempt_between_two_daemons_over_tls() {
    two_daemon_migration(true, true);
}

/// Refusals that protect data: the destination never overwrites an existing file, a
/// keyslot change is refused while the header is already on its way, and a cancelled
/// migration leaves the source serving and the destination without a disk or image.
#[test]
fn migration_refusals_and_cancel() {
    let TwoDaemons {
        t,
        img,
        dst_img,
        src,
        dst,
        ..
    } = two_daemons(0, false);
    let key = img.key();
    let new_key = t.key("new");

    // An existing file is never the target of a migration.
    let existing = t.path("existing.img");
    std::fs::write(&existing, b"precious").unwrap();
    let out = dst.ctl(&argv!(
        "migrate-incoming vol --image {} --listen tcp:127.0.0.1:0 --nbd-export",
        existing
    ));
    assert_ne!(out.code, 0);
    out.error_line(&["already exists"]);
    assert_eq!(std::fs::read(&existing).unwrap(), b"precious");

    let listen = migrate_incoming(&dst, &dst_img, key, &[]);
    src.ctl_ok(&argv!(
        "migrate-start vol --to {} --max-bandwidth 2M",
        &listen
    ));
    let out = src.ctl(&argv!(
        "key-add vol --key-file {} --new-key-file {}",
        key,
        new_key
    ));
    assert_ne!(out.code, 0);
    out.error_line(&["migrated"]);
    // So is a resize: the destination's image is being made at the old size.
    let size = src.ctl_ok(&["disk-list"])["disks"][0]["size"]
        .as_u64()
        .unwrap();
    let grown = format!("{}K", (size >> 10) + 1024);
    src.ctl(&["disk-resize", "vol", &grown])
        .expect_code(6)
        .error_line(&["migrated", "size"]);

    src.ctl_ok(&["migrate-cancel", "vol"]);
    src.wait_migrate("vol", "cancelled");
    // The source serves on, writable.
    src.qemu_io("vol", &["write -P 0x42 0 4096", "read -P 0x42 0 4096"]);
    // The destination dropped the disk and its partial image.
    dst.wait_ctl(
        &["disk-list"],
        "the disk dropped",
        Duration::from_secs(30),
        |list| !dst_img.exists() && list["disks"].as_array().unwrap().is_empty(),
    );
    // And after the migration, keyslot changes and resizes work again.
    src.ctl_ok(&argv!(
        "key-add vol --key-file {} --new-key-file {}",
        key,
        new_key
    ));
    src.ctl_ok(&["disk-resize", "vol", &grown]);
}

/// A TCP forwarder the test can cut, standing for the network between the daemons.
struct Proxy {
    addr: String,
    conns: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Proxy {
    fn start(target: String) -> Proxy {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let conns: std::sync::Arc<std::sync::Mutex<Vec<TcpStream>>> = Default::default();
        let held = conns.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let server = TcpStream::connect(&target).unwrap();
                held.lock().unwrap().push(client.try_clone().unwrap());
                held.lock().unwrap().push(server.try_clone().unwrap());
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 64 << 10];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 || to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Proxy { addr, conns }
    }

    fn cut(&self) {
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// `migrate-postcopy` asked for at once, long before the destination has the disk's 16 MiB
/// LUKS2 header (at 4 MiB/s): accepted, it waits (the answer says the switchover is pending)
/// and happens once the destination serves the disk, so a VM's NBD client there connects
/// right after the switchover (no waiting for the export first) and reads what the source
/// wrote; its vhost-user-blk socket is there too. The keyslot has cryptblk's default key
/// derivation (about 2 s), so the destination opens the disk well after the header is in: a
/// switchover that did not wait would leave the destination live without its export.
#[test]
fn postcopy_asked_before_the_destination_has_the_header_waits_for_it() {
    let t = TestDir::new();
    let key = t.key("key");
    let img = Image {
        path: t.path("src.luks"),
        key: Some(key.clone()),
    };
    cryptblk(argv!("format -q --key-file {} {} 32M", key, img)).ok();
    let dst_img = t.path("dst.luks");
    let (src, dst) = source_and_destination(&t, &img);
    let initial = t.path("initial.raw");
    random_file(&initial, 32 * MIB, 41);
    let mut expected = read(&initial);
    let uri = src.nbd_uri("vol");
    tool(
        "qemu-img",
        ["convert", "-n", "-f", "raw", "-O", "raw", s(&initial), &uri],
    )
    .ok();
    let sock = t.path("dst-vol.sock");
    let listen = migrate_incoming(&dst, &dst_img, img.key(), &["--vhost-user-blk", s(&sock)]);
    src.ctl_ok(&argv!(
        "migrate-start vol --to {} --postcopy --preempt --max-bandwidth 4M",
        &listen
    ));
    write(&src, &mut expected, 0x41, 7 * MIB, 64 * 1024);
    let asked = src.ctl_ok(&["migrate-postcopy", "vol"]);

    dst.wait_migrate("vol", "postcopy");
    // As a destination VM would, at once: its NBD client and its vhost-user-blk socket.
    dst.qemu_io(
        "vol",
        &[
            &format!("read -P 0x41 {} 65536", 7 * MIB),
            &format!("write -P 0x42 {} 65536", 12 * MIB),
        ],
    );
    expected[(12 * MIB) as usize..(12 * MIB + 65536) as usize].fill(0x42);
    std::os::unix::net::UnixStream::connect(&sock).unwrap_or_else(|e| {
        panic!("the destination's vhost-user-blk socket after the switchover: {e}")
    });
    assert_eq!(asked["phase"], "precopy", "{asked:#}");
    assert_eq!(
        asked["switchover-pending"], true,
        "asked for before the header arrived, the switchover must wait: {asked:#}"
    );

    src.wait_migrate("vol", "completed");
    dst.wait_migrate("vol", "completed");
    let st = src.ctl_ok(&["migrate-status", "vol"]);
    assert_eq!(st["outgoing"]["switchover-pending"], false, "{st:#}");
    dst.ctl_ok(&["disk-remove", "vol"]);
    let got = cryptblk_decrypt(&dst_img, img.key(), &t.path("dst.raw"));
    assert_same_bytes(&got, &expected, "destination image");
}

/// The network between two daemons breaks during postcopy: both pause, a read of a block the
/// destination lacks waits (it is not served wrongly), and `migrate-recover` over a new
/// connection finishes the migration with every write intact.
#[test]
fn postcopy_cut_between_daemons_pauses_and_recovers() {
    let TwoDaemons {
        t,
        img,
        dst_img,
        size,
        src,
        dst,
        mut expected,
    } = two_daemons(31, true);
    let listen = migrate_incoming(&dst, &dst_img, img.key(), &[]);
    let proxy = Proxy::start(listen.trim_start_matches("tcp:").to_string());
    let via_proxy = format!("tcp:{}", proxy.addr);
    src.ctl_ok(&argv!(
        "migrate-start vol --to {} --postcopy --preempt --max-bandwidth 4M",
        &via_proxy
    ));
    write(&src, &mut expected, 0x21, 3 * MIB, 64 * 1024);
    // As a destination VM would: connected before the switchover.
    dst.wait_nbd_export("vol");
    src.ctl_ok(&["migrate-postcopy", "vol"]);
    dst.wait_migrate("vol", "postcopy");
    write(&dst, &mut expected, 0x22, 9 * MIB, 64 * 1024);

    proxy.cut();
    src.wait_migrate("vol", "postcopy-paused");
    dst.wait_migrate("vol", "postcopy-paused");
    // The end of the disk is sent last: reading it now has to wait for the recovery.
    let reader = {
        let target = ["-f".to_string(), "raw".to_string(), dst.nbd_uri("vol")];
        std::thread::spawn(move || {
            let out = qemu_io_out(&target, &[&format!("read -v {} 4096", size - 4096)]);
            out.ok();
            out.stdout
        })
    };
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        !reader.is_finished(),
        "a read of a missing block returned while paused"
    );
    src.ctl_ok(&["migrate-recover", "vol", "--to", &listen]);
    let dump = reader.join().unwrap();
    // `read -v` prints the bytes; their first 16 must be what the source had there.
    let tail = &expected[(size - 4096) as usize..(size - 4096 + 16) as usize];
    let hex: Vec<String> = tail.iter().map(|b| format!("{b:02x}")).collect();
    assert!(
        dump.contains(&hex.join(" ")),
        "the waiting read got other data:\n{dump}"
    );
    src.wait_migrate("vol", "completed");
    dst.wait_migrate("vol", "completed");
    dst.ctl_ok(&["disk-remove", "vol"]);
    let got = cryptblk_decrypt(&dst_img, img.key(), &t.path("dst.raw"));
    assert_same_bytes(&got, &expected, "destination image after recovery");
}

/// A raw disk migrates too: the destination opens what it received through the volume's door,
/// which finds no LUKS magic and serves it plain; then its file holds exactly what was written
/// on both sides.
#[test]
fn raw_disk_between_two_daemons() {
    let t = TestDir::new();
    let size = 8 * MIB;
    let img = t.raw("src.raw", size);
    let dst_img = t.path("dst.raw");
    let (src, dst) = source_and_destination(&t, &img);
    let mut expected = vec![0u8; size as usize];
    write(&src, &mut expected, 0x21, 0, 64 * 1024);
    write(&src, &mut expected, 0x22, 7 * MIB, 4096);
    let listen = dst.ctl_ok(&[
        "migrate-incoming",
        "vol",
        "--image",
        s(&dst_img),
        "--listen",
        "tcp:127.0.0.1:0",
        "--nbd-export",
    ])["listen"]
        .as_str()
        .unwrap()
        .to_string();
    src.ctl_ok(&["migrate-start", "vol", "--to", &listen]);
    write(&src, &mut expected, 0x23, 3 * MIB + 512, 1024);
    src.ctl_ok(&["migrate-switchover", "vol"]);
    src.wait_migrate("vol", "completed");
    dst.wait_migrate("vol", "completed");
    write(&dst, &mut expected, 0x24, 5 * MIB, 4096);
    let list = dst.ctl_ok(&["disk-list"]);
    assert_eq!(list["disks"][0]["format"], "raw", "{list:#}");
    dst.ctl_ok(&["disk-remove", "vol"]);
    assert_same_bytes(&read(&dst_img), &expected, "destination image");

    // A key for it says the user meant an encrypted disk: the destination refuses to serve
    // the raw image it received, and the source keeps serving.
    let key = t.key("key");
    let again = t.path("again.raw");
    let (src, dst) = source_and_destination(&t, &t.raw("src2.raw", size));
    let listen = migrate_incoming(&dst, &again, &key, &[]);
    src.ctl_ok(&["migrate-start", "vol", "--to", &listen]);
    dst.wait_migrate("vol", "cancelled");
    assert!(
        dst.log()
            .contains("a key file is given, but the incoming image is raw"),
        "{}",
        dst.log()
    );
    src.wait_migrate("vol", "failed");
    let mut expected = vec![0u8; size as usize];
    write(&src, &mut expected, 0x25, 0, 4096);
}
