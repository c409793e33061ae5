//! Guest end-to-end under libvirt: a real libvirt daemon from Debian's packages (started by
//! this test with pid files, no systemd, and stopped by PID; one such test per machine, as
//! libvirtd uses fixed paths under /run/libvirt) defines and starts TCG domains whose disk is
//! a cryptblk LUKS2 vhost-user-blk socket handed to `libvirt-qemu` with `--socket-owner`.
//! First boot: rounds of crc32c-verified fio while a second disk, added at run time with
//! `ctl disk-add`, is attached with `virsh attach-device` (QEMU connects to its socket) and
//! detached with `virsh detach-device` (the guest ejects it, QEMU leaves, and the daemon
//! removes the disk without `--force`). Second boot: a verified fio write/read, and the image
//! must decrypt on the host to what the guest read.

mod common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const URI: &str = "qemu:///system";

fn virsh(args: &[&str]) -> std::process::Output {
    let out = Command::new("timeout")
        .args(["60", "virsh", "-c", URI])
        .args(args)
        .output()
        .expect("run virsh");
    assert!(
        out.status.success(),
        "virsh {args:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn answers() -> bool {
    Command::new("virsh")
        .args(["-c", URI, "version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// virtlogd and libvirtd started by this test (stopped by PID on drop), or a libvirtd that
/// already answered (left alone).
struct Libvirt {
    pid_files: Vec<PathBuf>,
}

impl Libvirt {
    fn start(dir: &Path) -> Libvirt {
        if answers() {
            return Libvirt { pid_files: vec![] };
        }
        let mut pid_files = vec![];
        for daemon in ["virtlogd", "libvirtd"] {
            let pid_file = dir.join(format!("{daemon}.pid"));
            let status = Command::new(daemon)
                .args(["-d", "-p"])
                .arg(&pid_file)
                .status()
                .unwrap_or_else(|e| panic!("run {daemon}: {e}"));
            assert!(status.success(), "{daemon}: {status}");
            pid_files.push(pid_file);
        }
        let libvirt = Libvirt { pid_files };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !answers() {
            assert!(
                Instant::now() < deadline,
                "libvirtd did not answer within 60 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        libvirt
    }
}

impl Drop for Libvirt {
    fn drop(&mut self) {
        for pid_file in self.pid_files.iter().rev() {
            if let Some(pid) = std::fs::read_to_string(pid_file)
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok())
            {
                // SAFETY: kill(2) with a PID the daemon wrote for itself.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
    }
}

fn wait_for(
    what: &str,
    limit: Duration,
    mut ok: impl FnMut() -> bool,
    context: impl Fn() -> String,
) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(
            Instant::now() < deadline,
            "{what} not within {limit:?}\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn disk_xml(socket: &Path, target: &str) -> String {
    format!(
        "<disk type='vhostuser' device='disk'>\
           <driver name='qemu' type='raw' queues='2'/>\
           <source type='unix' path='{}'><reconnect enabled='yes' timeout='1'/></source>\
           <target dev='{target}' bus='virtio'/>\
         </disk>",
        socket.display()
    )
}

fn user_id(name: &str) -> u32 {
    let out = Command::new("id").args(["-u", name]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("no user {name}"))
}

/// A running domain booted from the test guest with `job`, destroyed and undefined on drop.
struct Boot {
    name: String,
}

impl Boot {
    fn start(
        dir: &Path,
        artifacts: &Path,
        job: &str,
        size: u64,
        socket: &Path,
        serial: &str,
    ) -> Boot {
        let name = format!("cryptblk-test-{}-{job}", std::process::id());
        let xml = format!(
            "<domain type='qemu'>\
               <name>{name}</name>\
               <memory unit='MiB'>512</memory><vcpu>2</vcpu>\
               <memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking>\
               <features><acpi/></features>\
               <os><type arch='x86_64' machine='pc'>hvm</type>\
                 <kernel>{kernel}</kernel><initrd>{initrd}</initrd>\
                 <cmdline>console=ttyS0 quiet panic=-1 cryptblk.job={job} cryptblk.size={size} cryptblk.bs=65536</cmdline>\
               </os>\
               <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>\
               <devices>{disk}{serial}</devices>\
             </domain>",
            kernel = artifacts.join("vmlinuz").display(),
            initrd = artifacts.join("initramfs.cpio.gz").display(),
            disk = disk_xml(socket, "vda"),
        );
        let file = dir.join(format!("{job}.xml"));
        std::fs::write(&file, xml).unwrap();
        virsh(&["define", s(&file)]);
        let boot = Boot { name };
        virsh(&["start", &boot.name]);
        boot
    }
}

impl Drop for Boot {
    fn drop(&mut self) {
        for cmd in ["destroy", "undefine"] {
            let _ = Command::new("timeout")
                .args(["30", "virsh", "-c", URI, cmd, &self.name])
                .output();
        }
    }
}

/// The guest's serial console on a UNIX socket QEMU listens on: read by a thread into a
/// string, written by the test.
struct Console {
    stream: std::os::unix::net::UnixStream,
    text: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Console {
    fn connect(path: &Path) -> Console {
        let deadline = Instant::now() + Duration::from_secs(30);
        let stream = loop {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(Instant::now() < deadline, "console {}: {e}", path.display());
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        };
        let text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let mut reader = stream.try_clone().unwrap();
        let sink = text.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = std::io::Read::read(&mut reader, &mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]).replace('\r', ""));
            }
        });
        Console { stream, text }
    }

    fn text(&self) -> String {
        self.text.lock().unwrap().clone()
    }

    fn send(&self, bytes: &[u8]) {
        std::io::Write::write_all(&mut &self.stream, bytes).unwrap();
    }
}

#[test]
fn libvirt_domain_on_a_cryptblk_disk() {
    if Command::new("libvirtd").arg("--version").output().is_err() {
        cryptblk_testutil::skip(
            "libvirtd is not installed (scripts/install-deps.sh installs libvirt-daemon-system)",
        );
        return;
    }
    let artifacts = artifacts();
    let t = TestDir::new();
    // QEMU runs as libvirt-qemu: it must reach the sockets and the console file in here.
    std::fs::set_permissions(t.root(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = |name: &str| t.path(name);
    let size = 16 * MIB;
    let key = t.key("key");
    let img = t.luks2("vm.luks", "64M", &key);
    let img2 = t.raw("data.raw", size);
    let (socket, socket2) = (path("vm.sock"), path("data.sock"));
    let access = ["--socket-owner", "libvirt-qemu", "--socket-mode", "0600"];
    let serve = t.serve().disk(&img).vhost_user_at(&socket);
    let serve = serve.args(&["--num-queues", "2"]).args(&access).control();
    let mut serve = serve.start();

    let _libvirt = Libvirt::start(t.root());
    // QEMU (as libvirt-qemu) binds the console socket of the second boot in here.
    let console_dir = path("console");
    std::fs::create_dir(&console_dir).unwrap();
    std::os::unix::fs::chown(&console_dir, Some(user_id("libvirt-qemu")), None).unwrap();

    // Boot 1: rounds of verified fio until "stop"; meanwhile a second disk added at run time
    // is attached to the running domain and detached again.
    let console_socket = console_dir.join("console.sock");
    let boot = Boot::start(
        t.root(),
        &artifacts,
        "restart-verify",
        size,
        &socket,
        &format!(
            "<serial type='unix'><source mode='bind' path='{}'/><target port='0'/></serial>",
            console_socket.display()
        ),
    );
    let console = Console::connect(&console_socket);
    wait_for(
        "the guest's first fio round",
        Duration::from_secs(120),
        || console.text().contains("FIO-JSON-BEGIN 1"),
        || console.text(),
    );
    let add = "disk-add data --image {} --vhost-user-blk {} --num-queues 2";
    serve.ctl_ok(&argv!(add, img2, socket2; access));
    std::fs::write(path("data.xml"), disk_xml(&socket2, "vdb")).unwrap();
    virsh(&["attach-device", &boot.name, s(&path("data.xml")), "--live"]);
    let connected = format!("vhost-user frontend connected on {}", socket2.display());
    wait_for(
        "QEMU connecting to the attached disk",
        Duration::from_secs(60),
        || serve.log().contains(&connected),
        || serve.log(),
    );
    let blk = String::from_utf8(virsh(&["domblklist", &boot.name]).stdout).unwrap();
    assert!(blk.contains("vdb") && blk.contains(s(&socket2)), "{blk}");
    virsh(&["detach-device", &boot.name, s(&path("data.xml")), "--live"]);
    // Once QEMU let go of it, the disk leaves without --force (refused while a VM is on it).
    wait_for(
        "the detached disk to be removable",
        Duration::from_secs(60),
        || serve.ctl(&["disk-remove", "data"]).code == 0,
        || serve.log(),
    );
    console.send(b"stop\n");
    wait_for(
        "the guest's verdict",
        Duration::from_secs(240),
        || console.text().contains("GUEST-RESULT:"),
        || console.text(),
    );
    assert!(
        console.text().contains("GUEST-RESULT: PASS"),
        "{}",
        console.text()
    );
    drop(boot);

    // Boot 2: a verified write of the first `size` bytes; the image must decrypt on the host
    // to what the guest read back.
    let console_file = path("console.log");
    let boot = Boot::start(
        t.root(),
        &artifacts,
        "write-verify",
        size,
        &socket,
        &format!(
            "<serial type='file'><source path='{}'/><target port='0'/></serial>",
            console_file.display()
        ),
    );
    let read_console = || std::fs::read_to_string(&console_file).unwrap_or_default();
    wait_for(
        "the guest's fio verify",
        Duration::from_secs(240),
        || read_console().contains("GUEST-RESULT:"),
        || format!("console:\n{}\ndaemon:\n{}", read_console(), serve.log()),
    );
    let text = read_console();
    assert!(text.contains("GUEST-RESULT: PASS"), "{text}");
    let digest = text
        .lines()
        .find_map(|l| l.strip_prefix("GUEST-SHA256: "))
        .expect("the guest's digest")
        .trim()
        .to_owned();
    drop(boot);

    assert_eq!(serve.terminate(), 0, "cryptblk serve:\n{}", serve.log());
    let data = img.decrypt(&path("out.raw"));
    assert_eq!(host_digest(&data[..size as usize]), digest);
}
