//! The daemon as /proc shows it: VmRSS, RssAnon and Threads from /proc/PID/status, the
//! entries of /proc/PID/fd.
use super::record::Sample;
use std::collections::BTreeMap;

/// The process part of a [`Sample`]; `None` if the process is gone (between a kill and the
/// restart).
pub fn process(pid: u32) -> Option<Sample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    let mut s = parse_status(&status)?;
    s.pid = pid;
    s.fds = fds as u32;
    Some(s)
}

/// What the process's descriptors point at, by kind (`socket`, `anon_inode:[eventfd]`, a
/// file's path with digits folded to `N`), and its threads by name: what grew, when
/// something did.
pub fn inventory(pid: u32) -> (BTreeMap<String, u32>, BTreeMap<String, u32>) {
    let mut fds = BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(target) = std::fs::read_link(entry.path()) {
            *fds.entry(kind(&target.to_string_lossy())).or_insert(0) += 1;
        }
    }
    let mut threads = BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(name) = std::fs::read_to_string(entry.path().join("comm")) {
            *threads.entry(fold_digits(name.trim())).or_insert(0) += 1;
        }
    }
    (fds, threads)
}

fn kind(target: &str) -> String {
    match target.split_once(':') {
        Some((k, _)) if k == "socket" || k == "pipe" => k.to_string(),
        _ => fold_digits(target),
    }
}

fn fold_digits(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if c.is_ascii_digit() {
            if !out.ends_with('N') {
                out.push('N');
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn parse_status(text: &str) -> Option<Sample> {
    let field = |name: &str| -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    Some(Sample {
        rss_kib: field("VmRSS:")?,
        anon_kib: field("RssAnon:")?,
        threads: field("Threads:")? as u32,
        ..Sample::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_and_this_process() {
        let text = "Name:\tcryptblk\nVmRSS:\t   20480 kB\nRssAnon:\t    4300 kB\nThreads:\t6\n";
        let s = parse_status(text).unwrap();
        assert_eq!((s.rss_kib, s.anon_kib, s.threads), (20480, 4300, 6));
        // A zombie has no VmRSS: no sample rather than zeros.
        assert!(parse_status("Name:\tx\nThreads:\t1\n").is_none());
        assert_eq!(kind("socket:[12345]"), "socket");
        assert_eq!(kind("/var/tmp/soak/d17.img"), "/var/tmp/soak/dN.img");
        let (fds, threads) = inventory(std::process::id());
        assert!(fds.values().sum::<u32>() >= 3 && !threads.is_empty());
        let me = process(std::process::id()).unwrap();
        assert!(me.rss_kib > 0 && me.threads >= 1 && me.fds >= 3);
    }
}
