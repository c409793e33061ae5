//! One daemon for a host: thirty LUKS2 disks at cryptblk's default key derivation (argon2id,
//! about two seconds of one core each) restart without a key derivation.
//!
//! - A cold start (no cached key) unlocks the disks in parallel and serves each as soon as it
//!   is unlocked: the first answers within 3 s, the others follow.
//! - `ctl upgrade` hands everything to a new daemon process: the last disk answers a verified
//!   read within 2 s of the upgrade request (which starts the new process).
//! - SIGKILL, then a new daemon with the key cache on: the last disk answers a verified read
//!   within 2 s of the new process starting.
//!
//! The images are one `cryptblk format` at its defaults copied 30 times, each copy given a
//! UUID of its own by `cryptsetup luksUUID` (a header change without a key derivation): each
//! still costs a full argon2 to unlock with its passphrase. Reads and writes go over NBD,
//! whose clients reconnect by themselves; the vhost-user sockets are handed over as well.

mod common;

use common::{bin, cryptblk, key_file, s, tool};
use cryptblk_testutil::nbd::NbdClient;
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

    /// Polls every disk until each has answered `expected(i)` (or, with `None`, any read);
    /// returns when each first did, counted from `since`.
    fn wait_all(
        &self,
        since: Instant,
        bound: Duration,
        expected: impl Fn(usize) -> Option<Vec<u8>>,
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
                if answered[i].is_some() {
                    continue;
                }
                if let Some(data) = self.read(name) {
                    if let Some(want) = expected(i) {
                        assert_eq!(data, want, "disk {name} read back other data");
                    }
                    answered[i] = Some(since.elapsed());
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        answered.into_iter().map(Option::unwrap).collect()
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

    // A cold start: nothing cached, every key derived; disks serve as they are unlocked.
    let started = Instant::now();
    let mut first = host.start();
    let cold = host.wait_all(started, Duration::from_secs(300), |_| None);
    let earliest = *cold.iter().min().unwrap();
    let latest = *cold.iter().max().unwrap();
    eprintln!(
        "cold start: first disk after {earliest:?}, median {:?}, last {latest:?}",
        median(cold.clone())
    );
    assert!(
        earliest < Duration::from_secs(3),
        "the first disk served after {earliest:?}"
    );
    assert!(
        latest > earliest * 4,
        "the disks did not come one by one as they were unlocked: {cold:?}"
    );
    for (i, name) in host.names.iter().enumerate() {
        let mut client = NbdClient::connect(&host.nbd, name).unwrap();
        client.write(0, &pattern(i), true).unwrap();
        client.disconnect().unwrap();
    }

    // The upgrade: a new process takes the disks and keys over.
    let asked = Instant::now();
    let answer = common::ctl_json(&host.control, &["upgrade"]);
    let upgraded = host.wait_all(asked, Duration::from_secs(30), |i| Some(pattern(i)));
    let last = *upgraded.iter().max().unwrap();
    eprintln!("upgrade: {answer}; last disk verified after {last:?}");
    assert_eq!(answer["disks"], DISKS);
    assert_eq!(answer["without-kdf"], DISKS, "{answer}");
    assert!(
        last < Duration::from_secs(2),
        "after the upgrade the last disk answered after {last:?}"
    );
    let successor = answer["pid"].as_u64().unwrap() as u32;
    // The predecessor exits by itself.
    let status = first.wait().unwrap();
    assert!(status.success(), "the upgraded-from daemon exited {status}");

    // SIGKILL and a new daemon: the key cache opens every disk without a KDF.
    kill(successor);
    let restarted = Instant::now();
    let second = host.start();
    let recovered = host.wait_all(restarted, Duration::from_secs(30), |i| Some(pattern(i)));
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
