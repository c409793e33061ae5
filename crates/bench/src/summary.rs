//! The one summarizer, for every experiment: samples into rows (experiment x transport x
//! workload), each row's rounds (the groups of runs measured together, with the ceiling runs
//! around them), medians over rounds, and per-round figures (x over y measured in the same
//! round, so that a slow spell of the machine hits both) summarised as their median and the
//! worst round; the speed targets are such figures against a limit.
use crate::config::Config;
use crate::figure::{Figure, Op, Target};
use crate::metric::{self, Better, ADDED_LATENCY};
use crate::sample::{Sample, WorkloadRecord};
use serde::Serialize;
use std::collections::BTreeMap;

/// The median (the mean of the middle two for an even count); None for no values.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Per-round figures summarised: their median, and the worst round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub worst: f64,
    pub rounds: usize,
}

impl Spread {
    pub fn of(per_round: &[f64], better: Better) -> Option<Spread> {
        let finite = per_round.iter().copied().filter(|v| v.is_finite());
        let worst = match better {
            Better::Higher => finite.reduce(f64::min)?,
            Better::Lower => finite.reduce(f64::max)?,
        };
        Some(Spread {
            median: median(per_round)?,
            worst,
            rounds: per_round.len(),
        })
    }

    /// `0.90, worst 0.75`, or `n/a`.
    pub fn show(s: Option<Spread>) -> String {
        s.map_or_else(
            || "n/a".into(),
            |s| format!("{:.2}, worst {:.2}", s.median, s.worst),
        )
    }
}

/// The runs of one round of a row and the ceiling runs around them.
pub struct Round<'a> {
    pub group: &'a str,
    pub runs: Vec<&'a Sample>,
    pub ceilings: Vec<&'a Sample>,
    /// Every run of the group, over any transport (an arm reached another way, such as fio
    /// on a file beside servers, is compared with those in the same round).
    pub group_runs: Vec<&'a Sample>,
}

impl<'a> Round<'a> {
    /// The mean of `metric` over the round's ceiling runs.
    pub fn ceiling(&self, metric: &str) -> Option<f64> {
        let v: Vec<f64> = self.ceilings.iter().filter_map(|r| r.get(metric)).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }

    /// `arm`'s `metric` in this round: its run's, or, for the ceiling's peer, the ceiling's.
    pub fn value(&self, arm: &str, metric: &str) -> Option<f64> {
        let of = |runs: &[&'a Sample]| runs.iter().copied().find(|r| r.peer == arm);
        match of(&self.runs).or_else(|| of(&self.group_runs)) {
            Some(r) if metric == ADDED_LATENCY => {
                Some(r.get("lat_mean_us")? - self.ceiling("lat_mean_us")?)
            }
            Some(r) => r.get(metric),
            None if self.ceilings.iter().any(|c| c.peer == arm) => self.ceiling(metric),
            None => None,
        }
    }

    pub fn figure(&self, f: &Figure) -> Option<f64> {
        let x = self.value(&f.x, &f.metric)?;
        let Some(y) = &f.y else { return Some(x) };
        let y = self.value(y, &f.metric)?;
        match f.op {
            Op::Over => (y > 0.0).then(|| x / y),
            Op::Minus => Some(x - y),
        }
    }
}

/// The samples of one experiment, transport and workload, by round.
pub struct Row<'a> {
    /// The run of the files the row comes from (see `rows`), and whether the same row was
    /// measured in another run too.
    pub run: usize,
    pub repeated: bool,
    pub preset: &'a str,
    pub transport: &'a str,
    pub workload: &'a WorkloadRecord,
    pub rounds: Vec<Round<'a>>,
    /// The arms measured (not the ceiling), in the order first measured: (id, name).
    pub arms: Vec<(&'a str, &'a str)>,
}

