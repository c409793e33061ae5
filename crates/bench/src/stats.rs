//! From records to figures: medians over rounds, each run's ratio to the ceiling measured next
//! to it (the mean of the ceiling runs of its group), the median and the worst of those
//! per-round ratios, and the same for chosen pairs of peers.
use crate::record::{Record, WorkloadRecord};
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

/// Per-round ratios summarised: their median, and the worst (lowest) round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ratio {
    pub median: f64,
    pub worst: f64,
    pub rounds: usize,
}

impl Ratio {
    pub fn of(per_round: &[f64]) -> Option<Ratio> {
        Some(Ratio {
            median: median(per_round)?,
            worst: per_round.iter().copied().fold(f64::INFINITY, f64::min),
            rounds: per_round.len(),
        })
    }
}

/// One peer in one row (transport x workload) of a preset.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerFigures {
    pub peer: String,
    pub name: String,
    pub iops: Option<f64>,
    pub mib_s: Option<f64>,
    pub lat_mean_us: Option<f64>,
    pub lat_p50_us: Option<f64>,
    pub lat_p99_us: Option<f64>,
    pub lat_p999_us: Option<f64>,
    pub server_cpu_pct: Option<f64>,
    pub client_cpu_pct: Option<f64>,
    pub server_cpu_us_per_io: Option<f64>,
    pub server_rss_kib: Option<f64>,
    /// IOPS over the ceiling of the same group, per round.
    pub to_ceiling: Option<Ratio>,
    /// Mean latency minus the ceiling's in the same group (the latency the server and its
    /// transport add, at depth 1), median over rounds, in µs.
    pub added_lat_us: Option<f64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub preset: String,
    pub transport: String,
    pub workload: WorkloadRecord,
    /// Median over rounds of the mean of each group's ceiling runs.
    pub ceiling_iops: Option<f64>,
    pub peers: Vec<PeerFigures>,
    /// (x, y, ratio of x's IOPS over y's in the same group, per round).
    pub pairs: Vec<(String, String, Option<Ratio>)>,
}

fn values(records: &[&Record], f: impl Fn(&Record) -> Option<f64>) -> Option<f64> {
    median(&records.iter().filter_map(|r| f(r)).collect::<Vec<_>>())
}

/// The mean of `f` over the ceiling runs of every group.
fn ceilings(records: &[Record], f: impl Fn(&Record) -> Option<f64>) -> BTreeMap<&str, f64> {
    let mut by_group: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in records.iter().filter(|r| r.ceiling) {
        if let Some(i) = f(r) {
            by_group.entry(r.group.as_str()).or_default().push(i);
        }
    }
    by_group
        .into_iter()
        .map(|(g, v)| (g, v.iter().sum::<f64>() / v.len() as f64))
        .collect()
}

/// Rows in the order they were first measured; `pairs(preset)` names the ratios to show.
pub fn summarize(records: &[Record], pairs: &dyn Fn(&str) -> Vec<(String, String)>) -> Vec<Row> {
    let ceiling_of = ceilings(records, |r| r.iops);
    let ceiling_lat = ceilings(records, |r| r.lat_mean_us);
    let mut order: Vec<(String, String, String)> = Vec::new();
    let mut rows: BTreeMap<(String, String, String), Vec<&Record>> = BTreeMap::new();
    for r in records.iter().filter(|r| !r.ceiling) {
        let key = (
            r.preset.clone(),
            r.transport.clone(),
            r.workload.name.clone(),
        );
        if !rows.contains_key(&key) {
            order.push(key.clone());
        }
        rows.entry(key).or_default().push(r);
    }
    order
        .into_iter()
        .map(|key| {
            let runs = &rows[&key];
            let groups: Vec<&str> = dedup(runs.iter().map(|r| r.group.as_str()));
            let ceiling_iops = median(
                &groups
                    .iter()
                    .filter_map(|g| ceiling_of.get(g).copied())
                    .collect::<Vec<_>>(),
            );
            let peer_ids = dedup(runs.iter().map(|r| r.peer.as_str()));
            let peers = peer_ids
                .iter()
                .map(|&p| {
                    let mine: Vec<&Record> = runs.iter().copied().filter(|r| r.peer == p).collect();
                    let per_round: Vec<f64> = mine
                        .iter()
                        .filter_map(|r| Some(r.iops? / ceiling_of.get(r.group.as_str())?))
                        .collect();
                    PeerFigures {
                        peer: p.to_string(),
                        name: mine[0].peer_name.clone(),
                        iops: values(&mine, |r| r.iops),
                        mib_s: values(&mine, |r| r.mib_s),
                        lat_mean_us: values(&mine, |r| r.lat_mean_us),
                        lat_p50_us: values(&mine, |r| r.lat_p50_us),
                        lat_p99_us: values(&mine, |r| r.lat_p99_us),
                        lat_p999_us: values(&mine, |r| r.lat_p999_us),
                        server_cpu_pct: values(&mine, |r| r.server_cpu_pct),
                        client_cpu_pct: values(&mine, |r| r.client_cpu_pct),
                        server_cpu_us_per_io: values(&mine, |r| r.server_cpu_us_per_io),
                        server_rss_kib: values(&mine, |r| r.server_rss_kib.map(|k| k as f64)),
                        to_ceiling: Ratio::of(&per_round),
                        added_lat_us: median(
                            &mine
                                .iter()
                                .filter_map(|r| {
                                    Some(r.lat_mean_us? - ceiling_lat.get(r.group.as_str())?)
                                })
                                .collect::<Vec<_>>(),
                        ),
                    }
                })
                .collect();
            let pairs = pairs(&key.0)
                .into_iter()
                .map(|(x, y)| {
                    let per_round: Vec<f64> = groups
                        .iter()
                        .filter_map(|g| {
                            let iops = |p: &str| {
                                runs.iter()
                                    .find(|r| r.group == *g && r.peer == p)
                                    .and_then(|r| r.iops)
                            };
                            let xi = iops(&x)?;
                            let yi = iops(&y).or_else(|| ceiling_of.get(g).copied())?;
                            (yi > 0.0).then(|| xi / yi)
                        })
                        .collect();
                    let r = Ratio::of(&per_round);
                    (x, y, r)
                })
                .collect();
            Row {
                preset: key.0.clone(),
                transport: key.1.clone(),
                workload: runs[0].workload.clone(),
                ceiling_iops,
                peers,
                pairs,
            }
        })
        .collect()
}

