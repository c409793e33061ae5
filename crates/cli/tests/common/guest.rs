//! The small Debian guest the end-to-end tests boot under QEMU (see `scripts/guest/`), and
//! handles on the daemon and the guest processes those tests drive.

use std::ffi::OsStr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// `scripts/guest`: the scripts that build and boot the guest.
pub fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/guest")
}

/// Builds (or finds cached) the guest kernel and initramfs; returns the directory holding
/// `vmlinuz` and `initramfs.cpio.gz`.
pub fn build_guest() -> PathBuf {
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

/// sha256 of `data` in hex, by the host's sha256sum (coreutils), to compare with the digest
/// the guest's busybox prints.
pub fn host_digest(data: &[u8]) -> String {
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

/// Bound on every wait: the VM coming back to a new daemon, the guest finishing.
pub const BOUND: Duration = Duration::from_secs(60);
/// What the daemon logs (RUST_LOG=info) when the VM has started its queues.
pub const STARTED: &str = "vhost-user frontend: Started";

/// One `cryptblk serve` process, killed if still running when dropped.
pub struct Serve {
    child: Child,
    log: PathBuf,
}

impl Serve {
    pub fn start(binary: &Path, args: &[&OsStr], socket: &Path, log: PathBuf) -> Serve {
        let _ = std::fs::remove_file(socket);
        let child = Command::new(binary)
            .arg("serve")
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start cryptblk serve");
        let mut serve = Serve { child, log };
        let deadline = Instant::now() + BOUND;
        while !socket.exists() {
            if let Some(status) = serve.child.try_wait().unwrap() {
                panic!("cryptblk serve exited {status}: {}", serve.output());
            }
            assert!(Instant::now() < deadline, "no socket: {}", serve.output());
            std::thread::sleep(Duration::from_millis(10));
        }
        serve
    }

    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the VM has started the disk's queues on this daemon.
    pub fn wait_started(&mut self) -> Instant {
        let deadline = Instant::now() + BOUND;
        loop {
            if self.output().contains(STARTED) {
                return Instant::now();
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("cryptblk serve exited {status}: {}", self.output());
            }
            assert!(
                Instant::now() < deadline,
                "the VM did not come back to the restarted daemon within {BOUND:?}: {}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// kill -9, and waits until the process is gone (its image lock with it).
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, and the exit status.
    pub fn terminate(mut self) -> ExitStatus {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) on our own child's pid, which has not been reaped yet.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let deadline = Instant::now() + BOUND;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "cryptblk serve ignored SIGTERM: {}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The booted guest: run-guest.sh with its console input, killed if still running.
pub struct Guest {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub console: PathBuf,
}

impl Guest {
    /// Boots the guest on the vhost-user-blk `socket` (2 queues, reconnecting after a daemon
    /// restart) running fio's `restart-verify` job over its first `size` bytes; the console
    /// log and run-guest.sh's errors go to `dir`.
    pub fn start_restart_verify(artifacts: &Path, socket: &Path, size: u64, dir: &Path) -> Guest {
        let console = dir.join("console.log");
        let mut child = Command::new(scripts().join("run-guest.sh"))
            .args(["--vhost-user-blk", socket.to_str().unwrap()])
            .args(["--queues", "2", "--reconnect", "1", "--stdin"])
            .args(["--job", "restart-verify", "--size", &size.to_string()])
            .args(["--timeout", "600", "--artifacts"])
            .arg(artifacts)
            .arg("--log")
            .arg(&console)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("run-guest.err")).unwrap())
            .spawn()
            .expect("run scripts/guest/run-guest.sh");
        let stdin = child.stdin.take();
        Guest {
            child,
            stdin,
            console,
        }
    }

    /// Waits until the console shows `marker` (`what` names it in the failure), at most
    /// `limit`; fails at once if the guest ends.
    pub fn wait_for_console(&mut self, marker: &str, what: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        while !self.console().contains(marker) {
            self.assert_running();
            assert!(Instant::now() < deadline, "{what}:\n{}", self.console());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Tells the guest's restart-verify job to finish its round (`stop` on its console) and
    /// asserts that it ends within 300 s having passed every round. Returns its console log.
    pub fn stop_and_assert_passed(&mut self) -> String {
        // Said again every two seconds until the guest ends, and the console kept open
        // meanwhile: one "stop" written and the console closed went unread once (CI, the guest
        // running 130 more rounds).
        let mut stdin = self.stdin.take().expect("the guest's console input");
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut say_stop = Instant::now();
        let status = loop {
            if Instant::now() >= say_stop {
                // Fails only once the guest has ended (a closed pipe), which the wait sees.
                let _ = stdin.write_all(b"stop\n").and_then(|()| stdin.flush());
                say_stop = Instant::now() + Duration::from_secs(2);
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "the guest did not finish (hung I/O?):\n{}",
                tail(&self.console(), 40)
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        let console = self.console();
        let errors = self.console.with_file_name("run-guest.err");
        assert!(
            status.success() && console.lines().any(|l| l == "GUEST-RESULT: PASS"),
            "guest failed ({status}):\n{}\n{}",
            tail(&console, 60),
            std::fs::read_to_string(errors).unwrap_or_default()
        );
        console
    }

    pub fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    pub fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!(
                "the guest ended early ({status}):\n{}",
                tail(&self.console(), 40)
            );
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
