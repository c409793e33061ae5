//! The speed targets of the benchmark issue, as data, checked against result files: each
//! target names the rows it applies to and a per-round figure; the verdict is the median over
//! rounds against the limit, with the worst round beside it (a median can hide a collapse).
use crate::record::Record;
use crate::stats::median;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;

/// What a target measures in one round (one group of interleaved runs).
#[derive(Debug, Clone, Copy)]
enum Figure {
    /// `x`'s IOPS over the ceiling (fio on the same file) measured next to it.
    ToCeiling(&'static str),
    /// `x`'s IOPS over `y`'s.
    Iops(&'static str, &'static str),
    /// The latency `x` adds over the ceiling at depth 1, over the latency `y` adds.
    AddedLatency(&'static str, &'static str),
    /// `x`'s server CPU per I/O over `y`'s.
    CpuPerIo(&'static str, &'static str),
    /// `x`'s server CPU per I/O minus `y`'s, in µs.
    CpuPerIoMinus(&'static str, &'static str),
    /// `x`'s I/Os per busy core over `y`'s (`y`'s CPU per I/O over `x`'s).
    IopsPerCore(&'static str, &'static str),
    /// `x`'s server CPU with an idle client, in % of a core.
    IdleCpu(&'static str),
}

/// A limit the median must reach: at least or at most `value`.
#[derive(Debug, Clone, Copy)]
enum Limit {
    AtLeast(f64),
    AtMost(f64),
}

impl Limit {
    fn met(self, v: f64) -> bool {
        match self {
            Limit::AtLeast(l) => v >= l,
            Limit::AtMost(l) => v <= l,
        }
    }

    /// The worse of two rounds' figures for this limit.
    fn worse(self, a: f64, b: f64) -> f64 {
        match self {
            Limit::AtLeast(_) => a.min(b),
            Limit::AtMost(_) => a.max(b),
        }
    }

    /// How far `v` is on the wrong side of the limit (0 when met).
    fn shortfall(self, v: f64) -> f64 {
        match self {
            Limit::AtLeast(l) => (l - v).max(0.0),
            Limit::AtMost(l) => (v - l).max(0.0),
        }
    }

    fn text(self) -> String {
        match self {
            Limit::AtLeast(l) => format!(">= {l}"),
            Limit::AtMost(l) => format!("<= {l}"),
        }
    }
}

struct Target {
    what: &'static str,
    /// The presets whose records it applies to.
    presets: &'static [&'static str],
    /// `None`: every transport the files have for the preset.
    transport: Option<&'static str>,
    /// `None`: every measured workload of the preset (idle runs aside).
    workload: Option<&'static str>,
    figure: Figure,
    limit: Limit,
}

/// Issue 24's and issue 34's targets (same machine, same run; medians of per-round
/// figures).
const TARGETS: &[Target] = &[
    Target {
        what: "saturation, 4k random reads at depth 128: LUKS2 / fio",
        presets: &["disk"],
        transport: Some("vhost"),
        workload: Some("rr4k-d128-q1"),
        figure: Figure::ToCeiling("a"),
        limit: Limit::AtLeast(0.95),
    },
    Target {
        what: "saturation, 4k random reads at depth 128, 2 queues: LUKS2 / fio",
        presets: &["disk"],
        transport: Some("vhost"),
        workload: Some("rr4k-d128-q2"),
        figure: Figure::ToCeiling("a"),
        limit: Limit::AtLeast(0.95),
    },
    Target {
        what: "latency added at depth 1: cryptblk LUKS2's over qsd LUKS1's",
        presets: &["disk", "latency"],
        transport: Some("vhost"),
        workload: Some("rr4k-d1"),
        figure: Figure::AddedLatency("a", "b"),
        limit: Limit::AtMost(0.5),
    },
    Target {
        what: "server CPU per 4k read at depth 32: cryptblk LUKS2 / qsd LUKS1",
        presets: &["disk"],
        transport: Some("vhost"),
        workload: Some("rr4k-d32-q1"),
        figure: Figure::CpuPerIo("a", "b"),
        limit: Limit::AtMost(0.5),
    },
    Target {
        what: "server CPU per 4k read at depth 32: LUKS2 minus raw (µs)",
        presets: &["disk"],
        transport: Some("vhost"),
        workload: Some("rr4k-d32-q1"),
        figure: Figure::CpuPerIoMinus("a", "d"),
        limit: Limit::AtMost(1.5),
    },
    Target {
        what: "64k writes on disk: LUKS2 / raw",
        presets: &["disk"],
        transport: None,
        workload: Some("w64k-d16"),
        figure: Figure::Iops("a", "d"),
        limit: Limit::AtLeast(0.9),
    },
    Target {
        what: "IOPS per busy core at depth 32: cryptblk LUKS2 / SPDK crypto",
        presets: &["spdk"],
        transport: Some("vhost"),
        workload: Some("rr4k-d32-q1"),
        figure: Figure::IopsPerCore("a", "e"),
        limit: Limit::AtLeast(1.0),
    },
    Target {
        what: "idle server CPU, cryptblk LUKS2 (%)",
        presets: &["spdk"],
        transport: Some("vhost"),
        workload: Some("idle"),
        figure: Figure::IdleCpu("a"),
        limit: Limit::AtMost(0.5),
    },
    Target {
        what: "tmpfs 64k reads at depth 32: LUKS2 on the vaes engine / raw",
        presets: &["engines"],
        transport: Some("vhost"),
        workload: Some("r64k-d32"),
        figure: Figure::Iops("a-vaes", "d"),
        limit: Limit::AtLeast(0.6),
    },
    Target {
        what: "server CPU per 4k read: vaes engine / openssl engine",
        presets: &["engines"],
        transport: Some("vhost"),
        workload: Some("rr4k-d32-q1"),
        figure: Figure::CpuPerIo("a-vaes", "a-openssl"),
        limit: Limit::AtMost(1.0),
    },
    Target {
        what: "server CPU per 4k write: vaes engine / openssl engine",
        presets: &["engines"],
        transport: Some("vhost"),
        workload: Some("rw4k-d32-q1"),
        figure: Figure::CpuPerIo("a-vaes", "a-openssl"),
        limit: Limit::AtMost(1.0),
    },
    Target {
        what: "disk 4k random reads at depth 128: LUKS2 on the vaes engine / raw",
        presets: &["engines-disk"],
        transport: Some("vhost"),
        workload: Some("rr4k-d128-q1"),
        figure: Figure::Iops("a-vaes", "d"),
        limit: Limit::AtLeast(0.96),
    },
    Target {
        what: "Ceph: LUKS2 / qsd raw, every workload and transport",
        presets: &["rbd"],
        transport: None,
        workload: None,
        figure: Figure::Iops("a", "c"),
        limit: Limit::AtLeast(0.95),
    },
];

/// One target on one row of the result files.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// The run of the files the row comes from, from 1: a new run starts where a round a peer
    /// was already measured in comes again (a second run of a preset, appended or in another
    /// file); the table names it only for a row measured in more than one run.
    pub run: usize,
    pub target: String,
    pub preset: String,
    pub transport: String,
    pub workload: String,
    pub rounds: usize,
    pub median: f64,
    /// The round furthest from the limit's side.
    pub worst: f64,
    pub limit: String,
    pub met: bool,
    /// How far the median is on the wrong side of the limit; `None` when met.
    pub missed_by: Option<f64>,
}

