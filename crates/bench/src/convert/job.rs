//! The convert benchmark's jobs: their command lines, and one timed run of a job with the
//! peak RSS the kernel reports for it when it is reaped (wait4's rusage, what `/usr/bin/time
//! %M` prints).
use anyhow::{bail, Context, Result};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Instant;

/// AES-256-XTS with a 512-bit key and plain64 IVs for both tools, with a KDF that costs
/// nothing, so that the data is what is timed.
const CRYPTBLK_LUKS: &[&str] = &[
    "--cipher",
    "aes-xts-plain64",
    "--key-size",
    "512",
    "--pbkdf",
    "pbkdf2",
    "--pbkdf-force-iterations",
    "1000",
];
const QEMU_LUKS: &str = "key-secret=s0,cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha256,iter-time=10";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    CryptblkLuks,
    QemuLuks,
    CryptblkRaw,
    QemuRaw,
    Cp,
    /// `cryptblk convert` raw -> LUKS2 by the `--cryptblk-before` binary.
    BeforeLuks,
}

impl Job {
    const ALL: [Job; 6] = [
        Job::CryptblkLuks,
        Job::QemuLuks,
        Job::CryptblkRaw,
        Job::QemuRaw,
        Job::Cp,
        Job::BeforeLuks,
    ];

    /// The job a peer of the table names.
    pub fn named(name: &str) -> Option<Job> {
        Job::ALL.into_iter().find(|j| j.name() == name)
    }

    /// The job's name in the results file.
    pub fn name(self) -> &'static str {
        match self {
            Job::CryptblkLuks => "cryptblk-luks",
            Job::QemuLuks => "qemu-luks",
            Job::CryptblkRaw => "cryptblk-raw",
            Job::QemuRaw => "qemu-raw",
            Job::Cp => "cp",
            Job::BeforeLuks => "cryptblk-before-luks",
        }
    }

    /// What the tables call it.
    pub fn label(self) -> &'static str {
        match self {
            Job::CryptblkLuks => "cryptblk convert raw -> LUKS2",
            Job::QemuLuks => "qemu-img convert -m 16 -W raw -> LUKS1",
            Job::CryptblkRaw => "cryptblk convert raw -> raw",
            Job::QemuRaw => "qemu-img convert -m 16 -W raw -> raw",
            Job::Cp => "cp",
            Job::BeforeLuks => "cryptblk convert raw -> LUKS2, --cryptblk-before",
        }
    }
}

/// What every job's command line needs.
pub struct Tools<'a> {
    pub cryptblk: &'a Path,
    pub before: Option<&'a Path>,
    pub threads: Option<usize>,
    pub key: &'a Path,
}

/// The command that copies `src` into `out` (which must not exist).
pub fn command(job: Job, t: &Tools, src: &Path, out: &Path) -> Result<Command> {
    let cryptblk = |bin: &Path, luks: bool| {
        let mut cmd = Command::new(bin);
        if let Some(n) = t.threads {
            cmd.args(["--threads", &n.to_string()]);
        }
        cmd.args(["convert", "-f", "raw", "-O"]);
        if luks {
            cmd.arg("luks2")
                .args(CRYPTBLK_LUKS)
                .arg("--key-file")
                .arg(t.key);
        } else {
            cmd.arg("raw");
        }
        cmd.arg(src).arg(out);
        cmd
    };
    let qemu = |luks: bool| {
        let mut cmd = Command::new("qemu-img");
        cmd.args(["convert", "-m", "16", "-W", "-f", "raw", "-O"]);
        if luks {
            cmd.arg("luks")
                .arg("--object")
                .arg(format!("secret,id=s0,file={}", t.key.display()))
                .args(["-o", QEMU_LUKS]);
        } else {
            cmd.arg("raw");
        }
        cmd.arg(src).arg(out);
        cmd
    };
    Ok(match job {
        Job::CryptblkLuks => cryptblk(t.cryptblk, true),
        Job::CryptblkRaw => cryptblk(t.cryptblk, false),
        Job::BeforeLuks => cryptblk(
            t.before
                .context("no --cryptblk-before binary for its job")?,
            true,
        ),
        Job::QemuLuks => qemu(true),
        Job::QemuRaw => qemu(false),
        Job::Cp => {
            let mut cmd = Command::new("cp");
            cmd.arg(src).arg(out);
            cmd
        }
    })
}

/// One run: its wall time (with the write-back of `sync`'s filesystem when given) and peak RSS.
#[derive(Debug, Clone, Copy)]
pub struct Timed {
    pub seconds: f64,
    pub peak_rss_kib: u64,
}

