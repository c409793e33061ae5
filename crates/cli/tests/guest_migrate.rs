//! Guest live migration over vhost-user-blk: a real Linux guest (the kernel and initramfs of
//! `scripts/guest/build-initramfs.sh`, see guest_e2e.rs) boots under QEMU (TCG) on a LUKS2
//! disk exported by `cryptblk serve --vhost-user-blk` with 2 queues, and QEMU live-migrates it
//! (QMP `migrate` over TCP) to a second QEMU whose disk is a second `cryptblk serve` exporting
//! its own copy of the same image. QEMU refuses to migrate a VM whose vhost-user device lacks
//! VHOST_F_LOG_ALL, so the migration completing shows the backend offers dirty logging.
//!
//! The guest never writes the disk: its init (/migrate-init, appended to the initramfs as a
//! second cpio archive) loops reading the first `READ_LEN` bytes of /dev/vda with O_DIRECT and prints
//! "TICK <n> <sha256>" on the serial console every second. The test checks that the source
//! guest reads the image's content, that after the migration (with the source QEMU and its
//! daemon killed) the destination console carries on with later ticks, and that those reads,
//! served by the destination daemon, still give the image's content.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::MIB;
use serde_json::{json, Value};

/// Bytes of the disk the guest reads (and hashes) on every tick.
const READ_LEN: u64 = 4 * MIB;
/// Guest RAM (a shared memfd, as vhost-user needs).
const RAM: &str = "512M";

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/guest")
}

/// Builds (or finds cached) the guest kernel and initramfs, as guest_e2e.rs does.
fn build_guest() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("guest");
    let status = Command::new(scripts().join("build-initramfs.sh"))
        .arg(&dir)
        .status()
        .expect("run scripts/guest/build-initramfs.sh");
    assert!(status.success(), "build-initramfs.sh failed: {status}");
    for file in ["vmlinuz", "initramfs.cpio.gz"] {
        assert!(dir.join(file).is_file(), "no {file} in {}", dir.display());
    }
    dir
}

/// The guest's /init for this test: the modules and devices of scripts/guest/init.sh, then
/// the read loop.
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
i=0
while :; do
	i=$((i + 1))
	sum=$(dd if=/dev/vda bs=65536 count={count} iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)
	echo "TICK $i $sum"
	sleep 1
done
"#,
        count = READ_LEN / 65536
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