/// The records of one round of a row.
struct Round<'a>(Vec<&'a Record>);

impl Round<'_> {
    fn peer(&self, p: &str) -> Option<&Record> {
        self.0.iter().copied().find(|r| !r.ceiling && r.peer == p)
    }

    /// The mean of `f` over the ceiling runs of the round.
    fn ceiling(&self, f: impl Fn(&Record) -> Option<f64>) -> Option<f64> {
        let v: Vec<f64> = self
            .0
            .iter()
            .filter(|r| r.ceiling)
            .filter_map(|r| f(r))
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }

    fn figure(&self, figure: Figure) -> Option<f64> {
        let cpu = |p: &str| self.peer(p)?.server_cpu_us_per_io;
        let added = |p: &str| Some(self.peer(p)?.lat_mean_us? - self.ceiling(|r| r.lat_mean_us)?);
        let positive = |v: f64| (v > 0.0).then_some(v);
        match figure {
            Figure::ToCeiling(x) => {
                Some(self.peer(x)?.iops? / positive(self.ceiling(|r| r.iops)?)?)
            }
            Figure::Iops(x, y) => Some(self.peer(x)?.iops? / positive(self.peer(y)?.iops?)?),
            Figure::AddedLatency(x, y) => Some(added(x)? / positive(added(y)?)?),
            Figure::CpuPerIo(x, y) => Some(cpu(x)? / positive(cpu(y)?)?),
            Figure::CpuPerIoMinus(x, y) => Some(cpu(x)? - cpu(y)?),
            Figure::IopsPerCore(x, y) => Some(cpu(y)? / positive(cpu(x)?)?),
            Figure::IdleCpu(x) => self.peer(x)?.server_cpu_pct,
        }
    }
}

