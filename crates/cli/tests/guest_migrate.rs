//! Guest live migration with the disk migrated between two vhost-user-blk daemons: a real
//! Linux guest (the kernel and initramfs of `scripts/guest/build-initramfs.sh`, see
//! guest_e2e.rs) boots under QEMU (TCG) on a LUKS2 disk exported by a `cryptblk serve` with 2
//! queues, and runs a verified fio job on /dev/vda (rate-limited random 64 KiB writes with
//! crc32c verification, `--verify_backlog` reads during the write phase and a final verify
//! pass). While fio is writing, the disk is migrated to a second daemon that started with
//! only a control socket (`ctl migrate-incoming` on it, `ctl migrate-start` on the source),
//! and QEMU live-migrates the VM (QMP `migrate` over TCP) to a second QEMU on the
//! destination daemon's vhost-user-blk socket. QEMU stopping the source VM for the migration
//! (GET_VRING_BASE with dirty logging on) makes the source daemon switch the disk over; the
//! guest carries on on the destination and fio finishes there.
//!
//! The guest's init (/migrate-init, appended to the initramfs as a second cpio archive) also
//! prints "TICK <n>" every second, and after fio "FIO_EXIT=<status>" and the sha256 of the
//! region fio covered. The test checks that fio started on the source and finished on the
//! destination with status 0 and no verify error, that the destination's ticks follow the
//! source's, that both daemons report the migration completed, and that the received image,
//! detached from the destination daemon, decrypts to what the guest last read.
//!
//! Two variants: precopy (the source copies and recopies dirty blocks; the switchover at the
//! VM stop sends the rest), and postcopy with a preempt channel under a bandwidth cap (the
//! switchover happens with blocks still missing; the destination fetches what the guest reads
//! on demand).

mod common;

use common::*;
use serde_json::json;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The guest's kernel command line: its init is /migrate-init.
const APPEND: &str = "console=ttyS0 quiet panic=-1 rdinit=/migrate-init";
/// Size of the LUKS2 image.
const DISK: u64 = 32 * MIB;
/// Bytes of /dev/vda the fio job writes and verifies.
const FIO_SIZE: u64 = 24 * MIB;
/// fio's write rate limit (bytes per second): the write phase lasts `FIO_SIZE / FIO_RATE`
/// seconds of guest time, long enough for both migrations to happen in the middle of it.
const FIO_RATE: u64 = MIB;

/// The guest tests run one at a time: two QEMUs under TCG already fill a 2-core machine.
static GUEST: Mutex<()> = Mutex::new(());

/// The guest's /init for this test: the modules and devices of scripts/guest/init.sh, a
/// ticker in the background, then the fio job.
fn init_script() -> String {
    format!(
        r#"#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /tmp /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
echo
while read -r mod; do
	[ -n "$mod" ] || continue
	insmod "/lib/modules/$mod.ko" || echo "GUEST-FAIL insmod $mod"
done </lib/modules/load-order
tries=0
while [ ! -b /dev/vda ]; do
	tries=$((tries + 1))
	[ "$tries" -le 200 ] || {{ echo "GUEST-FAIL no /dev/vda"; poweroff -f; }}
	sleep 0.05
done
echo "guest: /dev/vda is $(cat /sys/block/vda/size) sectors, $(ls /sys/block/vda/mq | wc -l) queue(s)"
export LD_LIBRARY_PATH="$(cat /etc/fio-library-path)"
(i=0; while :; do i=$((i + 1)); echo "TICK $i"; sleep 1; done) &
echo "FIO_START"
fio --name=migrate --filename=/dev/vda --rw=randwrite --bs=64k --size={size} \
	--rate=,{rate} --direct=1 --ioengine=psync --verify=crc32c --do_verify=1 \
	--verify_backlog=16 --verify_fatal=1 --verify_state_save=0 --eta=never
echo "FIO_EXIT=$?"
echo "GUEST-SHA256: $(head -c {size} /dev/vda | sha256sum | cut -d' ' -f1)"
echo "GUEST-DONE"
while :; do sleep 1; done
"#,
        size = FIO_SIZE,
        rate = FIO_RATE,
    )
}