/// Runs the command once, timed from its start until it is reaped, and then until the
/// filesystem holding `sync` is written back: qemu-img convert leaves its target dirty in the
/// page cache (its target cache mode is `unsafe`) while cryptblk flushes it, so without the
/// write-back the two would not have done the same work. qemu-img's KDF calibration fails now
/// and then on a busy machine ("Unable to get accurate CPU usage"); such a run is retried.
pub fn run(cmd: &mut Command, sync: Option<&Path>, stderr_file: &Path) -> Result<Timed> {
    crate::command::show(cmd);
    for attempt in 1..=10 {
        let start = Instant::now();
        let (status, peak_rss_kib) = spawn_and_reap(cmd, stderr_file)?;
        if status.success() {
            if let Some(path) = sync {
                crate::procfs::sync_fs(path)?;
            }
            return Ok(Timed {
                seconds: start.elapsed().as_secs_f64(),
                peak_rss_kib,
            });
        }
        let err = std::fs::read_to_string(stderr_file).unwrap_or_default();
        if !err.contains("accurate CPU usage") || attempt == 10 {
            bail!(
                "{} failed ({status}): {}",
                cmd.get_program().to_string_lossy(),
                err.trim()
            );
        }
        eprintln!("  attempt {attempt}: {}; retrying", err.trim());
    }
    unreachable!("the last attempt returns or fails")
}

/// Starts the command with stderr into a file (a pipe nobody reads could stall it) and reaps
/// it with wait4, which gives its peak RSS.
fn spawn_and_reap(cmd: &mut Command, stderr_file: &Path) -> Result<(ExitStatus, u64)> {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(stderr_file)?)
        .spawn()
        .with_context(|| format!("starting {}", cmd.get_program().to_string_lossy()))?;
    let pid = child.id() as libc::pid_t;
    // The child is reaped here, not through `child` (dropping a Child neither waits nor kills).
    drop(child);
    let mut status = 0;
    // SAFETY: rusage is plain data, for which all zeroes is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: our own unreaped child; `status` and `usage` are writable for the call.
        let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if rc == pid {
            break;
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err).context("waiting for the job");
        }
    }
    // Linux reports ru_maxrss in KiB.
    Ok((ExitStatus::from_raw(status), usage.ru_maxrss.max(0) as u64))
}

/// Where a round's target goes, removed before and after each run.
pub fn target(dir: &Path) -> PathBuf {
    dir.join("out")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_get_the_command_lines_of_the_bash_benchmark() {
        let t = Tools {
            cryptblk: Path::new("/b/cryptblk"),
            before: None,
            threads: Some(2),
            key: Path::new("/w/key"),
        };
        let (src, out) = (Path::new("/w/src.raw"), Path::new("/w/out"));
        let line = |job| crate::command::command_line(&command(job, &t, src, out).unwrap());
        assert_eq!(
            line(Job::CryptblkLuks),
            "/b/cryptblk --threads 2 convert -f raw -O luks2 --cipher aes-xts-plain64 --key-size 512 \
             --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --key-file /w/key /w/src.raw /w/out"
        );
        assert_eq!(
            line(Job::QemuLuks),
            "qemu-img convert -m 16 -W -f raw -O luks --object secret,id=s0,file=/w/key -o \
             key-secret=s0,cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha256,iter-time=10 \
             /w/src.raw /w/out"
        );
        assert_eq!(
            line(Job::QemuRaw),
            "qemu-img convert -m 16 -W -f raw -O raw /w/src.raw /w/out"
        );
        let err = command(Job::BeforeLuks, &t, src, out).unwrap_err();
        assert!(err.to_string().contains("--cryptblk-before"), "{err}");
    }

    #[test]
    fn a_run_reports_the_peak_rss_of_what_it_ran_and_a_failure_its_stderr() {
        let dir = tempfile::tempdir().unwrap();
        let err_file = dir.path().join("stderr");
        // `head -c 64M` holds at most a buffer; `sort` of 64 MiB of text holds it all.
        let small = run(
            Command::new("sh").args(["-c", "head -c 1M /dev/zero >/dev/null"]),
            None,
            &err_file,
        )
        .unwrap();
        let big = run(
            Command::new("sh").args([
                "-c",
                "head -c 64M /dev/zero | tr '\\0' 'a' | sort >/dev/null",
            ]),
            Some(dir.path()),
            &err_file,
        )
        .unwrap();
        assert!(
            small.peak_rss_kib > 0 && small.peak_rss_kib < 32 << 10,
            "{small:?}"
        );
        assert!(big.peak_rss_kib > 64 << 10, "{big:?}");
        let err = run(
            Command::new("sh").args(["-c", "echo no such image >&2; exit 3"]),
            None,
            &err_file,
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("no such image"), "{err:#}");
    }
}
