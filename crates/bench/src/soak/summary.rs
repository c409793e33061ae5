//! What a soak's records add up to: verify and client errors, the RSS slope (least squares
//! after the warm-up, over the whole run and within each daemon process), the idle figures at
//! the end against the start, threads and descriptors per phase (between events), the pause
//! of each kind of event; and which of the stated tolerances the run broke.
use super::record::{
    Event, Pauses, Phase, Sample, SoakRecord, Summary, Tolerances, PROCESS_SETTLE_S, PROCESS_SPAN_S,
};
use std::collections::BTreeMap;

/// Least-squares slope of y over x (per unit of x); `None` under two distinct x.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

fn slope_mib_h(samples: &[&Sample], kib: impl Fn(&Sample) -> u64) -> Option<f64> {
    let points: Vec<(f64, f64)> = samples
        .iter()
        .map(|s| (s.t_s / 3600.0, kib(s) as f64 / 1024.0))
        .collect();
    slope(&points)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// The pauses per kind of event.
pub fn pauses(events: &[&Event]) -> BTreeMap<String, Pauses> {
    let mut out = BTreeMap::new();
    let kinds: std::collections::BTreeSet<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    for kind in kinds {
        let mine: Vec<&&Event> = events.iter().filter(|e| e.kind == kind).collect();
        let known: Vec<f64> = mine.iter().filter_map(|e| e.pause_ms).collect();
        out.insert(
            kind.to_string(),
            Pauses {
                count: mine.len(),
                median_ms: median(known.clone()),
                worst_ms: known.iter().copied().reduce(f64::max),
                unrecovered: mine.len() - known.len(),
            },
        );
    }
    out
}

/// The samples cut at each event.
pub fn phases(samples: &[&Sample], events: &[&Event]) -> Vec<Phase> {
    let mut bounds: Vec<(f64, String)> = vec![(f64::NEG_INFINITY, "start".into())];
    bounds.extend(events.iter().map(|e| (e.t_s, e.kind.clone())));
    let mut out = Vec::new();
    for (i, (from, after)) in bounds.iter().enumerate() {
        let to = bounds.get(i + 1).map_or(f64::INFINITY, |b| b.0);
        let mine: Vec<&&Sample> = samples
            .iter()
            .filter(|s| s.t_s >= *from && s.t_s < to)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let range = |f: &dyn Fn(&Sample) -> u32| {
            (
                mine.iter().map(|s| f(s)).min().unwrap(),
                mine.iter().map(|s| f(s)).max().unwrap(),
            )
        };
        let anon: Vec<f64> = mine.iter().map(|s| s.anon_kib as f64 / 1024.0).collect();
        out.push(Phase {
            from_s: mine.first().unwrap().t_s,
            to_s: mine.last().unwrap().t_s,
            after: after.clone(),
            threads: range(&|s| s.threads),
            fds: range(&|s| s.fds),
            anon_mib: (
                anon.iter().copied().fold(f64::INFINITY, f64::min),
                anon.iter().copied().fold(0.0, f64::max),
            ),
        });
    }
    out
}

/// The steepest RssAnon slope within one process (samples of one pid, settled, long enough).
fn worst_process_slope(samples: &[&Sample]) -> Option<f64> {
    let mut by_pid: BTreeMap<u32, Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        by_pid.entry(s.pid).or_default().push(s);
    }
    by_pid
        .values()
        .filter_map(|mine| {
            let start = mine.first()?.t_s;
            let settled: Vec<&Sample> = mine
                .iter()
                .copied()
                .filter(|s| s.t_s >= start + PROCESS_SETTLE_S)
                .collect();
            let span = settled.last()?.t_s - settled.first()?.t_s;
            if span < PROCESS_SPAN_S - PROCESS_SETTLE_S {
                return None;
            }
            slope_mib_h(&settled, |s| s.anon_kib)
        })
        .reduce(f64::max)
}

pub fn summarize(records: &[SoakRecord], warmup_s: f64, tolerances: Tolerances) -> Summary {
    let samples: Vec<&Sample> = records
        .iter()
        .filter_map(|r| match r {
            SoakRecord::Sample(s) => Some(s),
            _ => None,
        })
        .collect();
    let events: Vec<&Event> = records
        .iter()
        .filter_map(|r| match r {
            SoakRecord::Event(e) => Some(e),
            _ => None,
        })
        .collect();
    let idle = |when: &str| {
        records.iter().find_map(|r| match r {
            SoakRecord::Idle {
                when: w, sample, ..
            } if w == when => Some(*sample),
            _ => None,
        })
    };
    let failures = |kind: &str| {
        records
            .iter()
            .filter(|r| matches!(r, SoakRecord::Failure { kind: k, .. } if k == kind))
            .count() as u64
    };
    let warm: Vec<&Sample> = samples
        .iter()
        .copied()
        .filter(|s| s.t_s >= warmup_s)
        .collect();
    let mut s = Summary {
        seconds: samples.last().map_or(0.0, |s| s.t_s),
        ops: samples.iter().map(|s| s.ops).max().unwrap_or(0),
        verify_errors: failures("verify"),
        client_errors: failures("client"),
        warmup_s,
        rss_slope_mib_h: slope_mib_h(&warm, |s| s.rss_kib),
        anon_slope_mib_h: slope_mib_h(&warm, |s| s.anon_kib),
        worst_process_anon_slope_mib_h: worst_process_slope(&warm),
        idle_start: idle("start"),
        idle_end: idle("end"),
        phases: phases(&samples, &events),
        pauses: pauses(&events),
        tolerances,
        failed: Vec::new(),
    };
    s.failed = verdict(&s);
    s
}