/// The run each record belongs to, counting from 0 in file order. Every run names its rounds
/// the same way (`r1/...`), so a second run of the same preset, appended to the same file or
/// given as another file, starts where a peer's measurement of a round over a transport comes
/// again.
fn runs(records: &[Record]) -> Vec<usize> {
    let mut run = 0;
    let mut seen = std::collections::HashSet::new();
    records
        .iter()
        .map(|r| {
            let key = (
                r.preset.as_str(),
                r.group.as_str(),
                r.peer.as_str(),
                r.transport.as_str(),
            );
            if !r.ceiling && !seen.insert(key) {
                run += 1;
                seen.clear();
                seen.insert(key);
            }
            run
        })
        .collect()
}

/// Every target checked on every row of `records` it applies to, in the order of `TARGETS`
/// and then of the rows.
pub fn check(records: &[Record]) -> Vec<Verdict> {
    let runs = runs(records);
    let mut out = Vec::new();
    for t in TARGETS {
        // Rows (run, preset, transport, workload) -> rounds (group) -> records, ceilings
        // included.
        type Row<'a> = (usize, &'a str, &'a str, &'a str);
        let mut rows: BTreeMap<Row, BTreeMap<&str, Vec<&Record>>> = BTreeMap::new();
        for (i, r) in records
            .iter()
            .enumerate()
            .filter(|(_, r)| t.presets.contains(&r.preset.as_str()))
        {
            let run = runs[i];
            let workload = r.workload.name.as_str();
            let wanted = match t.workload {
                Some(w) => w == workload,
                None => workload != "idle",
            };
            if !wanted {
                continue;
            }
            // A ceiling's transport is `file`: it belongs to every row of its group.
            let mut transports: Vec<&str> = if r.ceiling {
                records
                    .iter()
                    .zip(&runs)
                    .filter(|(o, &n)| {
                        n == run && !o.ceiling && o.group == r.group && o.preset == r.preset
                    })
                    .map(|(o, _)| o.transport.as_str())
                    .collect()
            } else {
                vec![r.transport.as_str()]
            };
            transports.sort_unstable();
            transports.dedup();
            for tr in transports {
                if t.transport.is_some_and(|want| want != tr) {
                    continue;
                }
                let round = rows
                    .entry((run, r.preset.as_str(), tr, workload))
                    .or_default();
                round.entry(r.group.as_str()).or_default().push(r);
            }
        }
        for ((run, preset, transport, workload), rounds) in rows {
            let per_round: Vec<f64> = rounds
                .into_values()
                .filter_map(|rs| Round(rs).figure(t.figure))
                .collect();
            let Some(m) = median(&per_round) else {
                continue;
            };
            let worst = per_round
                .iter()
                .copied()
                .reduce(|a, b| t.limit.worse(a, b))
                .unwrap_or(m);
            out.push(Verdict {
                run: run + 1,
                target: t.what.to_string(),
                preset: preset.to_string(),
                transport: transport.to_string(),
                workload: workload.to_string(),
                rounds: per_round.len(),
                median: m,
                worst,
                limit: t.limit.text(),
                met: t.limit.met(m),
                missed_by: (!t.limit.met(m)).then(|| t.limit.shortfall(m)),
            });
        }
    }
    out
}