impl Row<'_> {
    /// The workload as the tables name the row: with its run when there were several.
    pub fn name(&self) -> String {
        if self.repeated {
            format!("{} (run {})", self.workload.name, self.run + 1)
        } else {
            self.workload.name.clone()
        }
    }

    pub fn runs(&self) -> impl Iterator<Item = &Sample> {
        self.rounds.iter().flat_map(|r| r.runs.iter().copied())
    }

    /// The median over rounds of `arm`'s `metric` (of the ceiling, for None).
    pub fn median(&self, arm: Option<&str>, metric: &str) -> Option<f64> {
        let v: Vec<f64> = match arm {
            None => self
                .rounds
                .iter()
                .filter_map(|r| r.ceiling(metric))
                .collect(),
            Some(a) if metric == ADDED_LATENCY => self
                .rounds
                .iter()
                .filter_map(|r| r.value(a, metric))
                .collect(),
            Some(a) => self
                .runs()
                .filter(|r| r.peer == a)
                .filter_map(|r| r.get(metric))
                .collect(),
        };
        median(&v)
    }

    /// `arm`'s `metric` over the ceiling's of its round, per run, summarised.
    pub fn to_ceiling(&self, arm: &str, metric: &str) -> Option<Spread> {
        let v: Vec<f64> = self
            .rounds
            .iter()
            .flat_map(|round| {
                let ceiling = round.ceiling(metric).filter(|c| *c > 0.0);
                round
                    .runs
                    .iter()
                    .filter(|r| r.peer == arm)
                    .filter_map(move |r| Some(r.get(metric)? / ceiling?))
            })
            .collect();
        Spread::of(&v, metric::info(metric).better)
    }

    /// The figure with `@1`, `@2`, ... replaced by the row's first, second, ... arm (an
    /// experiment whose arms are chosen when it runs, such as `engine-cpu --engines`).
    pub fn resolve(&self, f: &Figure) -> Figure {
        let arm = |id: &str| match id.strip_prefix('@').and_then(|n| n.parse::<usize>().ok()) {
            Some(n) => self
                .arms
                .get(n.wrapping_sub(1))
                .map_or(id.to_string(), |a| a.0.to_string()),
            None => id.to_string(),
        };
        Figure {
            x: arm(&f.x),
            y: f.y.as_deref().map(arm),
            ..f.clone()
        }
    }

    pub fn per_round(&self, f: &Figure) -> Vec<f64> {
        let f = self.resolve(f);
        self.rounds.iter().filter_map(|r| r.figure(&f)).collect()
    }

    /// The figure summarised over rounds, in the row of the transport its x is measured over.
    pub fn spread(&self, f: &Figure) -> Option<Spread> {
        let x = self.resolve(f).x;
        if !self.arms.iter().any(|(a, _)| *a == x) {
            return None;
        }
        let better = f.better.unwrap_or(metric::info(&f.metric).better);
        Spread::of(&self.per_round(f), better)
    }
}

/// Rows in the order first measured; with `split_runs`, a second run of the same rows (the
/// same rounds again, appended or in another file) makes rows of its own, numbered from 0.
pub fn rows(samples: &[Sample], split_runs: bool) -> Vec<(usize, Row<'_>)> {
    let runs = if split_runs {
        run_numbers(samples)
    } else {
        vec![0; samples.len()]
    };
    type Key<'a> = (usize, &'a str, &'a str, &'a str);
    let mut order: Vec<Key> = Vec::new();
    let mut rows: BTreeMap<Key, Row> = BTreeMap::new();
    // A ceiling belongs to every row its group has (a shared ceiling serves two transports).
    let mut ceilings: BTreeMap<(usize, &str, &str), Vec<&Sample>> = BTreeMap::new();
    let mut groups: BTreeMap<(usize, &str, &str), Vec<&Sample>> = BTreeMap::new();
    for (s, &run) in samples.iter().zip(&runs) {
        let key = (run, s.preset.as_str(), s.group.as_str());
        if s.ceiling {
            ceilings.entry(key).or_default().push(s);
            continue;
        }
        groups.entry(key).or_default().push(s);
        let key = (
            run,
            s.preset.as_str(),
            s.transport.as_str(),
            s.workload.name.as_str(),
        );
        let row = rows.entry(key).or_insert_with(|| {
            order.push(key);
            Row {
                run,
                repeated: false,
                preset: &s.preset,
                transport: &s.transport,
                workload: &s.workload,
                rounds: Vec::new(),
                arms: Vec::new(),
            }
        });
        if !row.arms.iter().any(|(id, _)| *id == s.peer) {
            row.arms.push((&s.peer, &s.peer_name));
        }
        match row.rounds.iter_mut().find(|r| r.group == s.group) {
            Some(round) => round.runs.push(s),
            None => row.rounds.push(Round {
                group: &s.group,
                runs: vec![s],
                ceilings: Vec::new(),
                group_runs: Vec::new(),
            }),
        }
    }
    let repeated: std::collections::HashSet<(&str, &str, &str)> = order
        .iter()
        .filter(|k| k.0 > 0)
        .map(|k| (k.1, k.2, k.3))
        .collect();
    order
        .into_iter()
        .map(|key| {
            let mut row = rows.remove(&key).expect("every key has its row");
            row.repeated = repeated.contains(&(key.1, key.2, key.3));
            for round in &mut row.rounds {
                let at = (key.0, row.preset, round.group);
                round.ceilings = ceilings.get(&at).cloned().unwrap_or_default();
                round.group_runs = groups.get(&at).cloned().unwrap_or_default();
            }
            (key.0, row)
        })
        .collect()
}

