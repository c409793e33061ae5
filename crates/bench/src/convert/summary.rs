//! The convert benchmark's tables, from its records: per part, each job's median time and
//! speed and its largest peak RSS, then the per-round ratios against the targets.
use super::job::Job;
use super::ConvertRecord;
use crate::rounds::{self, Better};
use std::collections::BTreeMap;

/// The tables of every part the records hold.
pub fn render(records: &[ConvertRecord], rounds: u32) -> String {
    let mut out = String::new();
    if has(records, "disk") {
        out += &format!(
            "\n## cryptblk convert, on disk ({}, {rounds} round(s), page cache dropped before each run, \
             times include the target's write-back)\n\n",
            size_of(records, "disk")
        );
        out += &jobs_table(
            records,
            "disk",
            &[
                Job::CryptblkLuks,
                Job::QemuLuks,
                Job::CryptblkRaw,
                Job::QemuRaw,
            ],
            None,
        );
        out += "\n| ratio | median of per-round ratios | target |\n|---|---|---|\n";
        for (label, num, den, better, target) in [
            (
                "qemu-img LUKS time / cryptblk LUKS time",
                Job::QemuLuks,
                Job::CryptblkLuks,
                Better::Higher,
                ">= 3",
            ),
            (
                "cryptblk LUKS time / cryptblk raw copy time",
                Job::CryptblkLuks,
                Job::CryptblkRaw,
                Better::Lower,
                "<= 1.3",
            ),
            (
                "cryptblk LUKS time / qemu-img raw copy time",
                Job::CryptblkLuks,
                Job::QemuRaw,
                Better::Lower,
                "<= 1.3",
            ),
        ] {
            out += &format!(
                "| {label} | {} | {target} |\n",
                rounds::show(time_ratio(records, "disk", num, den, better))
            );
        }
    }
    if has(records, "cipher") {
        out += &cipher_table(records);
    }
    if has(records, "tmpfs") {
        out += &format!(
            "\n## raw -> LUKS on tmpfs ({}, {rounds} round(s), no write-back)\n\n",
            size_of(records, "tmpfs")
        );
        out += &jobs_table(
            records,
            "tmpfs",
            &[Job::Cp, Job::QemuLuks, Job::CryptblkLuks, Job::BeforeLuks],
            Some(Job::Cp),
        );
    }
    out
}

fn has(records: &[ConvertRecord], part: &str) -> bool {
    records.iter().any(|r| r.part == part)
}

fn size_of(records: &[ConvertRecord], part: &str) -> String {
    let bytes = records
        .iter()
        .find(|r| r.part == part)
        .and_then(|r| r.bytes)
        .unwrap_or(0);
    format!("{} MiB of random data", bytes >> 20)
}

/// The runs of one job: round -> value.
fn by_round(
    records: &[ConvertRecord],
    part: &str,
    job: Job,
    f: impl Fn(&ConvertRecord) -> Option<f64>,
) -> BTreeMap<u32, f64> {
    records
        .iter()
        .filter(|r| r.part == part && r.what == job.name())
        .filter_map(|r| Some((r.round, f(r)?)))
        .collect()
}

/// Time of `num` over time of `den`, per round.
fn time_ratio(
    records: &[ConvertRecord],
    part: &str,
    num: Job,
    den: Job,
    better: Better,
) -> Option<rounds::Spread> {
    let secs = |job| by_round(records, part, job, |r| r.seconds);
    rounds::ratio(&secs(num), &secs(den), better)
}

/// A row per job that ran: median s, median MiB/s, largest peak RSS; with `per` a column of
/// each job's time over that job's (lower is better: worst is the highest round).
fn jobs_table(records: &[ConvertRecord], part: &str, jobs: &[Job], per: Option<Job>) -> String {
    let mut out = String::from("| job | median s | median MiB/s | peak RSS MiB | runs |");
    let mut rule = String::from("|---|---:|---:|---:|---:|");
    if let Some(p) = per {
        out += &format!(" time / {} time |", p.label());
        rule += "---|";
    }
    out += &format!("\n{rule}\n");
    for &job in jobs {
        let secs: Vec<f64> = by_round(records, part, job, |r| r.seconds)
            .into_values()
            .collect();
        if secs.is_empty() {
            continue;
        }
        let mibs: Vec<f64> = by_round(records, part, job, |r| r.mib_s)
            .into_values()
            .collect();
        let rss = records
            .iter()
            .filter(|r| r.part == part && r.what == job.name())
            .filter_map(|r| r.peak_rss_kib)
            .max()
            .unwrap_or(0);
        out += &format!(
            "| {} | {:.2} | {:.0} | {} | {} |",
            job.label(),
            crate::stats::median(&secs).unwrap_or(f64::NAN),
            crate::stats::median(&mibs).unwrap_or(f64::NAN),
            rss / 1024,
            secs.len()
        );
        if let Some(p) = per {
            out += &if job == p {
                " 1.00 |".to_string()
            } else {
                format!(
                    " {} |",
                    rounds::show(time_ratio(records, part, job, p, Better::Lower))
                )
            };
        }
        out += "\n";
    }
    out
}

