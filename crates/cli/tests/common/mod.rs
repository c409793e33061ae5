//! What the `cryptblk` integration tests share: the fixture layer (crates/fixture: images,
//! the daemon handle, the test guest, running the binary and the real tools), and the few
//! helpers only these tests use.
#![allow(dead_code)]

pub use cryptblk_fixture::*;

pub mod guest;
pub mod online;
pub mod secret;
pub mod xts;

use std::path::Path;
use std::process::{Command, Stdio};

// Legacy starts, until every test has moved onto `Serve`.

/// Polls `migrate-status vol` through `ctl` until it reports `phase`; panics on a failed or
/// cancelled migration or after 2 minutes, with `context()` (e.g. the daemon's log) appended.
pub fn wait_migrate_phase(
    ctl: impl Fn(&[&str]) -> serde_json::Value,
    phase: &str,
    context: impl Fn() -> String,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let st = ctl(&["migrate-status", "vol"]);
        let now = st["phase"].as_str().unwrap_or_default().to_string();
        if now == phase {
            return st;
        }
        assert!(
            !matches!(now.as_str(), "failed" | "cancelled") && std::time::Instant::now() < deadline,
            "waiting for {phase}: {st:#}{}",
            context()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A `cryptblk serve` process for a test: started with `args`, ready once `ready` exists;
/// killed when dropped (a failing test leaves no daemon behind), stopped with SIGTERM by
/// `terminate`.
#[allow(dead_code)]
pub struct ServeProcess(Option<std::process::Child>);

#[allow(dead_code)]
impl ServeProcess {
    pub fn start(args: &[&str], ready: &Path) -> ServeProcess {
        Self::start_cmd(Self::command(args), ready)
    }

    /// As `start`, with the daemon's file writes at or past `limit` bytes refused
    /// (`limit_file_size`).
    pub fn start_with_file_limit(args: &[&str], ready: &Path, limit: u64) -> ServeProcess {
        let mut cmd = Self::command(args);
        limit_file_size(&mut cmd, limit);
        Self::start_cmd(cmd, ready)
    }

    fn command(args: &[&str]) -> Command {
        let mut cmd = Command::new(bin());
        cmd.arg("serve")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .env_remove("RUST_LOG");
        cmd
    }

    fn start_cmd(mut cmd: Command, ready: &Path) -> ServeProcess {
        let mut child = cmd.spawn().unwrap();
        cryptblk_testutil::wait_for_path(ready, &mut child);
        ServeProcess(Some(child))
    }

    /// SIGTERM; returns the exit code.
    pub fn terminate(mut self) -> i32 {
        cryptblk_testutil::terminate(self.0.take().unwrap())
    }

    /// The daemon's process id (e.g. for `prlimit --pid`).
    pub fn id(&self) -> u32 {
        self.0.as_ref().unwrap().id()
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
