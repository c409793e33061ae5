//! What an experiment compares: per-round figures of its arms (x over y, or x minus y, of a
//! metric, measured in the same round) and the speed targets that judge such a figure's median
//! or worst round against a limit.
use crate::metric::Better;
use serde::Deserialize;

/// How a figure of two arms is formed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Op {
    /// x's metric over y's.
    #[default]
    Over,
    /// x's metric minus y's.
    Minus,
}

/// A per-round figure: x's metric (alone, or against y's in the same round). y may be the
/// ceiling's peer, whose runs around the round stand for it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Figure {
    pub x: String,
    #[serde(default)]
    pub y: Option<String>,
    #[serde(default = "iops")]
    pub metric: String,
    #[serde(default)]
    pub op: Op,
    /// Which way the ratio is good (default: the metric's own way).
    #[serde(default)]
    pub better: Option<Better>,
}

fn iops() -> String {
    "iops".into()
}

impl Figure {
    /// x/y of IOPS, the pair form of the table (`["a", "d"]`).
    pub fn pair(x: &str, y: &str) -> Figure {
        Figure {
            x: x.into(),
            y: Some(y.into()),
            metric: iops(),
            op: Op::Over,
            better: None,
        }
    }

    pub fn label(&self) -> String {
        let metric = if self.metric == "iops" {
            String::new()
        } else {
            format!(" {}", crate::metric::info(&self.metric).label)
        };
        match (&self.y, self.op) {
            (None, _) => format!("{}{metric}", self.x),
            (Some(y), Op::Over) => format!("{}/{y}{metric}", self.x),
            (Some(y), Op::Minus) => format!("{}-{y}{metric}", self.x),
        }
    }
}

/// A figure as the table writes it: `["a", "d"]` (IOPS of a over d) or `{ x = "a", y = "d", metric = "seconds", ... }`.
#[derive(Deserialize)]
#[serde(untagged)]
enum FigureEntry {
    Pair(String, String),
    Full(Figure),
}

pub fn figures<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Figure>, D::Error> {
    Ok(Vec::<FigureEntry>::deserialize(d)?
        .into_iter()
        .map(|e| match e {
            FigureEntry::Pair(x, y) => Figure::pair(&x, &y),
            FigureEntry::Full(f) => f,
        })
        .collect())
}

/// A speed target: a figure's median over rounds on every row it names against a limit.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    pub what: String,
    /// The experiments whose samples it applies to.
    pub presets: Vec<String>,
    /// None: every transport the samples have.
    #[serde(default)]
    pub transport: Option<String>,
    /// None: every workload (idle runs aside).
    #[serde(default)]
    pub workload: Option<String>,
    #[serde(flatten)]
    pub figure: Figure,
    #[serde(default)]
    pub at_least: Option<f64>,
    #[serde(default)]
    pub at_most: Option<f64>,
    /// Judge the worst round instead of the median (a hand-off must never be slow).
    #[serde(default)]
    pub judge_worst: bool,
}
