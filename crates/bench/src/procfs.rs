//! What the kernel tells about processes and the machine: CPU time of a process, load, memory,
//! the machine's identity; dropping the page cache.
use crate::sample::Machine;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// utime + stime of a whole process (all its threads, live and exited), in clock ticks, from
/// the text of `/proc/PID/stat` (the command name may hold spaces and parentheses: fields are
/// counted after the last ')').
pub fn stat_ticks(stat: &str) -> Result<u64> {
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("no ')' in /proc/PID/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is field 3 of the full line; utime and stime are 14 and 15.
    let num = |i: usize| -> Result<u64> {
        fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .with_context(|| format!("field {} of /proc/PID/stat", i + 3))
    };
    Ok(num(11)? + num(12)?)
}

pub fn process_ticks(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/stat");
    stat_ticks(&std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?)
}

pub fn ticks_per_second() -> f64 {
    // What sysconf(_SC_CLK_TCK) answers: the kernel's AT_CLKTCK.
    let hz = rustix::param::clock_ticks_per_second();
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

/// CPU time as a share of wall time, in percent (100 = one core).
pub fn cpu_pct(ticks: u64, seconds: f64) -> Option<f64> {
    (seconds > 0.0).then(|| ticks as f64 / ticks_per_second() / seconds * 100.0)
}

pub fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// VmRSS and VmHWM of a process, in KiB.
pub fn memory_kib(pid: u32) -> (Option<u64>, Option<u64>) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    (field("VmRSS:"), field("VmHWM:"))
}

pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    Machine {
        nproc: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        cpu_model,
        kernel,
    }
}

/// `git rev-parse HEAD` of the tree the harness runs in, `-dirty` if it has changes.
pub fn commit() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "HEAD"]) {
        Some(c) => match git(&["status", "--porcelain", "--untracked-files=no"]) {
            Some(s) if !s.is_empty() => format!("{c}-dirty"),
            _ => c,
        },
        None => "unknown".into(),
    }
}

/// The filesystem type of `dir` (`tmpfs`, `ext4`, ...), from `stat -f`.
pub fn fs_type(dir: &Path) -> Result<String> {
    let out = crate::command::quiet_output(Command::new("stat").args(["-f", "-c", "%T"]).arg(dir))?;
    Ok(out.trim().to_string())
}

/// Writes back the filesystem holding `path` (syncfs(2): not the whole machine's, which on a
/// shared host can take minutes).
pub fn sync_fs(path: &Path) -> Result<()> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    if let Err(e) = rustix::fs::syncfs(&f) {
        bail!("syncfs({}): {}", path.display(), std::io::Error::from(e));
    }
    Ok(())
}

/// Drops the page cache before a device run: `echo 3 > /proc/sys/vm/drop_caches` as root,
/// else each image's cached pages are dropped one by one (posix_fadvise DONTNEED, what
/// `dd iflag=nocache` does).
pub fn drop_caches(images: &[&Path]) -> Result<()> {
    if let Some(first) = images.first() {
        sync_fs(first)?;
    }
    if std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok() {
        return Ok(());
    }
    for image in images {
        let f =
            std::fs::File::open(image).with_context(|| format!("opening {}", image.display()))?;
        // From 0 to the end (no length).
        if let Err(e) = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed) {
            bail!(
                "posix_fadvise({}): {}",
                image.display(),
                std::io::Error::from(e)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_utime_plus_stime_even_with_a_parenthesised_name() {
        let line = "28287 (fio) S 28283 28283 24395 0 -1 4194304 2575 670 5 0 47 167 0 0 20 0 4 0";
        assert_eq!(stat_ticks(line).unwrap(), 47 + 167);
        let odd = "1 (a) b) (c) S 0 1 1 0 -1 0 0 0 0 0 10 20 0 0";
        assert_eq!(stat_ticks(odd).unwrap(), 30);
        assert!(stat_ticks("garbage").is_err());
    }

    #[test]
    fn this_process_has_a_readable_cpu_time_and_memory() {
        process_ticks(std::process::id()).unwrap();
        let (rss, hwm) = memory_kib(std::process::id());
        assert!(rss.unwrap() > 0 && hwm.unwrap() >= rss.unwrap());
    }
}
