//! Markdown tables rendered from the records, and the per-row comparison of two result files.
use crate::record::Record;
use crate::stats::{median, Ratio, Row};
use std::collections::BTreeMap;
use std::fmt::Write;

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "n/a".to_string(), |x| format!("{x:.digits$}"))
}

fn ratio(r: Option<Ratio>) -> String {
    r.map_or_else(
        || "n/a".to_string(),
        |r| format!("{:.2}, worst {:.2}", r.median, r.worst),
    )
}

/// Tables per preset and transport: IOPS with each peer's ratio to the ceiling, the chosen
/// pairs' ratios, then latency and CPU per peer.
pub fn markdown(records: &[Record], rows: &[Row]) -> String {
    let mut out = String::new();
    let mut presets: Vec<&str> = Vec::new();
    for r in rows {
        if !presets.contains(&r.preset.as_str()) {
            presets.push(&r.preset);
        }
    }
    for preset in presets {
        let mine: Vec<&Record> = records.iter().filter(|r| r.preset == preset).collect();
        let first = mine[0];
        let rounds = mine.iter().map(|r| r.round).max().unwrap_or(0);
        let commits = distinct(mine.iter().map(|r| r.commit.as_str()));
        let loads: Vec<f64> = mine.iter().map(|r| r.load1).collect();
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
            opt(median(&loads), 2),
            opt(loads.iter().copied().reduce(f64::max), 2)
        );
        let _ = writeln!(
            out,
            "- IOPS are medians over rounds; ratios are medians of per-round ratios, each against \
             the ceiling (fio on the image) measured next to the run, with the worst round.\n"
        );
        let transports = distinct(
            rows.iter()
                .filter(|r| r.preset == preset)
                .map(|r| r.transport.as_str()),
        );
        for t in transports {
            let trows: Vec<&Row> = rows
                .iter()
                .filter(|r| r.preset == preset && r.transport == t)
                .collect();
            table_iops(&mut out, t, &trows);
            table_pairs(&mut out, &trows);
            table_detail(&mut out, &trows);
        }
    }
    out
}

fn distinct<'a>(items: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out = Vec::new();
    for i in items {
        if !out.contains(&i) {
            out.push(i);
        }
    }
    out
}