/// The tolerances a summary breaks, in words.
fn verdict(s: &Summary) -> Vec<String> {
    let t = &s.tolerances;
    let mut failed = Vec::new();
    if s.verify_errors > 0 {
        failed.push(format!("{} verify error(s)", s.verify_errors));
    }
    if s.client_errors > 0 {
        failed.push(format!(
            "{} client error(s) (failed or stalled requests)",
            s.client_errors
        ));
    }
    for (what, slope) in [
        ("VmRSS", s.rss_slope_mib_h),
        ("RssAnon", s.anon_slope_mib_h),
    ] {
        match slope {
            Some(v) if v > t.rss_slope_mib_h => failed.push(format!(
                "{what} grew {v:.1} MiB/h over the run (tolerance {} MiB/h)",
                t.rss_slope_mib_h
            )),
            Some(_) => {}
            None => failed.push(format!(
                "no {what} slope: too few samples after the warm-up"
            )),
        }
    }
    match (s.idle_start, s.idle_end) {
        (Some(a), Some(b)) => {
            let anon = (b.anon_kib as f64 - a.anon_kib as f64) / 1024.0;
            if anon > t.idle_anon_growth_mib {
                failed.push(format!(
                    "idle RssAnon {anon:+.1} MiB at the end (tolerance {} MiB)",
                    t.idle_anon_growth_mib
                ));
            }
            let threads = b.threads as i64 - a.threads as i64;
            if threads > t.idle_thread_growth {
                failed.push(format!(
                    "idle threads {} at the end against {} at the start",
                    b.threads, a.threads
                ));
            }
            let fds = b.fds as i64 - a.fds as i64;
            if fds > t.idle_fd_growth {
                failed.push(format!(
                    "idle descriptors {} at the end against {} at the start",
                    b.fds, a.fds
                ));
            }
        }
        _ => failed.push("no idle figures at the start and the end".into()),
    }
    for (kind, p) in &s.pauses {
        if p.unrecovered > 0 {
            failed.push(format!(
                "after {} of {} {kind} event(s) some client did not work again",
                p.unrecovered, p.count
            ));
        }
    }
    failed
}

