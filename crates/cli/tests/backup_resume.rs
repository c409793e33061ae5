//! An interrupted `backup pull` is continued only from the backup it began on (issue 36's
//! resume bug). Each `backup-start` has an id of its own, in its answer and in the export's
//! NBD description: the same command run against the same backup continues the copy (and the
//! chain restores to the image at that backup's start, although the disk changed since); run
//! against a backup started again at the same checkpoint after `backup-end --failed` and a
//! write, it says so, starts over, and restores to the image at the second start, not to a
//! mix of the two moments.
mod common;

use common::*;
use serde_json::Value;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Paced so that a pull of the 16 MiB disk takes about four seconds: long enough to be
/// interrupted half-way, short enough for a test.
const MAX_BANDWIDTH: &str = "4M";

struct Backup {
    t: TestDir,
    daemon: Daemon,
    image: PathBuf,
    socket: PathBuf,
    chain: PathBuf,
    /// Where the disk's first byte is in the image (the LUKS header's length).
    payload: u64,
}

impl Backup {
    /// A 16 MiB LUKS2 disk written all over, served with a control socket.
    fn new() -> Backup {
        let t = TestDir::new();
        let key = t.key("key");
        let img = t.luks2("disk.luks", "16M", &key);
        let daemon = t.serve().disk(&img).name("vol").nbd().control().start();
        daemon.qemu_io("vol", &["write -P 0x5a 0 16M"]);
        let payload = img.dump()["segments"][0]["offset"].as_u64().unwrap();
        Backup {
            socket: t.path("backup.sock"),
            chain: t.path("chain"),
            image: img.path,
            daemon,
            payload,
            t,
        }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///vol?socket={}", s(&self.socket))
    }

    /// `backup-start vol --checkpoint c0`; its answer.
    fn start(&self) -> Value {
        let started = self.daemon.ctl_ok(&argv!(
            "backup-start vol --checkpoint c0 --nbd {} --max-bandwidth {}",
            format!("unix:{}", s(&self.socket)),
            MAX_BANDWIDTH
        ));
        let id = started["id"].as_str().unwrap_or_default();
        assert!(
            id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
            "backup-start's answer has no 128-bit hex id: {started}"
        );
        started
    }

    /// The pull every step of these tests runs, the user's one command.
    fn pull_command(&self) -> std::process::Command {
        let mut cmd = std::process::Command::new(bin());
        cmd.args(["backup", "pull", "--progress=json", &self.uri()])
            .arg(&self.chain)
            .args(["--checkpoint", "c0"]);
        cmd
    }

    /// The pull, stopped with SIGINT once it has looked at the header and 4 MiB of the disk
    /// (the first MiB copied, then recorded as durable): exit 8, the partial entry kept.
    fn interrupted_pull(&self, log: &str) -> String {
        let mut pull = Process::spawn(self.pull_command(), self.t.path(log));
        let past = self.payload + 4 * MIB;
        let deadline = Instant::now() + BOUND;
        while progress(&pull.log()) < past {
            pull.assert_running();
            assert!(
                Instant::now() < deadline,
                "the pull did not get past byte {past}:\n{}",
                pull.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let status = pull.signal_and_wait(libc::SIGINT, BOUND);
        let out = pull.log();
        assert_eq!(status.code(), Some(code::OTHER), "{out}");
        assert!(out.contains("the same command continues"), "{out}");
        assert!(self.chain.join("pull.progress").exists(), "{out}");
        assert!(
            progress(&out) < self.payload + 16 * MIB,
            "the pull had finished when interrupted:\n{out}"
        );
        out
    }

    /// The same pull run to its end; its stderr.
    fn finished_pull(&self) -> String {
        let out = self.pull_command().output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{}\n{stderr}", out.status);
        assert!(!self.chain.join("pull.progress").exists(), "{stderr}");
        stderr
    }

    fn restored(&self, name: &str) -> Vec<u8> {
        let restored = self.t.path(name);
        cryptblk(["backup", "restore", s(&self.chain), s(&restored)]).ok();
        read(&restored)
    }
}

/// The furthest position the pull's JSON progress lines report.
fn progress(log: &str) -> u64 {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["done_bytes"].as_u64())
        .max()
        .unwrap_or(0)
}

/// Lines of `stderr` that are notes (`cryptblk: note: ...`).
fn notes(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("cryptblk: note:"))
        .collect()
}

fn description(uri: &str) -> String {
    let info = tool("nbdinfo", ["--json", uri]);
    info.ok();
    let info: Value = serde_json::from_str(&info.stdout).unwrap();
    info["exports"][0]["description"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[test]
fn an_interrupted_pull_continues_on_the_same_backup() {
    let mut b = Backup::new();
    let at_start = read(&b.image);
    let started = b.start();
    let id = started["id"].as_str().unwrap();
    // Any NBD client sees which backup it reads.
    let described = description(&b.uri());
    assert!(
        described.starts_with(&format!("backup {id} of disk vol")),
        "{described}"
    );
    b.interrupted_pull("pull1.log");

    // The disk changes while the pull is stopped; the backup is still of its start.
    b.daemon.qemu_io("vol", &["write -P 0xa5 0 1M"]);
    assert_ne!(read(&b.image), at_start);
    let stderr = b.finished_pull();
    let notes = notes(&stderr);
    assert!(
        notes.len() == 1
            && notes[0].contains("continuing the interrupted pull of checkpoint \"c0\""),
        "{stderr}"
    );
    b.daemon.ctl_ok(&["backup-end", "vol"]);
    let restored = b.restored("restored.luks");
    assert!(
        restored == at_start,
        "the chain is not the image at backup-start: first difference at {:?} (payload at {})",
        first_difference(&restored, &at_start),
        b.payload
    );
    assert_eq!(b.daemon.terminate(), code::OK);
}

#[test]
fn a_pull_does_not_continue_into_a_backup_started_again() {
    let mut b = Backup::new();
    let first = b.start();
    b.interrupted_pull("pull1.log");
    b.daemon.ctl_ok(&["backup-end", "vol", "--failed"]);

    // Between the two backups the disk's first MiB changes: the second backup holds it.
    b.daemon.qemu_io("vol", &["write -P 0xa5 0 1M"]);
    let at_second_start = read(&b.image);
    let second = b.start();
    let (first_id, second_id) = (
        first["id"].as_str().unwrap(),
        second["id"].as_str().unwrap(),
    );
    assert_ne!(first_id, second_id, "two backup-starts got one id");

    // The user's same command, as docs/backup.md tells it after a failed backup.
    let stderr = b.finished_pull();
    assert!(!stderr.contains("continuing"), "{stderr}");
    let notes = notes(&stderr);
    assert!(
        notes.len() == 1
            && notes[0].contains("discarding the interrupted pull of checkpoint \"c0\"")
            && notes[0].contains("starting over")
            && notes[0].contains(first_id)
            && notes[0].contains(second_id),
        "{stderr}"
    );
    b.daemon.ctl_ok(&["backup-end", "vol"]);
    let restored = b.restored("restored.luks");
    assert!(
        restored == at_second_start,
        "the chain is not the image at the second backup-start: first difference at {:?} \
         (payload at {})",
        first_difference(&restored, &at_second_start),
        b.payload
    );
    assert_eq!(b.daemon.terminate(), code::OK);
}