/// One file in the newc ("070701") cpio format the kernel unpacks an initramfs from.
fn cpio_entry(out: &mut Vec<u8>, name: &str, mode: u32, data: &[u8]) {
    let pad4 = |out: &mut Vec<u8>| out.resize(out.len().next_multiple_of(4), 0);
    let fields = [
        1,                 // ino
        mode,              // mode
        0,                 // uid
        0,                 // gid
        1,                 // nlink
        0,                 // mtime
        data.len() as u32, // filesize
        0,                 // devmajor
        0,                 // devminor
        0,                 // rdevmajor
        0,                 // rdevminor
        name.len() as u32 + 1,
        0, // check
    ];
    out.extend_from_slice(b"070701");
    for f in fields {
        out.extend_from_slice(format!("{f:08X}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad4(out);
    out.extend_from_slice(data);
    pad4(out);
}

/// The stock initramfs followed by a second archive adding /migrate-init (the kernel unpacks
/// concatenated archives in order); the kernel runs it with `rdinit=/migrate-init`.
fn migrate_initramfs(artifacts: &Path, out: &Path) {
    let mut data = std::fs::read(artifacts.join("initramfs.cpio.gz")).unwrap();
    // The kernel aligns cpio headers to 4 bytes from the start of the whole image and skips
    // zero bytes between archives.
    data.resize(data.len().next_multiple_of(4), 0);
    let mut extra = Vec::new();
    cpio_entry(
        &mut extra,
        "migrate-init",
        0o100_755,
        init_script().as_bytes(),
    );
    cpio_entry(&mut extra, "TRAILER!!!", 0, &[]);
    data.extend_from_slice(&extra);
    std::fs::write(out, data).unwrap();
}

/// `cryptblk serve` with a control socket, logging the vhost-user frontend's events and the
/// daemon's.
fn serve(t: &TestDir, tag: &str) -> Serve {
    let log = "warn,cryptblk_vhost_user_blk=info,cryptblk_daemon=info";
    t.serve_as(tag).control().log_level(log)
}

/// The "TICK <n>" numbers of a console (a tick may follow other output on its line).
fn ticks(console: &str) -> Vec<u64> {
    console
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.rsplit_once("TICK ")?;
            rest.trim().parse().ok()
        })
        .collect()
}

/// The value of the console line `PREFIX<value>`.
fn console_value<'a>(console: &'a str, prefix: &str) -> Option<&'a str> {
    console
        .lines()
        .find_map(|l| l.trim().strip_prefix(prefix).map(str::trim))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn guest_fio_across_disk_migration(postcopy: bool) {
    let _serial = GUEST.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let artifacts = artifacts();
    let t = TestDir::new();
    let path = |name: &str| t.path(name);
    let initrd = path("initramfs-migrate.cpio.gz");
    migrate_initramfs(&artifacts, &initrd);

    // The source image: LUKS2 over random content (so unwritten regions are not zero).
    let (raw, key, src_img, dst_img) = (
        path("content.raw"),
        t.key("key"),
        path("src.luks"),
        path("dst.luks"),
    );
    random_file(&raw, DISK, 0x5eed);
    cryptblk_cheap(argv!("convert --key-file {} {} {}", key, raw, src_img)).ok();

    let (src_sock, dst_sock) = (path("src.sock"), path("dst.sock"));
    let src_daemon = serve(&t, "src").vhost_user_at(&src_sock).image(&src_img);
    let src_daemon = src_daemon
        .key(&key)
        .name("vol")
        .args(&["--num-queues", "2"]);
    let mut src_daemon = src_daemon.start();
    assert!(src_sock.exists(), "no {}", src_sock.display());
    let kernel = artifacts.join("vmlinuz");
    let vm = |socket: &Path| QemuConfig::new(&kernel, &initrd, APPEND, socket).queues(2);
    let mut src = vm(&src_sock).start(t.root(), "src");

    // The guest boots on the source and fio is writing (a few seconds into its write phase).
    src.wait_console("fio started", Duration::from_secs(300), |c| {
        c.contains("FIO_START") && ticks(c).len() >= 4
    });
    assert!(
        src.console().contains("2 queue(s)"),
        "the guest did not get 2 queues\n{}",
        src.describe()
    );
    eprintln!("fio running on the source after {:?}", started.elapsed());

    // The destination daemon has no disk; it receives "vol" into a new image.
    let mut dst_daemon = serve(&t, "dst").start();
    let incoming = dst_daemon.ctl_ok(&argv!("migrate-incoming vol --image {} --key-file {} --listen tcp:127.0.0.1:0 --vhost-user-blk {} --num-queues 2", dst_img, key, dst_sock));
    let listen = incoming["listen"].as_str().unwrap().to_string();
    let mut start = vec!["migrate-start", "vol", "--to", &listen];
    if postcopy {
        // Capped so that the bulk copy is still under way when the VM stops and when fio
        // verifies: the switchover leaves blocks missing, fetched on demand when the guest
        // reads them.
        start.extend(["--postcopy", "--preempt", "--max-bandwidth", "1536K"]);
    }
    let st = src_daemon.ctl_ok(&start);
    assert_eq!(st["phase"], "precopy", "{st:#}");
    // The destination binds its vhost-user-blk socket once the image header has arrived.
    dst_daemon.wait_for_path(&dst_sock);

    let port = free_port();
    let uri = format!("tcp:127.0.0.1:{port}");
    let mut dst = vm(&dst_sock).incoming(&uri).start(t.root(), "dst");
    let mut src_qmp = src.qmp();
    let mut dst_qmp = dst.qmp();
    src_qmp.execute(
        "migrate-set-parameters",
        json!({ "max-bandwidth": 4u64 << 30, "downtime-limit": 2000 }),
    );
    let migrate_at = Instant::now();
    src_qmp.execute("migrate", json!({ "uri": uri }));
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let info = src_qmp.execute("query-migrate", json!({}));
        match info["status"].as_str() {
            Some("completed") => break,
            Some("failed") | Some("cancelled") => {
                panic!("migration {info}\n{}", src.describe())
            }
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "migration not done: {info}\n{}",
            src.describe()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("VM migrated in {:?}", migrate_at.elapsed());
    let status = src_qmp.execute("query-status", json!({}));
    assert_eq!(status["status"], "postmigrate", "{status}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = dst_qmp.execute("query-status", json!({}));
        if status["status"] == "running" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "destination not running: {status}\n{}",
            dst.describe()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    if postcopy {
        // Switched over at the stop with most of the image still to come. (The destination
        // learns of it when the source's sender next looks, after the chunk in flight.)
        let deadline = Instant::now() + Duration::from_secs(30);
        let st = loop {
            let st = dst_daemon.ctl_ok(&["migrate-status", "vol"]);
            if st["phase"] != "precopy" || Instant::now() > deadline {
                break st;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        eprintln!(
            "destination in postcopy {:?} after QMP migrate",
            migrate_at.elapsed()
        );
        assert_eq!(st["phase"], "postcopy", "{st:#}");
        assert!(
            st["incoming"]["missing-blocks"].as_u64().unwrap() > 0,
            "{st:#}"
        );
    }
    let src_log = src_daemon.log();
    assert!(
        src_log.contains("Stopped { dirty_logging: true }")
            && src_log.contains("VM stopped, switching over"),
        "the source daemon did not switch over at the stop for migration:\n{src_log}"
    );
    let src_console = src.console();
    assert!(
        !src_console.contains("FIO_EXIT"),
        "fio finished before the migration; writing must span it\n{}",
        src.describe()
    );
    let last_src_tick = ticks(&src_console).last().copied().unwrap_or(0);

    // The source QEMU is done; its daemon stays until the disk migration completes (in
    // postcopy the destination still fetches missing blocks from it).
    drop(src_qmp);
    drop(src);

    // fio finishes on the destination: the rest of the writes, the backlog verifies and the
    // final verify pass all go through the destination daemon.
    dst.wait_console("fio done", Duration::from_secs(180), |c| {
        c.contains("GUEST-DONE")
    });
    eprintln!("guest done after {:?}", started.elapsed());

    // The stop for migration switched the disk over; both daemons see the migration through
    // (postcopy: once the destination has fetched or received every block).
    let src_status = src_daemon.wait_migrate("vol", "completed");
    let dst_status = dst_daemon.wait_migrate("vol", "completed");
    eprintln!("source: {src_status:#}\ndestination: {dst_status:#}");
    let out = &src_status["outgoing"];
    assert_eq!(out["postcopy"], postcopy, "{src_status:#}");
    assert!(out["downtime-ms"].as_f64().is_some(), "{src_status:#}");
    if postcopy {
        assert_eq!(
            dst_status["incoming"]["missing-blocks"], 0,
            "{dst_status:#}"
        );
        // The guest read blocks the capped bulk copy had not brought yet (fio's verify reads
        // of blocks written on the source; the final verify pass starts well before the bulk
        // copy of the 48 MiB image at 1.5 MiB/s ends).
        assert!(
            dst_status["incoming"]["on-demand"]["requests"]
                .as_u64()
                .unwrap()
                > 0,
            "postcopy fetched nothing on demand: {dst_status:#}"
        );
        assert!(
            out["urgent-requests-served"].as_u64().unwrap() > 0,
            "{src_status:#}"
        );
    }
    // From here on only the destination QEMU and daemon exist.
    src_daemon.kill9();

    let console = dst.console();
    assert_eq!(
        console_value(&console, "FIO_EXIT="),
        Some("0"),
        "fio failed on the destination\n{}",
        dst.describe()
    );
    assert!(
        console.contains("err= 0") && !console.contains("verify:") && !console.contains("bad "),
        "fio reported errors\n{}",
        dst.describe()
    );
    let after = ticks(&console);
    assert!(after.len() >= 3, "no ticks on the destination\n{console}");
    assert!(
        after[0] > last_src_tick && after.windows(2).all(|w| w[1] > w[0]),
        "destination ticks {after:?} do not follow the last source tick {last_src_tick}"
    );
    let guest_sum = console_value(&console, "GUEST-SHA256:")
        .unwrap_or_else(|| panic!("no GUEST-SHA256\n{console}"))
        .to_string();
    let status = dst_qmp.execute("query-status", json!({}));
    assert_eq!(status["status"], "running", "{status}");
    drop(dst_qmp);
    drop(dst);

    // The received image, detached, decrypts to what the guest read back at the end.
    dst_daemon.ctl_ok(&["disk-remove", "vol", "--force"]);
    let got = cryptblk_decrypt(&dst_img, &key, &path("dst.raw"));
    assert!(got.len() as u64 >= FIO_SIZE, "{} bytes", got.len());
    assert_eq!(
        host_digest(&got[..FIO_SIZE as usize]),
        guest_sum,
        "the destination image differs from what the guest read"
    );
    let output = dst_daemon.log();
    assert!(
        output.contains("Started") && !output.contains("dirty_logging: true"),
        "destination daemon events:\n{output}"
    );
    let code = dst_daemon.terminate();
    assert_eq!(code, 0, "destination cryptblk serve:\n{output}");
    eprintln!("total {:?}", started.elapsed());
}

#[test]
fn guest_fio_across_precopy_disk_and_vm_migration() {
    guest_fio_across_disk_migration(false);
}

#[test]
fn guest_fio_across_postcopy_preempt_disk_and_vm_migration() {
    guest_fio_across_disk_migration(true);
}