/// The summary in a few lines of markdown.
pub fn markdown(s: &Summary) -> String {
    let f = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    let mut out = format!(
        "soak: {:.0} s, {} requests verified or written, {} verify error(s), {} client error(s)\n\n",
        s.seconds, s.ops, s.verify_errors, s.client_errors
    );
    out.push_str(&format!(
        "RSS slope after {:.0} s of warm-up: VmRSS {} MiB/h, RssAnon {} MiB/h; steepest within one daemon process (>= {:.0} s): RssAnon {} MiB/h\n\n",
        s.warmup_s,
        f(s.rss_slope_mib_h),
        f(s.anon_slope_mib_h),
        PROCESS_SPAN_S,
        f(s.worst_process_anon_slope_mib_h)
    ));
    if let (Some(a), Some(b)) = (s.idle_start, s.idle_end) {
        out.push_str("| idle, no client | start | end |\n|---|---|---|\n");
        out.push_str(&format!(
            "| VmRSS MiB | {:.1} | {:.1} |\n| RssAnon MiB | {:.1} | {:.1} |\n| threads | {} | {} |\n| descriptors | {} | {} |\n\n",
            a.rss_kib as f64 / 1024.0,
            b.rss_kib as f64 / 1024.0,
            a.anon_kib as f64 / 1024.0,
            b.anon_kib as f64 / 1024.0,
            a.threads,
            b.threads,
            a.fds,
            b.fds
        ));
    }
    out.push_str(
        "| event | count | pause median ms | worst ms | unrecovered |\n|---|---|---|---|---|\n",
    );
    for (kind, p) in &s.pauses {
        out.push_str(&format!(
            "| {kind} | {} | {} | {} | {} |\n",
            p.count,
            f(p.median_ms),
            f(p.worst_ms),
            p.unrecovered
        ));
    }
    let span = |v: &dyn Fn(&Phase) -> u32| {
        (
            s.phases.iter().map(v).min().unwrap_or(0),
            s.phases.iter().map(v).max().unwrap_or(0),
        )
    };
    let (tmin, _) = span(&|p| p.threads.0);
    let (_, tmax) = span(&|p| p.threads.1);
    let (fmin, _) = span(&|p| p.fds.0);
    let (_, fmax) = span(&|p| p.fds.1);
    out.push_str(&format!(
        "\n{} phases between events: threads {tmin}-{tmax}, descriptors {fmin}-{fmax} (per phase in the summary record)\n",
        s.phases.len()
    ));
    if s.failed.is_empty() {
        out.push_str("\nPASSED: every tolerance held\n");
    } else {
        out.push_str("\nFAILED:\n");
        for f in &s.failed {
            out.push_str(&format!("- {f}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_s: f64, pid: u32, anon_mib: f64) -> Sample {
        Sample {
            t_s,
            pid,
            rss_kib: (anon_mib * 1024.0) as u64 + 10_000,
            anon_kib: (anon_mib * 1024.0) as u64,
            threads: 6,
            fds: 600,
            ..Sample::default()
        }
    }

    fn event(t_s: f64, kind: &str, pause_ms: Option<f64>) -> Event {
        Event {
            t_s,
            kind: kind.into(),
            detail: String::new(),
            took_ms: 1.0,
            pause_ms,
        }
    }

    const LOOSE: Tolerances = Tolerances {
        rss_slope_mib_h: 16.0,
        idle_anon_growth_mib: 16.0,
        idle_thread_growth: 0,
        idle_fd_growth: 0,
    };

    #[test]
    fn slope_is_least_squares() {
        assert_eq!(slope(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]), Some(2.0));
        // Noise around a flat line: zero.
        let flat = [(0.0, 10.0), (1.0, 12.0), (2.0, 12.0), (3.0, 10.0)];
        assert!(slope(&flat).unwrap().abs() < 1e-9);
        assert_eq!(slope(&[(1.0, 1.0)]), None);
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 2.0)]), None);
    }

    #[test]
    fn a_leak_fails_the_run_and_a_flat_one_passes() {
        let idle = |when: &str, anon_mib: f64, fds: u32| SoakRecord::Idle {
            when: when.into(),
            sample: Sample {
                fds,
                ..sample(0.0, 1, anon_mib)
            },
            descriptors: Default::default(),
            threads: Default::default(),
        };
        // One hour; after the warm-up, RssAnon flat around 40 MiB.
        let mut flat: Vec<SoakRecord> = vec![idle("start", 5.0, 600)];
        flat.extend((0..3600).map(|t| {
            let wobble = if t % 2 == 0 { 1.0 } else { -1.0 };
            SoakRecord::Sample(sample(t as f64, 1, 40.0 + wobble))
        }));
        flat.push(idle("end", 5.5, 600));
        let s = summarize(&flat, 60.0, LOOSE);
        assert!(s.failed.is_empty(), "{:?}", s.failed);
        assert!(s.anon_slope_mib_h.unwrap().abs() < 0.1);
        // The same run leaking 64 MiB an hour, and a descriptor at the end.
        let mut leak: Vec<SoakRecord> = vec![idle("start", 5.0, 600)];
        leak.extend(
            (0..3600).map(|t| SoakRecord::Sample(sample(t as f64, 1, 40.0 + t as f64 / 56.25))),
        );
        leak.push(idle("end", 5.5, 601));
        let s = summarize(&leak, 60.0, LOOSE);
        assert!((s.anon_slope_mib_h.unwrap() - 64.0).abs() < 0.5);
        assert!((s.worst_process_anon_slope_mib_h.unwrap() - 64.0).abs() < 0.5);
        assert_eq!(s.failed.len(), 3, "{:?}", s.failed);
        assert!(s.failed.iter().any(|f| f.contains("descriptors 601")));
    }

    #[test]
    fn pauses_and_phases_follow_the_events() {
        let events = [
            event(10.0, "upgrade", Some(900.0)),
            event(20.0, "kill", Some(1500.0)),
            event(30.0, "upgrade", Some(1100.0)),
            event(40.0, "upgrade", None),
            event(50.0, "churn", Some(5.0)),
        ];
        let refs: Vec<&Event> = events.iter().collect();
        let p = pauses(&refs);
        assert_eq!(
            p["upgrade"],
            Pauses {
                count: 3,
                median_ms: Some(1100.0),
                worst_ms: Some(1100.0),
                unrecovered: 1
            }
        );
        assert_eq!(p["kill"].worst_ms, Some(1500.0));
        let samples: Vec<Sample> = (0..60)
            .map(|t| Sample {
                threads: if t < 20 { 6 } else { 7 + t % 3 },
                ..sample(t as f64, 1, 10.0)
            })
            .collect();
        let srefs: Vec<&Sample> = samples.iter().collect();
        let ph = phases(&srefs, &refs);
        assert_eq!(ph.len(), 6);
        assert_eq!(
            (ph[0].after.as_str(), ph[0].from_s, ph[0].to_s),
            ("start", 0.0, 9.0)
        );
        assert_eq!((ph[2].after.as_str(), ph[2].threads), ("kill", (7, 9)));
        assert_eq!(ph[1].threads, (6, 6));
    }
}