fn table_iops(out: &mut String, transport: &str, rows: &[&Row]) {
    let io: Vec<&&Row> = rows.iter().filter(|r| r.ceiling_iops.is_some()).collect();
    if io.is_empty() {
        return;
    }
    let peers = distinct(
        io.iter()
            .flat_map(|r| r.peers.iter().map(|p| p.peer.as_str())),
    );
    let names: BTreeMap<&str, &str> = io
        .iter()
        .flat_map(|r| r.peers.iter().map(|p| (p.peer.as_str(), p.name.as_str())))
        .collect();
    let _ = writeln!(out, "### {transport}: IOPS, ratio to the ceiling\n");
    let mut head = "| workload | ceiling |".to_string();
    let mut rule = "|---|---:|".to_string();
    for p in &peers {
        let _ = write!(head, " ({p}) {} |", names[p]);
        rule.push_str("---:|");
    }
    let _ = writeln!(out, "{head}\n{rule}");
    for r in io {
        let mut line = format!("| {} | {} |", r.workload.name, opt(r.ceiling_iops, 0));
        for p in &peers {
            let cell = r.peers.iter().find(|f| f.peer == *p).map_or_else(
                || "-".to_string(),
                |f| format!("{} ({})", opt(f.iops, 0), ratio(f.to_ceiling)),
            );
            let _ = write!(line, " {cell} |");
        }
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(out);
}

fn table_pairs(out: &mut String, rows: &[&Row]) {
    let Some(first) = rows.iter().find(|r| !r.pairs.is_empty()) else {
        return;
    };
    let mut head = "| workload |".to_string();
    let mut rule = "|---|".to_string();
    for (x, y, _) in &first.pairs {
        let _ = write!(head, " {x}/{y} |");
        rule.push_str("---:|");
    }
    let _ = writeln!(out, "{head}\n{rule}");
    for r in rows.iter().filter(|r| r.ceiling_iops.is_some()) {
        let mut line = format!("| {} |", r.workload.name);
        for (_, _, q) in &r.pairs {
            let _ = write!(line, " {} |", ratio(*q));
        }
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(out);
}

fn table_detail(out: &mut String, rows: &[&Row]) {
    let _ = writeln!(
        out,
        "| workload | peer | IOPS | MiB/s | lat mean µs | added to ceiling's | p50 | p99 | p99.9 | server CPU % | server µs/IO | client CPU % | server RSS MiB |"
    );
    let _ = writeln!(
        out,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows {
        for p in &r.peers {
            let _ = writeln!(
                out,
                "| {} | ({}) {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.workload.name,
                p.peer,
                p.name,
                opt(p.iops, 0),
                opt(p.mib_s, 1),
                opt(p.lat_mean_us, 1),
                opt(p.added_lat_us, 1),
                opt(p.lat_p50_us, 1),
                opt(p.lat_p99_us, 1),
                opt(p.lat_p999_us, 1),
                opt(p.server_cpu_pct, 1),
                opt(p.server_cpu_us_per_io, 2),
                opt(p.client_cpu_pct, 1),
                opt(p.server_rss_kib.map(|k| k / 1024.0), 0),
            );
        }
    }
    let _ = writeln!(out);
}

/// A row of a comparison: (preset, transport, workload, peer).
type RowKey = (String, String, String, String);
/// Median IOPS, server µs per I/O, ratio to the ceiling.
type RowFigures = (Option<f64>, Option<f64>, Option<f64>);

fn index(rows: &[Row]) -> BTreeMap<RowKey, RowFigures> {
    let mut m = BTreeMap::new();
    for r in rows {
        let key = |p: &str| {
            (
                r.preset.clone(),
                r.transport.clone(),
                r.workload.name.clone(),
                p.to_string(),
            )
        };
        if r.ceiling_iops.is_some() {
            m.insert(key("ceiling"), (r.ceiling_iops, None, Some(1.0)));
        }
        for p in &r.peers {
            m.insert(
                key(&p.peer),
                (
                    p.iops,
                    p.server_cpu_us_per_io,
                    p.to_ceiling.map(|q| q.median),
                ),
            );
        }
    }
    m
}

/// New over old, row by row (preset, transport, workload, peer; the ceiling too): median IOPS,
/// server µs per I/O, and the ratio to the ceiling, which cancels a machine that got faster.
pub fn compare(old: &[Row], new: &[Row]) -> String {
    type Key<'a> = (&'a str, &'a str, &'a str, &'a str);
    let (o, n) = (index(old), index(new));
    let mut out = String::from(
        "| preset | transport | workload | peer | IOPS old | IOPS new | new/old | µs/IO old | µs/IO new | new/old | to ceiling old | new |\n\
         |---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let quotient = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.3}", a / b),
        _ => "n/a".to_string(),
    };
    let mut unmatched: Vec<Key> = Vec::new();
    for (key, (ni, nc, nr)) in &n {
        let Some((oi, oc, or)) = o.get(key) else {
            unmatched.push((&key.0, &key.1, &key.2, &key.3));
            continue;
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            key.0,
            key.1,
            key.2,
            key.3,
            opt(*oi, 0),
            opt(*ni, 0),
            quotient(*ni, *oi),
            opt(*oc, 2),
            opt(*nc, 2),
            quotient(*nc, *oc),
            opt(*or, 2),
            opt(*nr, 2),
        );
    }
    for (p, t, w, peer) in unmatched {
        let _ = writeln!(out, "\nOnly in the new results: {p} {t} {w} {peer}");
    }
    for key in o.keys().filter(|k| !n.contains_key(*k)) {
        let _ = writeln!(
            out,
            "\nOnly in the old results: {} {} {} {}",
            key.0, key.1, key.2, key.3
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::tests::sample;
    use crate::stats::summarize;

    fn two_rounds(scale: f64) -> Vec<Record> {
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
        let recs = two_rounds(1.0);
        let rows = summarize(&recs, &|_| vec![("a".into(), "d".into())]);
        let md = markdown(&recs, &rows);
        assert!(md.contains("## Preset `demo`"), "{md}");
        assert!(
            md.contains("| workload | ceiling | (a) peer a | (d) peer d |"),
            "{md}"
        );
        // a: 80 and 60 -> median 70, ratio 0.70, worst 0.60.
        assert!(
            md.contains("| rr4k | 100 | 70 (0.70, worst 0.60) | 90 (0.90, worst 0.90) |"),
            "{md}"
        );
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
    fn compare_prints_new_over_old_per_row() {
        let old = two_rounds(1.0);
        let new = two_rounds(1.1);
        let pairs = |_: &str| vec![];
        let table = compare(&summarize(&old, &pairs), &summarize(&new, &pairs));
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