/// The run each sample belongs to, counting from 0 in file order. Every run names its rounds
/// the same way (`r1/...`), so a second run starts where a peer's measurement of a round
/// over a transport comes again.
fn run_numbers(samples: &[Sample]) -> Vec<usize> {
    let mut run = 0;
    let mut seen = std::collections::HashSet::new();
    samples
        .iter()
        .map(|s| {
            let key = (&s.preset, &s.group, &s.peer, &s.transport);
            if !s.ceiling && !seen.insert(key) {
                run += 1;
                seen.clear();
                seen.insert(key);
            }
            run
        })
        .collect()
}

/// The figures a row's report shows beside the arms': the experiment's own, and every
/// baseline twin (`X`, `X-base`) among the samples.
pub fn figures(config: &Config, samples: &[Sample], preset: &str) -> Vec<Figure> {
    let mut out = config
        .presets
        .get(preset)
        .map(|p| p.ratios.clone())
        .unwrap_or_default();
    let peers: std::collections::BTreeSet<&str> = samples.iter().map(|s| s.peer.as_str()).collect();
    for twin in &peers {
        if let Some(x) = twin.strip_suffix(crate::config::BASELINE_SUFFIX) {
            if peers.contains(x) {
                out.push(Figure::pair(x, twin));
            }
        }
    }
    out
}

/// One target on one row of the samples.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// The run of the files the row comes from, from 1 (see `rows`); the table names it only
    /// for a row measured in more than one run.
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
    /// How far the judged figure is on the wrong side of the limit; `None` when met.
    pub missed_by: Option<f64>,
}

