//! One daemon for a host: thirty LUKS2 disks at cryptblk's default key derivation (argon2id,
//! about two seconds of one core each) restart without a key derivation.
//!
//! - A cold start (no cached key) unlocks the disks in parallel and serves each on its
//!   vhost-user socket as soon as it is unlocked: the first answers within 3 s, the others
//!   follow.
//! - `ctl upgrade` hands everything to a new daemon process: the last disk answers a verified
//!   read within 2 s of the upgrade request (which starts the new process).
//! - SIGKILL, then a new daemon with the key cache on: the last disk answers a verified read
//!   within 2 s of the new process starting.
//!
//! The images are one `cryptblk format` at its defaults copied 30 times, each copy given a
//! UUID of its own by `cryptsetup luksUUID` (a header change without a key derivation): each
//! still costs a full argon2 to unlock with its passphrase. The cold start is watched over
//! vhost-user (a read as a VM makes it); the restarts by verified reads over NBD, whose
//! clients reconnect by themselves (the vhost-user sockets are handed over as well).

mod common;

use common::{bin, cryptblk, key_file, s, tool};
use cryptblk_testutil::nbd::NbdClient;
use cryptblk_testutil::vhost_user::{Guest, S_OK};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const DISKS: usize = 30;
/// A disk's payload (the LUKS2 header adds 16 MiB; copies are sparse).
const PAYLOAD: &str = "4M";

struct Host {
    dir: tempfile::TempDir,
    names: Vec<String>,
    config: PathBuf,
    control: PathBuf,
    nbd: PathBuf,
    log: PathBuf,
}

impl Host {
    fn args(&self) -> Vec<String> {
        [
            "serve",
            "--config",
            s(&self.config),
            "--control",
            s(&self.control),
            "--nbd",
            &format!("unix:{}", s(&self.nbd)),
            "--key-cache",
            "keyring",
            "--key-cache-timeout",
            "120",
        ]
        .map(String::from)
        .to_vec()
    }

    /// Starts `cryptblk serve` (logging to `log`, appended: successors write there too).
    fn start(&self) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        Command::new(bin())
            .args(self.args())
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

    /// One disk's block 0 read over NBD, if its export answers now.
    fn read(&self, name: &str) -> Option<Vec<u8>> {
        let mut client = NbdClient::connect(&self.nbd, name).ok()?;
        let data = client.read(0, 4096).ok()?;
        let _ = client.disconnect();
        Some(data)
    }

