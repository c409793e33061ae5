//! A throwaway single-node Ceph cluster (one monitor, one memstore OSD, pool `rbd`, auth off,
//! loopback only) in a temp dir, for this test binary; stopped by PID when dropped.

use rustix::process::{kill_process, test_kill_process, Pid, Signal};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub struct Cluster {
    dir: PathBuf,
    pub conf: PathBuf,
}

/// Starts a cluster for this test binary (one test function drives all scenarios so that the
/// cluster is stopped when it returns), or `None` with a loud message when the Ceph daemons are
/// not installed.
pub fn start() -> Option<Cluster> {
    if Command::new("ceph-mon").arg("--version").output().is_err() {
        crate::skip("ceph-mon is not installed (run scripts/install-deps.sh)");
        return None;
    }
    Some(Cluster::start())
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(
            start.elapsed() < limit,
            "cluster: {what} not within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

impl Cluster {
    /// Starts a cluster (the Ceph daemons must be installed); panics naming the step that
    /// failed. Tests call [`start`], which skips when Ceph is missing; the benchmark harness
    /// calls this once it has checked.
    pub fn start() -> Cluster {
        let dir = std::env::temp_dir().join(format!("cryptblk-ceph-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["log", "run", "mon", "osd"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        // A port derived from the PID so parallel test binaries do not collide.
        let port = 20000 + (std::process::id() % 20000);
        let d = dir.display();
        let conf = dir.join("ceph.conf");
        let fsid = run(&mut Command::new("uuidgen")).trim().to_owned();
        std::fs::write(
            &conf,
            format!(
                "[global]\nfsid = {fsid}\nmon host = v2:127.0.0.1:{port}\nms bind msgr1 = false\n\
                 auth cluster required = none\nauth service required = none\n\
                 auth client required = none\nkeyring = /dev/null\nrun dir = {d}/run\n\
                 pid file = {d}/run/$name.pid\nadmin socket = {d}/run/$name.asok\n\
                 log file = {d}/log/$name.log\ncrash dir = {d}/crash\n\
                 osd crush chooseleaf type = 0\nosd pool default size = 1\n\
                 osd pool default min size = 1\nosd pool default pg num = 8\n\
                 osd pool default pgp num = 8\nosd pool default pg autoscale mode = off\n\
                 mon allow pool size one = true\nmon warn on pool no redundancy = false\n\
                 mon data avail crit = 0\nmon data avail warn = 0\nms async op threads = 1\n\
                 [client]\nlog file =\nadmin socket =\n\
                 [mon.a]\nmon data = {d}/mon\npublic addr = v2:127.0.0.1:{port}\n\
                 [osd]\npublic addr = 127.0.0.1\ncluster addr = 127.0.0.1\nosd data = {d}/osd\n\
                 osd objectstore = memstore\nosd class load list = *\n\
                 osd class default list = *\nosd op num shards = 1\n\
                 osd op num threads per shard = 2\nosd crush update on start = false\n\
                 memstore device bytes = 1073741824\nosd client watch timeout = 5\n"
            ),
        )
        .unwrap();
        let cluster = Cluster { dir, conf };
        let c = &cluster.conf;
        run(Command::new("ceph-mon")
            .args(["--id", "a", "--mkfs", "--keyring", "/dev/null", "-c"])
            .arg(c));
        run(Command::new("ceph-mon").args(["--id", "a", "-c"]).arg(c));
        wait_until("the monitor", Duration::from_secs(60), || {
            cluster.ceph(&["mon", "stat"]).is_some()
        });
        let osd = cluster.ceph(&["osd", "create"]).expect("osd create");
        let osd = osd.trim().to_owned();
        cluster
            .ceph(&[
                "osd",
                "crush",
                "add",
                &format!("osd.{osd}"),
                "1",
                "root=default",
                "host=localhost",
            ])
            .expect("crush add");
        run(Command::new("ceph-osd")
            .args(["--id", &osd, "--mkfs", "--mkkey", "--keyring"])
            .arg(cluster.dir.join("osd/keyring"))
            .arg("-c")
            .arg(c));
        run(Command::new("ceph-osd").args(["--id", &osd, "-c"]).arg(c));
        wait_until("the OSD", Duration::from_secs(90), || {
            cluster
                .ceph(&["osd", "stat"])
                .is_some_and(|s| s.contains("1 up") && s.contains("1 in"))
        });
        cluster
            .ceph(&["osd", "pool", "create", "rbd", "8", "8"])
            .expect("pool create");
        cluster.rbd(&["pool", "init", "rbd"]);
        cluster
    }

    /// Runs `ceph ARGS` against this cluster; `None` if it failed.
    pub fn ceph(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("ceph")
            .args(["--connect-timeout", "20", "-c"])
            .arg(&self.conf)
            .args(args)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs `rbd ARGS` against this cluster, panicking with its stderr on failure.
    pub fn rbd(&self, args: &[&str]) -> String {
        run(Command::new("rbd").arg("-c").arg(&self.conf).args(args))
    }

    /// `rbd:rbd/IMAGE:conf=...` for an image of this cluster.
    pub fn name(&self, image: &str) -> String {
        format!("rbd:rbd/{image}:conf={}", self.conf.display())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Freezes the OSD (SIGSTOP) until the returned guard is dropped (SIGCONT): the cluster
    /// stops answering without losing its memstore data, as a paused or partitioned OSD does.
    pub fn pause_osd(&self) -> PausedOsd {
        let pid = std::fs::read_to_string(self.dir.join("run/osd.0.pid"))
            .expect("the OSD's pid file")
            .trim()
            .parse::<i32>()
            .expect("a pid");
        let pid = Pid::from_raw(pid).expect("a positive pid");
        // The OSD this cluster started (read from its own pid file).
        kill_process(pid, Signal::STOP).expect("stopping the OSD");
        PausedOsd { pid }
    }
}

/// A stopped OSD; resumed when dropped (also when a test fails while it is stopped).
pub struct PausedOsd {
    pid: Pid,
}

impl Drop for PausedOsd {
    fn drop(&mut self) {
        // The OSD stopped by `pause_osd`.
        let _ = kill_process(self.pid, Signal::CONT);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for name in ["osd.0", "mon.a"] {
            let pid_file = self.dir.join("run").join(format!("{name}.pid"));
            let Ok(pid) = std::fs::read_to_string(&pid_file) else {
                continue;
            };
            let Some(pid) = pid.trim().parse::<i32>().ok().and_then(Pid::from_raw) else {
                continue;
            };
            // A PID this cluster started (read from its own pid file).
            let _ = kill_process(pid, Signal::TERM);
            let start = Instant::now();
            // Signal 0 only checks that the process exists.
            while test_kill_process(pid).is_ok() && start.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(100));
            }
            // The process ignored SIGTERM for 10 s.
            let _ = kill_process(pid, Signal::KILL);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
