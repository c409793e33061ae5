//! The one report, for every experiment: per experiment and transport, the main metric of
//! each arm with its ratio to the ceiling, the experiment's figures (per-round ratios), every
//! metric of every arm; the targets table; and the per-row comparison of two result files.
use crate::config::Config;
use crate::metric::{self, ADDED_LATENCY};
use crate::sample::Sample;
use crate::summary::{self, median, Row, Spread, Verdict};
use std::collections::BTreeMap;
use std::fmt::Write;

fn distinct<'a>(items: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out = Vec::new();
    for i in items {
        if !out.contains(&i) {
            out.push(i);
        }
    }
    out
}

/// The metrics an experiment's tables show (the table's, else the matrix's).
fn metrics_of(config: &Config, preset: &str) -> Vec<String> {
    config
        .presets
        .get(preset)
        .map_or_else(metric::matrix, |p| p.metrics.clone())
}

/// The first of `metrics` that the row's runs carry: what its main table shows.
fn main_metric<'a>(row: &Row, metrics: &'a [String]) -> Option<&'a str> {
    metrics
        .iter()
        .map(String::as_str)
        .find(|m| *m != ADDED_LATENCY && row.runs().any(|r| r.get(m).is_some()))
}

pub fn markdown(config: &Config, samples: &[Sample]) -> String {
    let rows = summary::rows(samples, true);
    let mut out = String::new();
    for preset in distinct(rows.iter().map(|(_, r)| r.preset)) {
        let mine: Vec<&Sample> = samples.iter().filter(|r| r.preset == preset).collect();
        let first = mine[0];
        let rounds = mine.iter().map(|r| r.round).max().unwrap_or(0);
        let commits = distinct(mine.iter().map(|r| r.commit.as_str()));
        let loads: Vec<f64> = mine.iter().map(|r| r.load1).collect();
        let metrics = metrics_of(config, preset);
        let figures = summary::figures(config, samples, preset);
        let _ = writeln!(out, "## Preset `{preset}`\n");
        let _ = writeln!(
            out,
            "- Machine: {}, {} CPUs, Linux {}; storage: {}",
            first.machine.cpu_model, first.machine.nproc, first.machine.kernel, first.storage
        );
        let _ = writeln!(
            out,
            "- Commit {}; {} round(s) of {:.0} s runs; load average (1 min) before runs: median {}, max {}",
            commits.join(", "),
            rounds,
            median(&mine.iter().map(|r| r.window_s).collect::<Vec<_>>()).unwrap_or(0.0),
            metric::show("", median(&loads)),
            metric::show("", loads.iter().copied().filter(|l| l.is_finite()).reduce(f64::max))
        );
        let _ = writeln!(
            out,
            "- Figures are medians over rounds; ratios are medians of per-round ratios, each \
             against the ceiling or the arm measured next to the run, with the worst round.\n"
        );
        let mine_rows: Vec<&Row> = rows
            .iter()
            .map(|(_, r)| r)
            .filter(|r| r.preset == preset)
            .collect();
        for t in distinct(mine_rows.iter().map(|r| r.transport)) {
            let trows: Vec<&Row> = mine_rows
                .iter()
                .copied()
                .filter(|r| r.transport == t)
                .collect();
            table_main(&mut out, t, &trows, &metrics);
            table_figures(&mut out, &trows, &figures);
            table_detail(&mut out, &trows, &metrics);
        }
    }
    out
}

