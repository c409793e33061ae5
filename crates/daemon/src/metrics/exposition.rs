//! The Prometheus text exposition format, version 0.0.4: a `# HELP` and `# TYPE` line per
//! family, then its samples, `name{label="value",...} value`, with label values and help text
//! escaped as the format requires.
use cryptblk_block::{BucketCounts, LATENCY_BOUNDS_NS};
use std::fmt::Write;

/// The `Content-Type` of a response in this format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
    Summary,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
            Kind::Summary => "summary",
        }
    }
}

/// A sample's value: counts stay exact integers, measurements are floats.
#[derive(Clone, Copy, Debug)]
pub enum Value {
    Int(u64),
    Float(f64),
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(v)
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Float(v)
    }
}

/// Label names and values of one series.
pub type Labels<'a> = [(&'a str, &'a str)];

/// The text being written. Every family is written whole (`family`, then its samples)
/// before the next begins, as the format requires.
#[derive(Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {name} {}", kind.name());
    }

    pub fn sample(&mut self, name: &str, labels: &Labels<'_>, value: impl Into<Value>) {
        self.series(name, labels, None);
        self.value(value.into());
    }

    /// A histogram's `_bucket` series (cumulative, ending with `le="+Inf"`), `_sum` in
    /// seconds and `_count`.
    pub fn histogram(&mut self, name: &str, labels: &Labels<'_>, buckets: &BucketCounts) {
        let bucket = format!("{name}_bucket");
        let cumulative = buckets.cumulative();
        for (i, count) in cumulative.iter().enumerate() {
            let le = LATENCY_BOUNDS_NS
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |&ns| seconds_text(ns));
            self.series(&bucket, labels, Some(("le", &le)));
            self.value(Value::Int(*count));
        }
        self.sample(&format!("{name}_sum"), labels, buckets.sum_ns as f64 / 1e9);
        self.sample(
            &format!("{name}_count"),
            labels,
            cumulative[cumulative.len() - 1],
        );
    }

    pub fn finish(self) -> String {
        self.out
    }

    fn series(&mut self, name: &str, labels: &Labels<'_>, extra: Option<(&str, &str)>) {
        self.out.push_str(name);
        let mut all = labels.iter().copied().chain(extra).peekable();
        if all.peek().is_some() {
            self.out.push('{');
            for (i, (label, value)) in all.enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{label}=\"{}\"", escape_label(value));
            }
            self.out.push('}');
        }
    }

    fn value(&mut self, value: Value) {
        let _ = match value {
            Value::Int(v) => writeln!(self.out, " {v}"),
            Value::Float(v) if v.is_nan() => writeln!(self.out, " NaN"),
            Value::Float(v) if v.is_infinite() => {
                writeln!(self.out, " {}Inf", if v > 0.0 { '+' } else { '-' })
            }
            Value::Float(v) => writeln!(self.out, " {v}"),
        };
    }
}

/// A bucket bound in seconds, written exactly (`0.00001`, `2.5`, `10`).
fn seconds_text(ns: u64) -> String {
    let whole = ns / 1_000_000_000;
    let frac = ns % 1_000_000_000;
    if frac == 0 {
        return whole.to_string();
    }
    let digits = format!("{frac:09}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// Label values: backslash, double quote and line feed are escaped.
fn escape_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Help text: backslash and line feed are escaped.
fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use cryptblk_block::LATENCY_BUCKETS;

    #[test]
    fn families_samples_and_escaping() {
        let mut e = Exposition::default();
        e.family("x_total", Kind::Counter, "a \\ b\nc");
        e.sample("x_total", &[("disk", "a\"b\\c\nd")], 3u64);
        e.sample("x_total", &[], 0.5);
        e.family("g", Kind::Gauge, "g");
        e.sample("g", &[("a", "1"), ("b", "")], f64::INFINITY);
        e.sample("g", &[], f64::NAN);
        let text = e.finish();
        assert_eq!(
            text,
            "# HELP x_total a \\\\ b\\nc\n# TYPE x_total counter\n\
             x_total{disk=\"a\\\"b\\\\c\\nd\"} 3\nx_total 0.5\n\
             # HELP g g\n# TYPE g gauge\ng{a=\"1\",b=\"\"} +Inf\ng NaN\n"
        );
    }

    #[test]
    fn histograms_are_cumulative_with_exact_bounds() {
        let mut b = BucketCounts::default();
        b.counts[0] = 2;
        b.counts[3] = 1;
        b.counts[LATENCY_BUCKETS - 1] = 4;
        b.sum_ns = 1_500_000_000;
        let mut e = Exposition::default();
        e.family("h_seconds", Kind::Histogram, "h");
        e.histogram("h_seconds", &[("op", "read")], &b);
        let text = e.finish();
        assert!(
            text.contains("h_seconds_bucket{op=\"read\",le=\"0.00001\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("h_seconds_bucket{op=\"read\",le=\"0.0001\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("h_seconds_bucket{op=\"read\",le=\"10\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("h_seconds_bucket{op=\"read\",le=\"+Inf\"} 7\n"),
            "{text}"
        );
        assert!(text.contains("h_seconds_sum{op=\"read\"} 1.5\n"), "{text}");
        assert!(text.contains("h_seconds_count{op=\"read\"} 7\n"), "{text}");
        assert_eq!(text.matches("_bucket").count(), LATENCY_BUCKETS);
    }

    #[test]
    fn bounds_in_seconds() {
        assert_eq!(seconds_text(10_000), "0.00001");
        assert_eq!(seconds_text(2_500_000), "0.0025");
        assert_eq!(seconds_text(2_500_000_000), "2.5");
        assert_eq!(seconds_text(10_000_000_000), "10");
    }
}