fn dedup<'a>(items: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for i in items {
        if !out.contains(&i) {
            out.push(i);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::tests::sample;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    /// Three rounds where the device drifts: the ratio is taken against the ceiling next to
    /// each run, so the drift cancels out.
    fn drifting() -> Vec<Record> {
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
    fn ratios_are_medians_of_per_round_ratios_against_the_ceiling_next_to_each_run() {
        let rows = summarize(&drifting(), &|_| vec![("a".into(), "d".into())]);
        assert_eq!(rows.len(), 1);
        let row = &rows[0];
        // Ceilings per round: 100, 40, 200 -> median 100.
        assert_eq!(row.ceiling_iops, Some(100.0));
        let a = &row.peers[0];
        assert_eq!(a.peer, "a");
        // a/f per round: 0.9, 0.9, 0.75.
        let r = a.to_ceiling.unwrap();
        assert!((r.median - 0.9).abs() < 1e-9, "{r:?}");
        assert!((r.worst - 0.75).abs() < 1e-9, "{r:?}");
        assert_eq!(r.rounds, 3);
        // Every sample has 100 µs mean latency, the ceilings too: nothing added.
        assert_eq!(a.added_lat_us, Some(0.0));
        // The median of IOPS is over raw values: 36, 90, 150.
        assert_eq!(a.iops, Some(90.0));
        // a/d per round: 90/95, 36/38, 150/190.
        let (x, y, ad) = &row.pairs[0];
        assert_eq!((x.as_str(), y.as_str()), ("a", "d"));
        let ad = ad.unwrap();
        assert!((ad.median - 90.0 / 95.0).abs() < 1e-9);
        assert!((ad.worst - 150.0 / 190.0).abs() < 1e-9);
    }

    #[test]
    fn a_pair_against_the_ceiling_uses_the_groups_ceiling() {
        let rows = summarize(&drifting(), &|_| vec![("d".into(), "f".into())]);
        let df = rows[0].pairs[0].2.unwrap();
        // d/f: 0.95, 0.95, 0.95.
        assert!((df.median - 0.95).abs() < 1e-9 && (df.worst - 0.95).abs() < 1e-9);
    }

    #[test]
    fn a_shared_ceiling_serves_both_transports() {
        let g = "r1/rr4k";
        let recs = vec![
            sample(g, "f", "file", 100.0),
            sample(g, "a", "nbd", 50.0),
            sample(g, "a", "vhost", 80.0),
            sample(g, "f", "file", 100.0),
        ];
        let rows = summarize(&recs, &|_| vec![]);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].transport, "nbd");
        assert_eq!(rows[0].peers[0].to_ceiling.unwrap().median, 0.5);
        assert_eq!(rows[1].peers[0].to_ceiling.unwrap().median, 0.8);
    }
}