/// Every target checked on every row it applies to, in the order of the targets and then of
/// the rows.
pub fn verdicts(samples: &[Sample], targets: &[Target]) -> Vec<Verdict> {
    let mut all = rows(samples, true);
    all.sort_by(|(ra, a), (rb, b)| {
        (ra, a.preset, a.transport, &a.workload.name).cmp(&(
            rb,
            b.preset,
            b.transport,
            &b.workload.name,
        ))
    });
    let mut out = Vec::new();
    for t in targets {
        let (better, limit) = match (t.at_least, t.at_most) {
            (Some(l), None) => (Better::Higher, l),
            (None, Some(l)) => (Better::Lower, l),
            _ => continue,
        };
        for (run, row) in &all {
            let workload = row.workload.name.as_str();
            let wanted = t.presets.iter().any(|p| p == row.preset)
                && t.transport.as_deref().is_none_or(|tr| tr == row.transport)
                && t.workload
                    .as_deref()
                    .map_or(workload != "idle", |w| w == workload);
            if !wanted {
                continue;
            }
            let Some(s) = Spread::of(&row.per_round(&t.figure), better) else {
                continue;
            };
            let judged = if t.judge_worst { s.worst } else { s.median };
            let shortfall = match better {
                Better::Higher => limit - judged,
                Better::Lower => judged - limit,
            };
            let met = shortfall <= 0.0;
            out.push(Verdict {
                run: run + 1,
                target: t.what.clone(),
                preset: row.preset.into(),
                transport: row.transport.into(),
                workload: workload.into(),
                rounds: s.rounds,
                median: s.median,
                worst: s.worst,
                limit: format!(
                    "{} {limit}{}",
                    if better == Better::Higher { ">=" } else { "<=" },
                    if t.judge_worst { " (every round)" } else { "" }
                ),
                met,
                missed_by: (!met).then_some(shortfall),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::tests::sample;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn the_worst_round_depends_on_which_way_the_figure_is_good() {
        let up = Spread::of(&[3.0, 2.0, 9.0], Better::Higher).unwrap();
        assert_eq!((up.median, up.worst, up.rounds), (3.0, 2.0, 3));
        let down = Spread::of(&[3.0, 2.0, 9.0], Better::Lower).unwrap();
        assert_eq!((down.median, down.worst), (3.0, 9.0));
        assert_eq!(Spread::of(&[], Better::Higher), None);
        assert_eq!(Spread::show(Some(up)), "3.00, worst 2.00");
    }

    /// Three rounds where the device drifts: the ratio is taken against the ceiling next to
    /// each run, so the drift cancels out.
    fn drifting() -> Vec<Sample> {
        let mut v = Vec::new();
        for (round, (f1, f2, a, d)) in [
            (100.0, 100.0, 90.0, 95.0),
            (50.0, 30.0, 36.0, 38.0),
            (200.0, 200.0, 150.0, 190.0),
        ]
        .into_iter()
        .enumerate()
        {
            let g = format!("r{}/vhost/rr4k", round + 1);
            v.push(sample(&g, "f", "file", f1));
            v.push(sample(&g, "a", "vhost", a));
            v.push(sample(&g, "d", "vhost", d));
            v.push(sample(&g, "f", "file", f2));
        }
        v
    }

    #[test]
    fn ratios_are_medians_of_per_round_ratios_against_what_ran_next_to_each_run() {
        let samples = drifting();
        let all = rows(&samples, false);
        assert_eq!(all.len(), 1);
        let row = &all[0].1;
        // Ceilings per round: 100, 40, 200 -> median 100.
        assert_eq!(row.median(None, "iops"), Some(100.0));
        // a/f per round: 0.9, 0.9, 0.75.
        let r = row.to_ceiling("a", "iops").unwrap();
        assert!(
            (r.median - 0.9).abs() < 1e-9 && (r.worst - 0.75).abs() < 1e-9,
            "{r:?}"
        );
        assert_eq!(r.rounds, 3);
        // Every sample has 100 µs mean latency, the ceilings too: nothing added.
        assert_eq!(row.median(Some("a"), ADDED_LATENCY), Some(0.0));
        // The median of IOPS is over raw values: 36, 90, 150.
        assert_eq!(row.median(Some("a"), "iops"), Some(90.0));
        // @1 and @2: the row's first and second arm.
        let first = Figure {
            x: "@1".into(),
            ..Figure::pair("x", "@2")
        };
        assert_eq!(row.resolve(&first), Figure::pair("a", "d"));
        // a/d per round: 90/95, 36/38, 150/190.
        let ad = row.spread(&Figure::pair("a", "d")).unwrap();
        assert!((ad.median - 90.0 / 95.0).abs() < 1e-9);
        assert!((ad.worst - 150.0 / 190.0).abs() < 1e-9);
        // d/f: the ceiling's peer stands for the ceiling runs of each round: 0.95 each.
        let df = row.spread(&Figure::pair("d", "f")).unwrap();
        assert!((df.median - 0.95).abs() < 1e-9 && (df.worst - 0.95).abs() < 1e-9);
    }

    #[test]
    fn a_shared_ceiling_serves_both_transports() {
        let g = "r1/rr4k";
        let samples = vec![
            sample(g, "f", "file", 100.0),
            sample(g, "a", "nbd", 50.0),
            sample(g, "a", "vhost", 80.0),
            sample(g, "f", "file", 100.0),
        ];
        let all = rows(&samples, false);
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].1.transport, "nbd");
        assert_eq!(all[0].1.to_ceiling("a", "iops").unwrap().median, 0.5);
        assert_eq!(all[1].1.to_ceiling("a", "iops").unwrap().median, 0.8);
    }

    fn target(toml: &str) -> Target {
        toml::from_str(toml).unwrap()
    }

    fn in_preset(preset: &str, workload: &str, mut s: Sample) -> Sample {
        s.preset = preset.into();
        s.workload.name = workload.into();
        s
    }

    #[test]
    fn a_missed_target_says_by_how_much_with_the_worst_round() {
        // Ceph a/c: 0.96, 0.90, 0.94 over three rounds on one transport, 1.2 on the other.
        let mut samples = Vec::new();
        for (round, a) in [(1, 96.0), (2, 90.0), (3, 94.0)] {
            let g = format!("r{round}/w64k");
            for s in [
                sample(&g, "f", "file", 200.0),
                sample(&g, "a", "nbd", a),
                sample(&g, "c", "nbd", 100.0),
                sample(&g, "a", "vhost", 120.0),
                sample(&g, "c", "vhost", 100.0),
            ] {
                samples.push(in_preset("rbd", "w64k-d16", s));
            }
        }
        let t = target("what = 'a/c'\npresets = ['rbd']\nx = 'a'\ny = 'c'\nat_least = 0.95");
        let v = verdicts(&samples, &[t]);
        assert_eq!(v.len(), 2, "{v:?}");
        let nbd = v.iter().find(|v| v.transport == "nbd").unwrap();
        assert!(!nbd.met);
        assert!((nbd.missed_by.unwrap() - 0.01).abs() < 1e-9, "{nbd:?}");
        assert!((nbd.median - 0.94).abs() < 1e-9 && (nbd.worst - 0.90).abs() < 1e-9);
        assert_eq!(nbd.rounds, 3);
        assert!(v.iter().find(|v| v.transport == "vhost").unwrap().met);
    }

    #[test]
    fn lower_is_better_targets_take_the_highest_round_as_the_worst_or_judge_it() {
        // CPU per I/O (50 % CPU): a at 20k and 10k IOPS = 25 and 50 µs; b at 5k = 100 µs.
        let mut samples = Vec::new();
        for (round, a) in [(1, 20_000.0), (2, 10_000.0)] {
            let g = format!("r{round}/rr");
            for s in [
                sample(&g, "f", "file", 90_000.0),
                sample(&g, "a", "vhost", a),
                sample(&g, "b", "vhost", 5_000.0),
            ] {
                samples.push(in_preset("disk", "rr4k-d32-q1", s));
            }
        }
        let cpu = "presets = ['disk']\nx = 'a'\ny = 'b'\nmetric = 'server_cpu_us_per_io'\n";
        let median = target(&format!("what = 'm'\n{cpu}at_most = 0.4"));
        let worst = target(&format!(
            "what = 'w'\n{cpu}at_most = 0.4\njudge_worst = true"
        ));
        let minus =
            target("what = 'r'\npresets = ['disk']\nx = 'a'\ny = 'd'\nop = 'minus'\nat_most = 1");
        let v = verdicts(&samples, &[median, worst, minus]);
        // Per round 0.25 and 0.5: median 0.375 (met), worst 0.5 (missed by 0.1).
        assert_eq!(v.len(), 2, "no raw peer d: no row for a-d");
        assert!((v[0].median - 0.375).abs() < 1e-9 && (v[0].worst - 0.5).abs() < 1e-9);
        assert!(v[0].met);
        assert!(
            !v[1].met && (v[1].missed_by.unwrap() - 0.1).abs() < 1e-9,
            "{:?}",
            v[1]
        );
        assert_eq!(v[1].limit, "<= 0.4 (every round)");
    }

    #[test]
    fn two_runs_of_the_same_rows_are_checked_apart() {
        // The same preset measured twice, both runs naming their round r1: a/d 0.8, then 1.0.
        let mut samples = Vec::new();
        for a in [80.0, 100.0] {
            for s in [
                sample("r1/w", "f", "file", 120.0),
                sample("r1/w", "a", "vhost", a),
                sample("r1/w", "d", "vhost", 100.0),
                sample("r1/w", "f", "file", 120.0),
            ] {
                samples.push(in_preset("disk", "w64k-d16", s));
            }
        }
        let t = target("what = 'w'\npresets = ['disk']\nx = 'a'\ny = 'd'\nat_least = 0.9");
        let v = verdicts(&samples, &[t]);
        assert_eq!(v.len(), 2, "{v:?}");
        assert_eq!((v[0].run, v[0].median, v[0].met), (1, 0.8, false));
        assert_eq!((v[1].run, v[1].median, v[1].met), (2, 1.0, true));
    }
}