    /// Polls every disk until `probe` says it answered; returns when each first did, counted
    /// from `since`.
    fn wait_all(
        &self,
        since: Instant,
        bound: Duration,
        mut probe: impl FnMut(usize, &str) -> bool,
    ) -> Vec<Duration> {
        let mut answered: Vec<Option<Duration>> = vec![None; self.names.len()];
        while answered.iter().any(Option::is_none) {
            assert!(
                since.elapsed() < bound,
                "disks {:?} did not answer within {bound:?}; log:\n{}",
                answered
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.is_none())
                    .map(|(i, _)| &self.names[i])
                    .collect::<Vec<_>>(),
                self.log()
            );
            for (i, name) in self.names.iter().enumerate() {
                if answered[i].is_none() && probe(i, name) {
                    answered[i] = Some(since.elapsed());
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        answered.into_iter().map(Option::unwrap).collect()
    }

    /// Whether disk `i` answers a read of its first block over NBD with its pattern.
    fn verified(&self, i: usize, name: &str) -> bool {
        match self.read(name) {
            Some(data) => {
                assert_eq!(data, pattern(i), "disk {name} read back other data");
                true
            }
            None => false,
        }
    }

    /// Whether disk `name` answers a read over its vhost-user socket (what a VM uses; the NBD
    /// server appears only once every disk of the start serves).
    fn vhost_answers(&self, name: &str) -> bool {
        let socket = self.dir.path().join(format!("{name}.sock"));
        if !socket.exists() {
            return false;
        }
        let mut guest = Guest::connect(&socket, 1, 256);
        guest.read(0, 0, 4096).0 == S_OK
    }
}

fn pattern(i: usize) -> Vec<u8> {
    (0..4096).map(|b| (b * 7 + i * 13) as u8).collect()
}

fn host() -> Host {
    let dir = common::tempdir();
    let key = key_file(dir.path(), "key", &common::passphrase("host-restart"));
    let first = dir.path().join("d0.luks");
    // cryptblk's defaults: LUKS2, argon2id benchmarked to about 2 s.
    cryptblk(["format", "-q", "--key-file", s(&key), s(&first), PAYLOAD]).ok();
    let mut config = String::new();
    let mut names = Vec::new();
    for i in 0..DISKS {
        let name = format!("d{i}");
        let image = dir.path().join(format!("{name}.luks"));
        if i > 0 {
            tool("cp", ["--sparse=always", s(&first), s(&image)]).ok();
        }
        // A fresh UUID each run: the key cache names keys by it.
        let uuid = tool("uuidgen", ["-r"]).stdout.trim().to_string();
        tool("cryptsetup", ["luksUUID", "-q", "--uuid", &uuid, s(&image)]).ok();
        config.push_str(&format!(
            "[[disk]]\nname = \"{name}\"\nimage = \"{}\"\nkey-file = \"{}\"\nvhost-user-blk = \"{}\"\n\n",
            s(&image),
            s(&key),
            s(&dir.path().join(format!("{name}.sock")))
        ));
        names.push(name);
    }
    let config_path = dir.path().join("disks.toml");
    std::fs::write(&config_path, config).unwrap();
    Host {
        control: dir.path().join("ctl.sock"),
        nbd: dir.path().join("nbd.sock"),
        log: dir.path().join("serve.log"),
        config: config_path,
        names,
        dir,
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
    // SAFETY: kill(2) on a daemon process this test started (directly, or as its upgrade).
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    let gone = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        // A child of ours lingers as a zombie until reaped: reaping is the caller's.
        if std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| stat.contains(") Z "))
        {
            break;
        }
        assert!(
            gone.elapsed() < Duration::from_secs(10),
            "pid {pid} survived SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
fn thirty_default_kdf_disks_restart_without_a_key_derivation() {
    if tool("cryptsetup", ["--version"]).code != 0 {
        cryptblk_testutil::skip("cryptsetup is not installed (scripts/install-deps.sh)");
        return;
    }
    let host = host();
    let reaper = Reaper::default();

    // A cold start: nothing cached, every key derived; disks serve as they are unlocked.
    let started = Instant::now();
    let mut first = host.start();
    reaper.track(first.id());
    let cold = host.wait_all(started, Duration::from_secs(300), |_, name| {
        host.vhost_answers(name)
    });
    let earliest = *cold.iter().min().unwrap();
    let latest = *cold.iter().max().unwrap();
    eprintln!(
        "cold start: first disk after {earliest:?}, median {:?}, last {latest:?}",
        median(cold.clone())
    );
    // Disks come as they are unlocked, several at a time: the last long after the first.
    // Within 3 s (a default keyslot's KDF takes about 2 s), or, on a machine so busy that the
    // KDF itself took longer, within a second of the fastest disk's own unlock: the first disk
    // never waits for the others.
    let fastest_unlock = host
        .log()
        .lines()
        .filter_map(|l| {
            l.split("opened_ms=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .map(Duration::from_millis)
        .min()
        .expect("the daemon logs how long each disk took to open");
    assert!(
        earliest < Duration::from_secs(3).max(fastest_unlock + Duration::from_secs(1)),
        "the first disk served after {earliest:?} (the fastest unlock took {fastest_unlock:?})"
    );
    assert!(
        latest > earliest * 4,
        "the disks did not come one by one as they were unlocked: {cold:?}"
    );
    // Every disk serves: the NBD server is up.
    host.wait_all(Instant::now(), Duration::from_secs(30), |_, name| {
        host.read(name).is_some()
    });
    for (i, name) in host.names.iter().enumerate() {
        let mut client = NbdClient::connect(&host.nbd, name).unwrap();
        client.write(0, &pattern(i), true).unwrap();
        client.disconnect().unwrap();
    }

    // The upgrade: a new process takes the disks and keys over.
    let asked = Instant::now();
    let answer = common::ctl_json(&host.control, &["upgrade"]);
    let upgraded = host.wait_all(asked, Duration::from_secs(30), |i, name| {
        host.verified(i, name)
    });
    let last = *upgraded.iter().max().unwrap();
    eprintln!("upgrade: {answer}; last disk verified after {last:?}");
    assert_eq!(answer["disks"], DISKS);
    assert_eq!(answer["without-kdf"], DISKS, "{answer}");
    assert!(
        last < Duration::from_secs(2),
        "after the upgrade the last disk answered after {last:?}"
    );
    let successor = answer["pid"].as_u64().unwrap() as u32;
    reaper.track(successor);
    // The predecessor exits by itself.
    let status = first.wait().unwrap();
    assert!(status.success(), "the upgraded-from daemon exited {status}");

    // SIGKILL and a new daemon: the key cache opens every disk without a KDF.
    kill(successor);
    let restarted = Instant::now();
    let second = host.start();
    reaper.track(second.id());
    let recovered = host.wait_all(restarted, Duration::from_secs(30), |i, name| {
        host.verified(i, name)
    });
    let last = *recovered.iter().max().unwrap();
    eprintln!("kill -9 + restart with the key cache: last disk verified after {last:?}");
    assert!(
        last < Duration::from_secs(2),
        "after the restart the last disk answered after {last:?}"
    );
    let log = host.log();
    assert_eq!(
        log.matches("opened with the volume key from the key cache")
            .count(),
        DISKS,
        "{log}"
    );

    // Detaching removes a disk's cached key: nothing of this test stays in the keyring.
    for name in &host.names {
        common::ctl(&host.control, &["disk-remove", name, "--force"]).ok();
    }
    assert_eq!(cryptblk_testutil::terminate(second), 0);
    drop(host.dir);
}