/// The verdicts as a markdown table; a missed target says by how much.
pub fn markdown(verdicts: &[Verdict]) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::tests::sample;

    fn run(preset: &str, group: &str, peer: &str, transport: &str, iops: f64) -> Record {
        let mut r = sample(group, peer, transport, iops);
        r.preset = preset.into();
        r.ceiling = transport == "file";
        r
    }

    #[test]
    fn a_missed_target_says_by_how_much_with_the_worst_round() {
        // Ceph a/c: 0.96, 0.90, 0.94 over three rounds on one transport, 1.2 on the other.
        let mut recs = Vec::new();
        for (round, a) in [(1, 96.0), (2, 90.0), (3, 94.0)] {
            let g = format!("r{round}/w64k");
            for mut r in [
                run("rbd", &g, "f", "file", 200.0),
                run("rbd", &g, "a", "nbd", a),
                run("rbd", &g, "c", "nbd", 100.0),
                run("rbd", &g, "a", "vhost", 120.0),
                run("rbd", &g, "c", "vhost", 100.0),
            ] {
                r.workload.name = "w64k-d16".into();
                recs.push(r);
            }
        }
        let v = check(&recs);
        assert_eq!(v.len(), 2, "{v:?}");
        let nbd = v.iter().find(|v| v.transport == "nbd").unwrap();
        assert!(!nbd.met);
        assert!((nbd.missed_by.unwrap() - 0.01).abs() < 1e-9, "{nbd:?}");
        assert!((nbd.median - 0.94).abs() < 1e-9, "{nbd:?}");
        assert!((nbd.worst - 0.90).abs() < 1e-9, "{nbd:?}");
        assert_eq!(nbd.rounds, 3);
        let vhost = v.iter().find(|v| v.transport == "vhost").unwrap();
        assert!(vhost.met, "{vhost:?}");
        let md = markdown(&v);
        assert!(
            md.contains(
                "| rbd nbd w64k-d16 (3 rounds) | 0.94 (0.90) | >= 0.95 | **missed** by 0.01 |"
            ),
            "{md}"
        );
        assert!(md.contains("| 1.20 (1.20) | >= 0.95 | met |"), "{md}");
    }

    #[test]
    fn lower_is_better_targets_take_the_highest_round_as_the_worst() {
        // CPU per I/O (50 % CPU): a at 20k and 10k IOPS = 25 and 50 µs; b at 5k = 100 µs.
        let mut recs = Vec::new();
        for (round, a) in [(1, 20_000.0), (2, 10_000.0)] {
            let g = format!("r{round}/rr");
            for mut r in [
                run("disk", &g, "f", "file", 90_000.0),
                run("disk", &g, "a", "vhost", a),
                run("disk", &g, "b", "vhost", 5_000.0),
            ] {
                r.workload.name = "rr4k-d32-q1".into();
                recs.push(r);
            }
        }
        let v = check(&recs);
        let cpu = v
            .iter()
            .find(|v| v.target.contains("qsd LUKS1") && v.target.contains("CPU"))
            .unwrap();
        // Per round 0.25 and 0.5: median 0.375, worst 0.5, limit 0.5: met.
        assert!((cpu.median - 0.375).abs() < 1e-9, "{cpu:?}");
        assert!((cpu.worst - 0.5).abs() < 1e-9, "{cpu:?}");
        assert!(cpu.met);
        // No raw peer in these records: the LUKS2-minus-raw target has no row.
        assert!(!v.iter().any(|v| v.target.contains("minus raw")), "{v:?}");
    }

    #[test]
    fn two_runs_of_the_same_rows_are_checked_apart() {
        // The same preset measured twice, both runs naming their round r1: a/d 0.8, then 1.0.
        let mut recs = Vec::new();
        for a in [80.0, 100.0] {
            for mut r in [
                run("disk", "r1/w", "f", "file", 120.0),
                run("disk", "r1/w", "a", "vhost", a),
                run("disk", "r1/w", "d", "vhost", 100.0),
                run("disk", "r1/w", "f", "file", 120.0),
            ] {
                r.workload.name = "w64k-d16".into();
                recs.push(r);
            }
        }
        let v = check(&recs);
        assert_eq!(v.len(), 2, "{v:?}");
        assert_eq!((v[0].run, v[0].median, v[0].met), (1, 0.8, false));
        assert_eq!((v[1].run, v[1].median, v[1].met), (2, 1.0, true));
        let md = markdown(&v);
        assert!(md.contains("disk vhost w64k-d16 (run 2, 1 rounds)"), "{md}");
    }

    #[test]
    fn the_ceiling_of_a_round_is_the_mean_of_its_runs() {
        // fio 100 before and 80 after; a at 85: 85 / 90.
        let mut recs = Vec::new();
        for r in [
            run("disk", "r1/rr", "f", "file", 100.0),
            run("disk", "r1/rr", "a", "vhost", 85.0),
            run("disk", "r1/rr", "f", "file", 80.0),
        ] {
            let mut r = r;
            r.workload.name = "rr4k-d128-q1".into();
            recs.push(r);
        }
        let v = check(&recs);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!((v[0].median - 85.0 / 90.0).abs() < 1e-9, "{v:?}");
        assert!(!v[0].met);
    }
}