/// sha256 of `data` in hex, by the host's sha256sum.
fn host_digest(data: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run sha256sum");
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

/// A `cryptblk serve` exporting `image` on `socket` with 2 queues, logging the vhost-user
/// frontend's events (`RUST_LOG=cryptblk_vhost_user_blk=info`) to `log`; killed when dropped.
struct Serve {
    child: Child,
    log: PathBuf,
}

impl Serve {
    fn start(image: &Path, key: &Path, socket: &Path, log: PathBuf) -> Serve {
        let child = Command::new(common::bin())
            .arg("serve")
            .arg("--vhost-user-blk")
            .arg(socket)
            .arg("--image")
            .arg(image)
            .arg("--key-file")
            .arg(key)
            .args(["--num-queues", "2"])
            .env("RUST_LOG", "warn,cryptblk_vhost_user_blk=info")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start cryptblk serve");
        let mut serve = Serve { child, log };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !socket.exists() {
            if let Some(status) = serve.child.try_wait().unwrap() {
                panic!("cryptblk serve exited {status}: {}", serve.output());
            }
            assert!(Instant::now() < deadline, "no socket: {}", serve.output());
            std::thread::sleep(Duration::from_millis(50));
        }
        serve
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM; the exit status (the daemon flushes and exits 0).
    fn terminate(mut self) -> std::process::ExitStatus {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) on a child this test spawned and has not reaped.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "cryptblk serve ignored SIGTERM: {}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A QEMU process, killed when dropped.
struct Qemu {
    child: Child,
    console: PathBuf,
    log: PathBuf,
    qmp: PathBuf,
}

impl Qemu {
    /// Starts QEMU with the guest on the vhost-user-blk `socket`; `incoming` makes it a
    /// migration destination.
    fn start(
        name: &str,
        dir: &Path,
        artifacts: &Path,
        initrd: &Path,
        socket: &Path,
        incoming: Option<&str>,
    ) -> Qemu {
        let console = dir.join(format!("{name}.console"));
        let log = dir.join(format!("{name}.qemu.log"));
        let qmp = dir.join(format!("{name}.qmp"));
        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args([
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            "max",
            "-m",
            RAM,
            "-smp",
            "2",
        ])
        .args([
            "-display",
            "none",
            "-nodefaults",
            "-no-user-config",
            "-no-reboot",
        ])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp.display()))
        .arg("-kernel")
        .arg(artifacts.join("vmlinuz"))
        .arg("-initrd")
        .arg(initrd)
        .args([
            "-append",
            "console=ttyS0 quiet panic=-1 rdinit=/migrate-init",
        ])
        .arg("-object")
        .arg(format!("memory-backend-memfd,id=mem,size={RAM},share=on"))
        .args(["-numa", "node,memdev=mem"])
        .arg("-chardev")
        .arg(format!("socket,id=c0,path={}", socket.display()))
        .args(["-device", "vhost-user-blk-pci,chardev=c0,num-queues=2"]);
        if let Some(uri) = incoming {
            cmd.args(["-incoming", uri]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start qemu-system-x86_64 (apt-get install qemu-system-x86)");
        Qemu {
            child,
            console,
            log,
            qmp,
        }
    }

    fn console(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.console).unwrap_or_default()).replace('\r', "")
    }

    fn describe(&self) -> String {
        format!(
            "--- qemu log ---\n{}\n--- console ---\n{}",
            std::fs::read_to_string(&self.log).unwrap_or_default(),
            self.console()
        )
    }

    fn qmp(&mut self) -> Qmp {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(stream) = UnixStream::connect(&self.qmp) {
                return Qmp::new(stream);
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("QEMU exited {status}\n{}", self.describe());
            }
            assert!(
                Instant::now() < deadline,
                "no QMP socket\n{}",
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A QMP connection (one command at a time; events are skipped).
struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    fn new(stream: UnixStream) -> Qmp {
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut qmp = Qmp {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
        };
        let greeting = qmp.read();
        assert!(
            greeting.get("QMP").is_some(),
            "not a QMP greeting: {greeting}"
        );
        qmp.execute("qmp_capabilities", json!({}));
        qmp
    }

    fn read(&mut self) -> Value {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).expect("read from QMP");
        assert!(n > 0, "QMP connection closed");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad QMP line {line:?}: {e}"))
    }

    /// Runs a command; returns its "return" value, panics on an "error".
    fn execute(&mut self, command: &str, arguments: Value) -> Value {
        let msg = json!({ "execute": command, "arguments": arguments });
        writeln!(self.writer, "{msg}").unwrap();
        loop {
            let v = self.read();
            if v.get("event").is_some() {
                continue;
            }
            if let Some(r) = v.get("return") {
                return r.clone();
            }
            panic!("QMP {command}: {v}");
        }
    }
}

/// The complete "TICK <n> <sha256>" lines of a console.
fn ticks(console: &str) -> Vec<(u64, String)> {
    console
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            match (w.next(), w.next(), w.next(), w.next()) {
                (Some("TICK"), Some(n), Some(sum), None) if sum.len() == 64 => {
                    Some((n.parse().ok()?, sum.to_string()))
                }
                _ => None,
            }
        })
        .collect()
}

