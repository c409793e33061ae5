//! The daemon under soak: `cryptblk serve` with the run's config, control socket, NBD server,
//! key cache and memory budget; its control calls; upgrades (`ctl upgrade`: the new process
//! is the old one's child, so this process becomes a subreaper to adopt and reap it) and
//! kill -9 followed by the same command line.
use crate::command::{command_line, show};
use anyhow::{anyhow, bail, Context, Result};
use rustix::process::{
    getpid, kill_process, set_child_subreaper, waitpid, Pid, Signal, WaitOptions,
};
use serde_json::Value;
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// How long a start, an upgrade or an exit may take before the soak gives up.
const BOUND: Duration = Duration::from_secs(120);

pub struct Daemon {
    cryptblk: PathBuf,
    args: Vec<OsString>,
    control: PathBuf,
    log: PathBuf,
    pid: u32,
}

pub struct Settings<'a> {
    pub cryptblk: &'a Path,
    pub config: &'a Path,
    pub control: &'a Path,
    pub nbd: &'a Path,
    pub memory_budget: &'a str,
    pub log: &'a Path,
}

impl Daemon {
    /// Starts it (not yet ready: see [`Daemon::wait_ready`]).
    pub fn start(s: &Settings) -> Result<Daemon> {
        // Any non-zero argument turns it on; this process's own PID is one.
        if let Err(e) = set_child_subreaper(Some(getpid())) {
            bail!("prctl(PR_SET_CHILD_SUBREAPER): {}", std::io::Error::from(e));
        }
        let args: Vec<OsString> = vec![
            "serve".into(),
            "--config".into(),
            s.config.into(),
            "--control".into(),
            s.control.into(),
            "--nbd".into(),
            format!("unix:{}", s.nbd.display()).into(),
            "--key-cache".into(),
            "keyring".into(),
            "--memory-budget".into(),
            s.memory_budget.into(),
        ];
        let mut d = Daemon {
            cryptblk: s.cryptblk.to_path_buf(),
            args,
            control: s.control.to_path_buf(),
            log: s.log.to_path_buf(),
            pid: 0,
        };
        d.spawn()?;
        Ok(d)
    }

    pub fn command_line(&self) -> String {
        command_line(&self.command())
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.cryptblk);
        cmd.args(&self.args);
        cmd
    }

    fn spawn(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let mut cmd = self.command();
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .env("RUST_LOG", "info");
        // libblkio makes its memfds and eventfds without close-on-exec: a daemon restarted
        // while clients are connected would inherit this process's client descriptors and
        // count them as its own. Marked close-on-exec rather than closed: the pipe that reports
        // a failed exec to the parent stays usable.
        // SAFETY: close_range(2) is async-signal-safe and changes only the child's own
        // descriptor table, after fork and before exec; 0-2 are the redirections above.
        unsafe {
            cmd.pre_exec(|| {
                let flags = libc::CLOSE_RANGE_CLOEXEC;
                if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, flags) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        show(&cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.cryptblk.display()))?;
        // Reaped by pid (`reap`): after an upgrade the serving process is no `Child` of ours.
        self.pid = child.id();
        Ok(())
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn log(&self) -> &Path {
        &self.log
    }

    /// `cryptblk ctl -s CONTROL ARGS...`: its JSON answer, or why it failed.
    pub fn ctl<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> Result<Value> {
        crate::clients::ctl(&self.cryptblk, &self.control, args)
    }

    /// Waits until the daemon answers `disk-list` with at least `disks` disks.
    pub fn wait_ready(&self, disks: usize) -> Result<()> {
        crate::wait::until(
            BOUND,
            Duration::from_millis(20),
            || {
                format!(
                    "the daemon did not serve {disks} disks (log: {})",
                    self.log.display()
                )
            },
            || {
                self.check_alive()?;
                let list = self.ctl(&["disk-list"]);
                Ok(list.is_ok_and(|l| served(&l) >= disks).then_some(()))
            },
        )
    }

    fn check_alive(&self) -> Result<()> {
        if let Some(status) = try_reap(self.pid)? {
            bail!(
                "the daemon (pid {}) exited: {status} (log: {})",
                self.pid,
                self.log.display()
            );
        }
        Ok(())
    }

    /// `ctl upgrade`: a new process takes every disk over; returns its pid once the old one
    /// exited.
    pub fn upgrade(&mut self) -> Result<u32> {
        let answer = self.ctl(&["upgrade"])?;
        let new = answer["pid"]
            .as_u64()
            .and_then(|p| u32::try_from(p).ok())
            .ok_or_else(|| anyhow!("the upgrade's answer has no pid: {answer}"))?;
        let status = reap(self.pid)?;
        if status != 0 {
            bail!(
                "the upgraded daemon exited with wait status {status:#x} (log: {})",
                self.log.display()
            );
        }
        self.pid = new;
        Ok(new)
    }

    /// kill -9, then the same command line again.
    pub fn kill_and_restart(&mut self) -> Result<u32> {
        self.signal(Signal::KILL)?;
        reap(self.pid)?;
        self.spawn()?;
        Ok(self.pid)
    }

    /// SIGTERM and its exit.
    pub fn stop(&mut self) -> Result<i32> {
        self.signal(Signal::TERM)?;
        reap(self.pid)
    }

    fn signal(&self, signal: Signal) -> Result<()> {
        let pid = libc::pid_t::try_from(self.pid)?;
        let target = Pid::from_raw(pid).ok_or_else(|| anyhow!("kill({pid}): not a process"))?;
        // The daemon this process started or adopted and has not reaped: the PID is still its.
        if let Err(e) = kill_process(target, signal) {
            bail!(
                "kill({pid}, {}): {}",
                signal.as_raw(),
                std::io::Error::from(e)
            );
        }
        Ok(())
    }
}

/// How many disks a `disk-list` answer names (an array, or an object holding one).
fn served(list: &Value) -> usize {
    match list {
        Value::Array(a) => a.len(),
        Value::Object(o) => o.values().map(served).max().unwrap_or(0),
        _ => 0,
    }
}

/// The wait status of `pid` if it has exited (and reaps it).
fn try_reap(pid: u32) -> Result<Option<i32>> {
    let target = Pid::from_raw(pid as libc::pid_t)
        .ok_or_else(|| anyhow!("waitpid({pid}): not a process"))?;
    // A child of this process (started or adopted as subreaper).
    match waitpid(Some(target), WaitOptions::NOHANG) {
        Ok(None) => Ok(None),
        Ok(Some((_, status))) => Ok(Some(status.as_raw())),
        Err(e) => Err(anyhow!("waitpid({pid}): {}", std::io::Error::from(e))),
    }
}

/// Waits (bounded) for `pid` to exit; its wait status.
fn reap(pid: u32) -> Result<i32> {
    crate::wait::until(
        BOUND,
        Duration::from_millis(5),
        || format!("pid {pid} did not exit"),
        || try_reap(pid),
    )
}
