//! The demo's last step, the main job: `cryptblk serve` runs as its own process on the demo's
//! LUKS2 image and on its plaintext twin, each on a vhost-user-blk socket; a real client
//! (libblkio, as a VM's virtio-blk would) writes and reads both, and the encrypted and plain
//! throughput are printed side by side. The daemon is then stopped with SIGTERM, the way
//! systemd stops it, and must exit cleanly.
use super::client::{Disk, Load};
use anyhow::{bail, Context, Result};
use rustix::process::{kill_process, Pid, Signal};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long each disk gets per workload; two disks and three workloads keep the step near
/// 10 seconds.
const RUN: Duration = Duration::from_millis(1500);

const LOADS: [Load; 3] = [
    Load {
        write: false,
        random: true,
        block: 4096,
        depth: 32,
        time: RUN,
    },
    Load {
        write: false,
        random: false,
        block: 65536,
        depth: 16,
        time: RUN,
    },
    Load {
        write: true,
        random: false,
        block: 65536,
        depth: 16,
        time: RUN,
    },
];

/// The demo's files the daemon serves.
pub struct Images<'a> {
    pub dir: &'a Path,
    pub encrypted: &'a Path,
    pub plain: &'a Path,
    pub key_file: &'a Path,
    pub threads: usize,
}

/// A `cryptblk serve` child that is killed if the demo fails before stopping it.
struct Daemon {
    child: Option<Child>,
    log: PathBuf,
}

impl Daemon {
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(10)..].join("\n")
    }

    /// SIGTERM, then the exit status; the daemon drains and flushes every disk first.
    fn stop(mut self) -> Result<Duration> {
        let child = self.child.as_mut().expect("stopped once");
        let started = Instant::now();
        // Our own child, not reaped yet: its PID is still its own.
        if let Err(e) = kill_process(Pid::from_child(child), Signal::TERM) {
            // Drop kills and reaps it.
            bail!("stopping the daemon: {}", std::io::Error::from(e));
        }
        let status = child.wait().context("waiting for the daemon")?;
        self.child = None;
        if !status.success() {
            bail!(
                "the daemon did not stop cleanly ({status}); its log ({}):\n{}",
                self.log.display(),
                self.log_tail()
            );
        }
        Ok(started.elapsed())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn run(images: &Images) -> Result<()> {
    let encrypted_socket = images.dir.join("encrypted.sock");
    let plain_socket = images.dir.join("plain.sock");
    let config = images.dir.join("disks.toml");
    std::fs::write(
        &config,
        format!(
            // libblkio (the demo's client) does not seal its memory against shrinking.
            "[[disk]]\nname = \"encrypted\"\nimage = {:?}\nkey-file = {:?}\nvhost-user-blk = {:?}\n\
             unsealed-memory = true\n\n\
             [[disk]]\nname = \"plain\"\nimage = {:?}\nvhost-user-blk = {:?}\n\
             unsealed-memory = true\n",
            absolute(images.encrypted)?,
            absolute(images.key_file)?,
            absolute(&encrypted_socket)?,
            absolute(images.plain)?,
            absolute(&plain_socket)?,
        ),
    )
    .with_context(|| format!("writing {}", config.display()))?;
    let log = images.dir.join("serve.log");
    let program = std::env::current_exe().context("finding the cryptblk binary")?;
    println!(
        "6. serve           {} --threads {} serve --config {}",
        program.display(),
        images.threads,
        config.display()
    );
    let started = Instant::now();
    let mut daemon = Daemon {
        child: Some(
            Command::new(&program)
                .args([
                    "--threads",
                    &images.threads.to_string(),
                    "serve",
                    "--config",
                ])
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).context("creating the daemon's log")?)
                .spawn()
                .context("starting cryptblk serve")?,
        ),
        log,
    };
    wait_for_sockets(&mut daemon, &[&encrypted_socket, &plain_socket])?;
    println!(
        "   serving both disks over vhost-user-blk after {:.2} s (LUKS2 unlocked with the key file)",
        started.elapsed().as_secs_f64()
    );

    let buffer = LOADS.iter().map(|l| l.depth * l.block).max().unwrap_or(0);
    let mut encrypted = connect(&encrypted_socket, buffer)?;
    let mut plain = connect(&plain_socket, buffer)?;
    round_trip(&mut encrypted)?;
    println!(
        "   a client (libblkio, like a VM's virtio-blk) wrote 1 MiB to the encrypted disk and read it back: identical"
    );
    let area = encrypted.capacity().min(plain.capacity());
    println!("   {}", what_is_measured(images, area)?);
    println!(
        "\n   {:<28} {:>20} {:>20} {:>10}",
        "workload", "encrypted (LUKS2)", "plain (raw)", "ratio"
    );
    for load in LOADS {
        encrypted.fill(7);
        plain.fill(7);
        // encrypted, plain, plain, encrypted: storage whose speed drifts during the step
        // favours neither side.
        let half = Load {
            time: load.time / 2,
            ..load
        };
        let e1 = encrypted.run(half, area)?;
        let p1 = plain.run(half, area)?;
        let p2 = plain.run(half, area)?;
        let e2 = encrypted.run(half, area)?;
        let (e, p) = (e1.mean(&e2), p1.mean(&p2));
        let (e_shown, p_shown) = if load.block == 4096 {
            (format!("{:.0} IOPS", e.iops), format!("{:.0} IOPS", p.iops))
        } else {
            (
                format!("{:.0} MiB/s", e.bytes_per_sec / (1 << 20) as f64),
                format!("{:.0} MiB/s", p.bytes_per_sec / (1 << 20) as f64),
            )
        };
        println!(
            "   {:<28} {:>20} {:>20} {:>10.2}",
            load.describe(),
            e_shown,
            p_shown,
            e.iops / p.iops.max(1e-9)
        );
    }
    drop(encrypted);
    drop(plain);
    let stopped = daemon.stop()?;
    println!(
        "\n   daemon stopped with SIGTERM in {:.2} s: every request drained, disks flushed and closed",
        stopped.as_secs_f64()
    );
    std::io::stdout().flush()?;
    Ok(())
}