/// Workloads x arms: the main metric's median and its ratio to the ceiling (rows that had a
/// ceiling).
fn table_main(out: &mut String, transport: &str, rows: &[&Row], metrics: &[String]) {
    let with: Vec<(&Row, &str)> = rows
        .iter()
        .filter_map(|r| Some((*r, main_metric(r, metrics)?)))
        .filter(|(r, m)| r.median(None, m).is_some())
        .collect();
    let Some((_, main)) = with.first().copied() else {
        return;
    };
    let arms = distinct(with.iter().flat_map(|(r, _)| r.arms.iter().map(|a| a.0)));
    let names: BTreeMap<&str, &str> = with
        .iter()
        .flat_map(|(r, _)| r.arms.iter().copied())
        .collect();
    let _ = writeln!(
        out,
        "### {transport}: {}, ratio to the ceiling\n",
        metric::label(main)
    );
    let mut head = "| workload | ceiling |".to_string();
    let mut rule = "|---|---:|".to_string();
    for a in &arms {
        let _ = write!(head, " ({a}) {} |", names[a]);
        rule.push_str("---:|");
    }
    let _ = writeln!(out, "{head}\n{rule}");
    for (r, m) in with {
        let mut line = format!("| {} | {} |", r.name(), metric::show(m, r.median(None, m)));
        for a in &arms {
            let cell = if r.arms.iter().any(|(id, _)| id == a) {
                format!(
                    "{} ({})",
                    metric::show(m, r.median(Some(a), m)),
                    Spread::show(r.to_ceiling(a, m))
                )
            } else {
                "-".to_string()
            };
            let _ = write!(line, " {cell} |");
        }
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(out);
}

/// Workloads x the experiment's figures (the rows and columns that have a value).
fn table_figures(out: &mut String, rows: &[&Row], figures: &[crate::figure::Figure]) {
    let cells: Vec<Vec<Option<Spread>>> = rows
        .iter()
        .map(|r| figures.iter().map(|f| r.spread(f)).collect())
        .collect();
    let columns: Vec<usize> = (0..figures.len())
        .filter(|&i| cells.iter().any(|c| c[i].is_some()))
        .collect();
    if columns.is_empty() {
        return;
    }
    let mut head = "| workload |".to_string();
    let mut rule = "|---|".to_string();
    for &i in &columns {
        let _ = write!(head, " {} |", rows[0].resolve(&figures[i]).label());
        rule.push_str("---:|");
    }
    let _ = writeln!(out, "{head}\n{rule}");
    for (r, c) in rows.iter().zip(&cells) {
        if c.iter().all(Option::is_none) {
            continue;
        }
        let mut line = format!("| {} |", r.name());
        for &i in &columns {
            let _ = write!(line, " {} |", Spread::show(c[i]));
        }
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(out);
}

/// Workload and arm x every metric of the experiment.
fn table_detail(out: &mut String, rows: &[&Row], metrics: &[String]) {
    let shown: Vec<&str> = metrics.iter().map(String::as_str).collect();
    let mut head = "| workload | peer |".to_string();
    let mut rule = "|---|---|".to_string();
    for m in &shown {
        let _ = write!(head, " {} |", metric::label(m));
        rule.push_str("---:|");
    }
    let _ = writeln!(out, "{head}\n{rule}");
    for r in rows {
        for (a, name) in &r.arms {
            let mut line = format!("| {} | ({a}) {name} |", r.name());
            for m in &shown {
                let _ = write!(line, " {} |", metric::show(m, r.median(Some(a), m)));
            }
            let _ = writeln!(out, "{line}");
        }
    }
    let _ = writeln!(out);
}

/// The verdicts as a markdown table; a missed target says by how much.
pub fn targets(verdicts: &[Verdict]) -> String {
    let mut out = String::from(
        "| target | row | median (worst round) | limit | verdict |\n|---|---|---|---|---|\n",
    );
    let repeated = |v: &Verdict| {
        verdicts
            .iter()
            .filter(|o| {
                (&o.target, &o.preset, &o.transport, &o.workload)
                    == (&v.target, &v.preset, &v.transport, &v.workload)
            })
            .count()
            > 1
    };
    for v in verdicts {
        let run = if repeated(v) {
            format!("run {}, ", v.run)
        } else {
            String::new()
        };
        let verdict = match v.missed_by {
            None => "met".to_string(),
            // Two decimals would print a near miss as "by 0.00".
            Some(by) if by < 0.001 => "**missed** by less than 0.001".to_string(),
            Some(by) if by < 0.01 => format!("**missed** by {by:.3}"),
            Some(by) => format!("**missed** by {by:.2}"),
        };
        let _ = writeln!(
            out,
            "| {} | {} {} {} ({run}{} rounds) | {:.2} ({:.2}) | {} | {} |",
            v.target,
            v.preset,
            v.transport,
            v.workload,
            v.rounds,
            v.median,
            v.worst,
            v.limit,
            verdict
        );
    }
    if verdicts.is_empty() {
        out.push_str("| (no row of these files is one a target names) | | | | |\n");
    }
    out
}

/// A row of a comparison: (preset, transport, workload, arm) -> (main metric, server µs per
/// I/O, ratio to the ceiling).
type Index = BTreeMap<(String, String, String, String), [Option<f64>; 3]>;

fn index(config: &Config, samples: &[Sample]) -> Index {
    let mut m = Index::new();
    for (_, r) in summary::rows(samples, false) {
        let metrics = metrics_of(config, r.preset);
        let Some(main) = main_metric(&r, &metrics) else {
            continue;
        };
        let key = |a: &str| {
            (
                r.preset.to_string(),
                r.transport.to_string(),
                r.workload.name.clone(),
                a.to_string(),
            )
        };
        if let Some(c) = r.median(None, main) {
            m.insert(key("ceiling"), [Some(c), None, Some(1.0)]);
        }
        for (a, _) in &r.arms {
            m.insert(
                key(a),
                [
                    r.median(Some(a), main),
                    r.median(Some(a), "server_cpu_us_per_io"),
                    r.to_ceiling(a, main).map(|q| q.median),
                ],
            );
        }
    }
    m
}

/// New over old, row by row (preset, transport, workload, arm; the ceiling too): the main
/// metric, server µs per I/O, and the ratio to the ceiling, which cancels a machine that got
/// faster.
pub fn compare(config: &Config, old: &[Sample], new: &[Sample]) -> String {
    let (o, n) = (index(config, old), index(config, new));
    let mut out = String::from(
        "| preset | transport | workload | peer | old | new | new/old | µs/IO old | µs/IO new | new/old | to ceiling old | new |\n\
         |---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let quotient = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.3}", a / b),
        _ => "n/a".to_string(),
    };
    let show = |v: Option<f64>, d: usize| v.map_or("n/a".into(), |v| format!("{v:.d$}"));
    let mut notes = String::new();
    for (key, [ni, nc, nr]) in &n {
        let (p, t, w, a) = key;
        let Some([oi, oc, or]) = o.get(key) else {
            let _ = writeln!(notes, "\nOnly in the new results: {p} {t} {w} {a}");
            continue;
        };
        let _ = writeln!(
            out,
            "| {p} | {t} | {w} | {a} | {} | {} | {} | {} | {} | {} | {} | {} |",
            show(*oi, 0),
            show(*ni, 0),
            quotient(*ni, *oi),
            show(*oc, 2),
            show(*nc, 2),
            quotient(*nc, *oc),
            show(*or, 2),
            show(*nr, 2),
        );
    }
    for (p, t, w, a) in o.keys().filter(|k| !n.contains_key(*k)) {
        let _ = writeln!(notes, "\nOnly in the old results: {p} {t} {w} {a}");
    }
    out + &notes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::tests::sample;

    fn two_rounds(scale: f64) -> Vec<Sample> {
        let mut v = Vec::new();
        for (round, a) in [(1, 80.0), (2, 60.0)] {
            let g = format!("r{round}/vhost/rr4k");
            v.push(sample(&g, "f", "file", 100.0));
            v.push(sample(&g, "a", "vhost", a * scale));
            v.push(sample(&g, "d", "vhost", 90.0));
            v.push(sample(&g, "f", "file", 100.0));
        }
        v
    }

    #[test]
    fn the_report_shows_medians_ratios_worst_rounds_and_cpu_per_io() {
        let config = Config::load(None).unwrap();
        let md = markdown(&config, &two_rounds(1.0));
        assert!(md.contains("## Preset `demo`"), "{md}");
        assert!(md.contains("### vhost: IOPS, ratio to the ceiling"), "{md}");
        assert!(
            md.contains("| workload | ceiling | (a) peer a | (d) peer d |"),
            "{md}"
        );
        // a: 80 and 60 -> median 70, ratio 0.70, worst 0.60.
        assert!(
            md.contains("| rr4k | 100 | 70 (0.70, worst 0.60) | 90 (0.90, worst 0.90) |"),
            "{md}"
        );
        // The demo preset's own figure a/d.
        assert!(md.contains("| a/d |"), "{md}");
        assert!(md.contains("| rr4k | 0.78, worst 0.67 |"), "{md}");
        // 50 % CPU at 80 and 60 IOPS: 6,250 and 8,333 µs per I/O, median 7,292.
        assert!(md.contains("| rr4k | (a) peer a | 70 |"), "{md}");
        assert!(md.contains("| 50.0 | 7291.67 |"), "{md}");
        assert!(
            md.contains("| 100.0 | 0.0 | 90.0 | 300.0 | 900.0 |"),
            "{md}"
        );
    }

    #[test]
    fn an_experiment_without_a_ceiling_shows_its_own_metrics_and_figures() {
        let config = Config::load(None).unwrap();
        let mut samples = Vec::new();
        for (round, idle, loaded) in [(1, 20.0, 300.0), (2, 40.0, 700.0)] {
            for (arm, ms) in [("idle", idle), ("loaded", loaded)] {
                let mut s = sample(&format!("r{round}/handoff"), arm, "nbd", 0.0);
                s.preset = "handoff".into();
                s.metrics = crate::sample::Metrics::default().with("downtime_ms", Some(ms));
                samples.push(s);
            }
        }
        let md = markdown(&config, &samples);
        assert!(!md.contains("ratio to the ceiling"), "{md}");
        assert!(md.contains("| workload | peer | downtime ms |"), "{md}");
        assert!(
            md.contains("| handoff | (loaded) peer loaded | 500.0 |"),
            "{md}"
        );
        let v = summary::verdicts(&samples, &config.targets);
        let loaded = v.iter().find(|v| v.target.contains("loaded")).unwrap();
        // The median 500 would pass; the worst hand-off (700 ms) does not.
        assert!(!loaded.met, "{loaded:?}");
        let table = targets(&v);
        assert!(
            table.contains("| 500.00 (700.00) | <= 500 (every round) | **missed** by 200.00 |"),
            "{table}"
        );
    }

    #[test]
    fn compare_prints_new_over_old_per_row() {
        let config = Config::load(None).unwrap();
        let table = compare(&config, &two_rounds(1.0), &two_rounds(1.1));
        // a: 70 -> 77 IOPS: 1.100; d unchanged.
        assert!(
            table.contains("| demo | vhost | rr4k | a | 70 | 77 | 1.100 |"),
            "{table}"
        );
        assert!(
            table.contains("| demo | vhost | rr4k | d | 90 | 90 | 1.000 |"),
            "{table}"
        );
        assert!(
            table.contains("| demo | vhost | rr4k | ceiling | 100 | 100 | 1.000 |"),
            "{table}"
        );
        assert!(!table.contains("Only in"), "{table}");
    }
}

#[cfg(test)]
mod committed {
    use super::*;
    use std::path::{Path, PathBuf};

    fn results_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/results")
    }

    /// The results files of the engine kept in the repository, by name.
    fn committed_files() -> Vec<PathBuf> {
        let mut files: Vec<_> = std::fs::read_dir(results_dir())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
            .collect();
        files.sort();
        files
    }

    /// Every results file kept in the repository, whichever harness wrote it, reads as
    /// samples that the report renders and the targets check.
    #[test]
    fn every_committed_results_file_is_read_reported_and_checked() {
        let config = Config::load(None).unwrap();
        let files = committed_files();
        assert!(files.len() >= 17, "{files:?}");
        let mut all = Vec::new();
        for f in &files {
            let samples = crate::sample::load(f).unwrap();
            let lines = std::fs::read_to_string(f).unwrap().lines().count();
            assert_eq!(samples.len(), lines, "{}", f.display());
            let md = markdown(&config, &samples);
            for s in &samples {
                assert!(
                    md.contains(&format!("## Preset `{}`", s.preset)),
                    "{}",
                    f.display()
                );
            }
            assert!(md.contains("| workload | peer |"), "{}: {md}", f.display());
            all.extend(samples);
        }
        let v = summary::verdicts(&all, &config.targets);
        for preset in [
            "disk",
            "latency",
            "rbd",
            "spdk",
            "engines",
            "engines-disk",
            "reencrypt",
            "encrypt-online",
        ] {
            assert!(
                v.iter().any(|v| v.preset == preset),
                "no verdict for {preset}"
            );
        }
        // The reencryption records of 2026-11-26 (written before the engine): three runs,
        // cryptsetup's time over cryptblk's as docs/performance.md quotes them.
        let offline: Vec<String> = v
            .iter()
            .filter(|v| v.preset == "reencrypt" && v.target.contains("cryptsetup"))
            .map(|v| format!("{:.2} ({:.2})", v.median, v.worst))
            .collect();
        assert_eq!(offline, ["0.59 (0.58)", "0.95 (0.76)", "1.72 (1.63)"]);
    }

    /// What `report FILE`, `report --targets FILE` and `report --compare` print for every
    /// committed results file is what they printed when the file was saved: a change to the
    /// harness cannot silently change a published figure. After a change meant to alter the
    /// report, write it again with `CRYPTBLK_BENCH_BLESS=1 cargo test -p cryptblk-bench
    /// committed` and review its diff.
    #[test]
    fn the_report_of_every_committed_results_file_is_unchanged() {
        let config = Config::load(None).unwrap();
        let results = results_dir();
        let files = committed_files();
        let mut out = String::new();
        let mut previous: Option<Vec<Sample>> = None;
        for f in &files {
            let samples = crate::sample::load(f).unwrap();
            let name = f.strip_prefix(&results).unwrap().display();
            out += &format!("# report {name}\n{}", markdown(&config, &samples));
            let verdicts = summary::verdicts(&samples, &config.targets);
            out += &format!("# report --targets {name}\n{}", targets(&verdicts));
            if let Some(old) = &previous {
                out += &format!("# report --compare (the file before) {name}\n");
                out += &compare(&config, old, &samples);
            }
            previous = Some(samples);
        }
        let golden = results.join("report-golden.md");
        if std::env::var_os("CRYPTBLK_BENCH_BLESS").is_some() {
            std::fs::write(&golden, &out).unwrap();
        }
        let saved = std::fs::read_to_string(&golden).unwrap();
        if saved != out {
            let line = saved
                .lines()
                .zip(out.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(saved.lines().count().min(out.lines().count()));
            panic!(
                "the report of the committed records differs from bench/results/report-golden.md \
                 from line {}: {:?} now, {:?} saved",
                line + 1,
                out.lines().nth(line),
                saved.lines().nth(line)
            );
        }
    }
}