fn cipher_table(records: &[ConvertRecord]) -> String {
    let find = |what: &str| {
        records
            .iter()
            .find(|r| r.part == "cipher" && r.what == what)
    };
    let gbps = |what: &str| find(what).and_then(|r| r.gbps);
    let show = |g: Option<f64>| g.map_or("n/a".into(), |g| format!("{g:.2}"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "n/a".into(),
    };
    let engine = find("cryptblk-bench")
        .and_then(|r| r.engine.clone())
        .unwrap_or_else(|| "?".into());
    format!(
        "\n## single-thread AES-256-XTS, 4 KiB sectors\n\n\
         | measurement | GB/s |\n|---|---:|\n\
         | cryptblk bench (engine {engine}) | {} |\n\
         | system OpenSSL: openssl speed -evp aes-256-xts -bytes 4096 | {} |\n\
         | ratio cryptblk bench / openssl speed | {} |\n\
         | vendored OpenSSL, direct loop (examples/openssl_baseline) | {} |\n\
         | cryptblk engine in the same run (examples/openssl_baseline) | {} |\n\
         | ratio engine / vendored OpenSSL direct loop (target >= 0.90) | {} |\n",
        show(gbps("cryptblk-bench")),
        show(gbps("openssl-speed")),
        ratio(gbps("cryptblk-bench"), gbps("openssl-speed")),
        show(gbps("openssl-direct")),
        show(gbps("cryptblk-engine")),
        ratio(gbps("cryptblk-engine"), gbps("openssl-direct")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procfs;

    fn run(part: &str, round: u32, job: Job, seconds: f64, rss_kib: u64) -> ConvertRecord {
        ConvertRecord {
            commit: "c".into(),
            machine: procfs::machine(),
            part: part.into(),
            round,
            what: job.name().into(),
            started: 0,
            load1: 0.0,
            bytes: Some(1 << 30),
            seconds: Some(seconds),
            mib_s: Some(1024.0 / seconds),
            peak_rss_kib: Some(rss_kib),
            gbps: None,
            engine: None,
        }
    }

    fn figure(what: &str, gbps: f64) -> ConvertRecord {
        ConvertRecord {
            part: "cipher".into(),
            round: 0,
            what: what.into(),
            bytes: None,
            seconds: None,
            mib_s: None,
            peak_rss_kib: None,
            gbps: Some(gbps),
            engine: (what == "cryptblk-bench").then(|| "openssl".into()),
            ..run("cipher", 0, Job::Cp, 1.0, 0)
        }
    }

    #[test]
    fn the_disk_tables_give_medians_the_largest_rss_and_per_round_time_ratios() {
        let records = [
            run("disk", 1, Job::CryptblkLuks, 2.0, 18 << 10),
            run("disk", 1, Job::QemuLuks, 14.0, 56 << 10),
            run("disk", 1, Job::CryptblkRaw, 1.25, 12 << 10),
            run("disk", 1, Job::QemuRaw, 5.0, 39 << 10),
            run("disk", 2, Job::CryptblkLuks, 4.0, 17 << 10),
            run("disk", 2, Job::QemuLuks, 16.0, 55 << 10),
            run("disk", 2, Job::CryptblkRaw, 4.0, 12 << 10),
            run("disk", 2, Job::QemuRaw, 4.0, 40 << 10),
        ];
        let text = render(&records, 2);
        // Median of 2 s and 4 s; 1024 MiB in 2 s and in 4 s; the larger RSS.
        assert!(
            text.contains("| cryptblk convert raw -> LUKS2 | 3.00 | 384 | 18 | 2 |"),
            "{text}"
        );
        // qemu-img took 7x and 4x as long: the worst round of a speed-up is the lowest.
        assert!(
            text.contains("| qemu-img LUKS time / cryptblk LUKS time | 5.50 (worst 4.00) | >= 3 |"),
            "{text}"
        );
        // 1.6 and 1.0: the worst round of a time ratio that should stay low is the highest.
        assert!(
            text.contains("| cryptblk LUKS time / cryptblk raw copy time | 1.30 (worst 1.60) |"),
            "{text}"
        );
        assert!(!text.contains("tmpfs") && !text.contains("AES"), "{text}");
    }

    #[test]
    fn the_tmpfs_table_compares_every_job_with_cp_and_the_cipher_table_shows_both_ratios() {
        let mut records = vec![
            run("tmpfs", 1, Job::Cp, 1.0, 2048),
            run("tmpfs", 1, Job::CryptblkLuks, 0.8, 18 << 10),
            run("tmpfs", 1, Job::BeforeLuks, 20.0, 18 << 10),
        ];
        records.extend([
            figure("cryptblk-bench", 11.5),
            figure("openssl-speed", 6.7),
            figure("openssl-direct", 12.0),
            figure("cryptblk-engine", 10.8),
        ]);
        let text = render(&records, 1);
        assert!(
            text.contains("| cp | 1.00 | 1024 | 2 | 1 | 1.00 |"),
            "{text}"
        );
        assert!(
            text.contains(
                "| cryptblk convert raw -> LUKS2 | 0.80 | 1280 | 18 | 1 | 0.80 (worst 0.80) |"
            ),
            "{text}"
        );
        assert!(text.contains("--cryptblk-before | 20.00 |"), "{text}");
        assert!(!text.contains("qemu-img convert"), "{text}");
        assert!(
            text.contains("| cryptblk bench (engine openssl) | 11.50 |"),
            "{text}"
        );
        assert!(
            text.contains("| ratio cryptblk bench / openssl speed | 1.72 |"),
            "{text}"
        );
        assert!(text.contains("(target >= 0.90) | 0.90 |"), "{text}");
    }
}
