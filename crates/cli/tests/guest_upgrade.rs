//! Guest end-to-end: a VM's disk through upgrades and kills of a daemon serving several LUKS2
//! disks at cryptblk's default key derivation. The test guest (see guest_e2e.rs) runs rounds
//! of fio with crc32c verify on one of them (2 queues, QEMU `reconnect=1`) while the test
//! alternates `ctl upgrade` (a new daemon process takes the disks, sockets and keys over) and
//! `kill -9` followed by a new daemon with the key cache on, three times each. Every fio round
//! must pass, no restart may need a key derivation, and nothing may hang.
//!
//! The pause each event costs the guest is printed: from the request (or the kill) to the
//! daemon logging that the VM started its queues again, most of it QEMU's one-second
//! reconnect delay.

mod common;

use common::guest::{build_guest, Guest, BOUND, STARTED};
use common::{bin, cryptblk, key_file, s, tool, MIB};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Disks the daemon serves (the guest uses the first).
const DISKS: usize = 3;
/// Upgrades and kills, alternating.
const EVENTS: usize = 6;

struct Daemon {
    args: Vec<String>,
    log: PathBuf,
    control: PathBuf,
}

impl Daemon {
    fn start(&self) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        Command::new(bin())
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start cryptblk serve")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the VM has started its queues more than `before` times in all.
    fn wait_started(&self, before: usize) -> Instant {
        let deadline = Instant::now() + BOUND;
        loop {
            if self.log().matches(STARTED).count() > before {
                return Instant::now();
            }
            assert!(
                Instant::now() < deadline,
                "the VM did not come back within {BOUND:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Kills every daemon process it was told of when dropped, so that a failing test leaves none
/// behind (an upgraded daemon is not a child of the test, so nothing else would).
#[derive(Default)]
struct Reaper(std::sync::Mutex<Vec<u32>>);

impl Reaper {
    fn track(&self, pid: u32) {
        self.0.lock().unwrap().push(pid);
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        for pid in self.0.lock().unwrap().drain(..) {
            // SAFETY: kill(2) on a process this test started; it may be gone already.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}

fn kill(pid: u32) {
    // SAFETY: kill(2) on the daemon this test started (or its successor).
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| !st.contains(") Z "))
    {
        assert!(Instant::now() < deadline, "pid {pid} survived SIGKILL");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn guest_fio_verify_survives_upgrades_and_kills_without_key_derivation() {
    if tool("cryptsetup", ["--version"]).code != 0 {
        cryptblk_testutil::skip("cryptsetup is not installed (scripts/install-deps.sh)");
        return;
    }
    let artifacts = build_guest();
    let dir = common::tempdir();
    let path = |name: &str| dir.path().join(name);
    let key = key_file(dir.path(), "key", &common::passphrase("guest-upgrade"));
    let first = path("d0.luks");
    cryptblk(["format", "-q", "--key-file", s(&key), s(&first), "64M"]).ok();
    let mut config = String::new();
    for i in 0..DISKS {
        let image = path(&format!("d{i}.luks"));
        if i > 0 {
            tool("cp", ["--sparse=always", s(&first), s(&image)]).ok();
        }
        let uuid = tool("uuidgen", ["-r"]).stdout.trim().to_string();
        tool("cryptsetup", ["luksUUID", "-q", "--uuid", &uuid, s(&image)]).ok();
        config.push_str(&format!(
            "[[disk]]\nname = \"d{i}\"\nimage = \"{}\"\nkey-file = \"{}\"\nvhost-user-blk = \"{}\"\nnum-queues = 2\n\n",
            s(&image),
            s(&key),
            s(&path(&format!("d{i}.sock")))
        ));
    }
    std::fs::write(path("disks.toml"), config).unwrap();
    let control = path("ctl.sock");
    let daemon = Daemon {
        args: [
            "serve",
            "--config",
            s(&path("disks.toml")),
            "--control",
            s(&control),
            "--key-cache",
            "keyring",
            "--key-cache-timeout",
            "120",
        ]
        .map(String::from)
        .to_vec(),
        log: path("serve.log"),
        control: control.clone(),
    };
    let socket = path("d0.sock");
    let reaper = Reaper::default();
    let mut child = daemon.start();
    reaper.track(child.id());
    wait_for(&socket, &mut child, &daemon);
    let mut pid = child.id();

    let mut guest = Guest::start_restart_verify(&artifacts, &socket, 32 * MIB, dir.path());
    daemon.wait_started(0);
    guest.wait_for_console("FIO-JSON-BEGIN 1", "fio never started", BOUND);

    let mut pauses = Vec::new();
    for event in 0..EVENTS {
        std::thread::sleep(Duration::from_millis(700));
        guest.assert_running();
        let before = daemon.log().matches(STARTED).count();
        let asked = Instant::now();
        if event % 2 == 0 {
            let answer = common::ctl_json(&daemon.control, &["upgrade"]);
            assert_eq!(answer["without-kdf"], DISKS, "{answer}");
            pid = answer["pid"].as_u64().unwrap() as u32;
            reaper.track(pid);
        } else {
            kill(pid);
            child = daemon.start();
            pid = child.id();
            reaper.track(pid);
        }
        pauses.push((event % 2 == 0, daemon.wait_started(before) - asked));
    }
    std::thread::sleep(Duration::from_millis(700));
    let console = guest.stop_and_assert_passed();

    let log = daemon.log();
    assert_eq!(
        log.matches("opened with the volume key from the key cache")
            .count(),
        DISKS * EVENTS / 2,
        "a restart after a kill derived a key:\n{log}"
    );
    let ms = |d: &Duration| format!("{:.0}", d.as_secs_f64() * 1000.0);
    let list = |upgrade: bool| {
        pauses
            .iter()
            .filter(|(u, _)| *u == upgrade)
            .map(|(_, d)| ms(d))
            .collect::<Vec<_>>()
            .join(" ")
    };
    eprintln!(
        "VM pause (request or kill to queues restarted, ms): upgrade {}; kill -9 + restart {}; fio rounds {}",
        list(true),
        list(false),
        console.matches("FIO-JSON-END").count()
    );
    for i in 0..DISKS {
        common::ctl(&control, &["disk-remove", &format!("d{i}"), "--force"]).ok();
    }
    kill(pid);
    let _ = child.try_wait();
}

fn wait_for(socket: &Path, child: &mut Child, daemon: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !socket.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("cryptblk serve exited {status}:\n{}", daemon.log());
        }
        assert!(Instant::now() < deadline, "no socket:\n{}", daemon.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}