/// Waits until the console of `qemu` holds at least `count` ticks.
fn wait_ticks(qemu: &mut Qemu, count: usize, timeout: Duration) -> Vec<(u64, String)> {
    let deadline = Instant::now() + timeout;
    loop {
        let console = qemu.console();
        assert!(
            !console.contains("GUEST-FAIL"),
            "the guest failed\n{}",
            qemu.describe()
        );
        let t = ticks(&console);
        if t.len() >= count {
            return t;
        }
        if let Some(status) = qemu.child.try_wait().unwrap() {
            panic!("QEMU exited {status}\n{}", qemu.describe());
        }
        assert!(
            Instant::now() < deadline,
            "fewer than {count} ticks after {timeout:?}\n{}",
            qemu.describe()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn guest_live_migrates_between_two_vhost_user_blk_daemons() {
    let artifacts = build_guest();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let initrd = path("initramfs-migrate.cpio.gz");
    migrate_initramfs(&artifacts, &initrd);

    // The same LUKS2 image for both sides: random content converted to LUKS2, then copied.
    let (raw, key, src_img, dst_img) = (
        path("content.raw"),
        path("key"),
        path("src.luks"),
        path("dst.luks"),
    );
    common::random_file(&raw, 16 * MIB, 0x5eed);
    std::fs::write(&key, b"guest migration passphrase").unwrap();
    let mut convert = vec!["convert"];
    convert.extend_from_slice(common::CHEAP_PBKDF2);
    convert.extend([
        "--key-file",
        common::s(&key),
        common::s(&raw),
        common::s(&src_img),
    ]);
    common::cryptblk(&convert).ok();
    std::fs::copy(&src_img, &dst_img).unwrap();
    let content = std::fs::read(&raw).unwrap();
    let digest = host_digest(&content[..READ_LEN as usize]);

    let (src_sock, dst_sock) = (path("src.sock"), path("dst.sock"));
    let src_daemon = Serve::start(&src_img, &key, &src_sock, path("src.serve.log"));
    let dst_daemon = Serve::start(&dst_img, &key, &dst_sock, path("dst.serve.log"));

    let port = free_port();
    let uri = format!("tcp:127.0.0.1:{port}");
    let mut src = Qemu::start("src", dir.path(), &artifacts, &initrd, &src_sock, None);
    let mut dst = Qemu::start(
        "dst",
        dir.path(),
        &artifacts,
        &initrd,
        &dst_sock,
        Some(&uri),
    );

    // The source guest runs and reads the image's content through the source daemon.
    let before = wait_ticks(&mut src, 3, Duration::from_secs(300));
    assert!(
        src.console().contains("2 queue(s)"),
        "the guest did not get 2 queues\n{}",
        src.describe()
    );
    for (n, sum) in &before {
        assert_eq!(sum, &digest, "source tick {n} read wrong data");
    }

    let mut src_qmp = src.qmp();
    let mut dst_qmp = dst.qmp();
    src_qmp.execute(
        "migrate-set-parameters",
        json!({ "max-bandwidth": 4u64 << 30, "downtime-limit": 2000 }),
    );
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
    let last_src_tick = ticks(&src.console()).last().map_or(0, |t| t.0);
    // The source daemon's event hook saw the VM stopped with dirty logging on (QEMU set
    // VHOST_F_LOG_ALL for the migration, then stopped the queues).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !src_daemon
        .output()
        .contains("Stopped { dirty_logging: true }")
    {
        assert!(
            Instant::now() < deadline,
            "the source daemon did not report the stop for migration:\n{}",
            src_daemon.output()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    eprintln!("--- source daemon ---\n{}", src_daemon.output());
    // From here on only the destination QEMU and daemon exist.
    drop(src_qmp);
    drop(src);
    drop(src_daemon);

    let after = wait_ticks(&mut dst, 3, Duration::from_secs(120));
    for (i, (n, sum)) in after.iter().enumerate() {
        assert!(
            *n > last_src_tick,
            "destination tick {n} is not after the last source tick {last_src_tick}"
        );
        if i > 0 {
            assert_eq!(*n, after[i - 1].0 + 1, "ticks not consecutive: {after:?}");
        }
        assert_eq!(
            sum,
            &digest,
            "destination tick {n} read wrong data\n{}",
            dst.describe()
        );
    }
    let status = dst_qmp.execute("query-status", json!({}));
    assert_eq!(status["status"], "running", "{status}");
    drop(dst_qmp);
    drop(dst);
    let output = dst_daemon.output();
    eprintln!("--- destination daemon ---\n{output}");
    assert!(
        output.contains("Started") && !output.contains("dirty_logging: true"),
        "destination daemon events:\n{output}"
    );
    let status = dst_daemon.terminate();
    assert!(
        status.success(),
        "destination cryptblk serve: {status}\n{output}"
    );
}