/// One line saying what the table compares: where both images are, how much of each is
/// allocated (the plain twin is dense like the ciphertext, no holes read as free zeros), how
/// the client drives them and in which order.
fn what_is_measured(images: &Images, area: u64) -> Result<String> {
    use std::os::unix::fs::MetadataExt;
    let allocated = |p: &Path| -> Result<u64> {
        Ok(std::fs::metadata(p)
            .with_context(|| format!("reading {}", p.display()))?
            .blocks()
            * 512)
    };
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    Ok(format!(
        "measured: the first {:.0} MiB of each disk, both served by this one daemon from {} \
         ({}), encrypted image {:.1} MiB allocated (header included), plain twin {:.1} MiB \
         allocated (no holes); one libblkio queue per disk, {:.2} s per workload and disk in \
         interleaved halves (encrypted, plain, plain, encrypted); ratio = encrypted / plain",
        mib(area),
        images.dir.display(),
        filesystem(images.dir),
        mib(allocated(images.encrypted)?),
        mib(allocated(images.plain)?),
        RUN.as_secs_f64()
    ))
}

/// The filesystem type of `dir` as `stat -f` names the common ones.
fn filesystem(dir: &Path) -> String {
    let Ok(st) = rustix::fs::statfs(dir) else {
        return "unknown filesystem".into();
    };
    let kind = st.f_type as u64;
    match kind {
        0x0102_1994 => "tmpfs".into(),
        0xef53 => "ext2/3/4".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683e => "btrfs".into(),
        0x2fc1_2fc1 => "zfs".into(),
        0x6969 => "nfs".into(),
        0x794c_7630 => "overlayfs".into(),
        other => format!("filesystem type {other:#x}"),
    }
}

/// Writes 1 MiB of data at 1 MiB through the daemon and reads it back into the same shared
/// buffer, which must then hold what was written.
fn round_trip(disk: &mut Disk) -> Result<()> {
    const LEN: usize = 1 << 20;
    disk.fill(0x5eed);
    let written = disk.snapshot(LEN);
    disk.transfer(true, 1 << 20, LEN)?;
    disk.fill(1);
    disk.transfer(false, 1 << 20, LEN)?;
    if disk.snapshot(LEN) != written {
        bail!("the encrypted disk returned different data than was written to it");
    }
    Ok(())
}

fn wait_for_sockets(daemon: &mut Daemon, sockets: &[&Path]) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if sockets.iter().all(|s| s.exists()) {
            return Ok(());
        }
        let child = daemon.child.as_mut().expect("running");
        if let Some(status) = child.try_wait()? {
            bail!(
                "cryptblk serve exited ({status}) before serving; its log ({}):\n{}",
                daemon.log.display(),
                daemon.log_tail()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "cryptblk serve did not create its sockets within 60 s; its log ({}):\n{}",
                daemon.log.display(),
                daemon.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Connects, retrying for a moment: the socket file appears when it is bound, just before the
/// daemon listens on it.
fn connect(socket: &Path, buffer: usize) -> Result<Disk> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match Disk::connect(socket, buffer) {
            Ok(disk) => return Ok(disk),
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("resolving {}", path.display()))
}
