//! The soak as one SVG: VmRSS and RssAnon, threads, and descriptors of the serving daemon
//! over time, one panel each, every event a vertical line (upgrade blue, kill red, churn
//! grey).
use super::record::{Event, Sample};
use anyhow::{anyhow, Result};
use plotters::prelude::*;

fn event_colour(kind: &str) -> RGBColor {
    match kind {
        "upgrade" => RGBColor(30, 90, 200),
        "kill" => RGBColor(210, 40, 40),
        _ => RGBColor(190, 190, 190),
    }
}

/// At most this many points per line: a long run's samples are bucketed, each bucket drawn
/// as its largest values (an upper envelope: a peak is never smoothed away).
const MAX_POINTS: usize = 400;

fn envelope(samples: &[Sample]) -> Vec<Sample> {
    let per = samples.len().div_ceil(MAX_POINTS).max(1);
    samples
        .chunks(per)
        .map(|c| Sample {
            t_s: c[0].t_s,
            rss_kib: c.iter().map(|s| s.rss_kib).max().unwrap_or(0),
            anon_kib: c.iter().map(|s| s.anon_kib).max().unwrap_or(0),
            threads: c.iter().map(|s| s.threads).max().unwrap_or(0),
            fds: c.iter().map(|s| s.fds).max().unwrap_or(0),
            ..c[0]
        })
        .collect()
}

pub fn render(title: &str, samples: &[Sample], events: &[Event]) -> Result<String> {
    let samples = &envelope(samples)[..];
    let minutes = samples.last().map_or(1.0, |s| s.t_s / 60.0).max(0.1);
    type Series<'a> = (&'a str, RGBColor, Box<dyn Fn(&Sample) -> f64>);
    let panels: [(&str, Vec<Series>); 3] = [
        (
            "memory, MiB",
            vec![
                (
                    "VmRSS",
                    RGBColor(20, 20, 20),
                    Box::new(|s: &Sample| s.rss_kib as f64 / 1024.0),
                ),
                (
                    "RssAnon",
                    RGBColor(230, 130, 0),
                    Box::new(|s: &Sample| s.anon_kib as f64 / 1024.0),
                ),
            ],
        ),
        (
            "threads",
            vec![(
                "threads",
                RGBColor(0, 140, 70),
                Box::new(|s: &Sample| s.threads as f64),
            )],
        ),
        (
            "open descriptors",
            vec![(
                "descriptors",
                RGBColor(120, 60, 160),
                Box::new(|s: &Sample| s.fds as f64),
            )],
        ),
    ];
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 900)).into_drawing_area();
        let e = |e: DrawingAreaErrorKind<_>| anyhow!("drawing the chart: {e:?}");
        root.fill(&WHITE).map_err(e)?;
        let root = root.titled(title, ("sans-serif", 18)).map_err(e)?;
        for (area, (label, series)) in root.split_evenly((3, 1)).iter().zip(panels) {
            let top = samples
                .iter()
                .flat_map(|s| series.iter().map(move |(_, _, f)| f(s)))
                .fold(1.0f64, f64::max)
                * 1.1;
            let mut chart = ChartBuilder::on(area)
                .margin(10)
                .x_label_area_size(30)
                .y_label_area_size(60)
                .build_cartesian_2d(0f64..minutes, 0f64..top)
                .map_err(e)?;
            chart
                .configure_mesh()
                .x_desc("minutes")
                .y_desc(label)
                .light_line_style(WHITE)
                .draw()
                .map_err(e)?;
            for ev in events {
                let x = ev.t_s / 60.0;
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(x, 0.0), (x, top)],
                        event_colour(&ev.kind).stroke_width(1),
                    )))
                    .map_err(e)?;
            }
            for (name, colour, f) in &series {
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        samples
                            .iter()
                            .map(|s| (s.t_s / 60.0, f(s)))
                            .collect::<Vec<_>>(),
                        colour.stroke_width(1),
                    )))
                    .map_err(e)?
                    .label(*name)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 15, y)], colour.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::LowerRight)
                .draw()
                .map_err(e)?;
        }
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_has_a_line_per_series_and_per_event() {
        let samples: Vec<Sample> = (0..120)
            .map(|t| Sample {
                t_s: t as f64,
                rss_kib: 20_000,
                anon_kib: 5_000,
                threads: 6,
                fds: 600,
                ..Sample::default()
            })
            .collect();
        let events = vec![Event {
            t_s: 60.0,
            kind: "kill".into(),
            detail: String::new(),
            took_ms: 10.0,
            pause_ms: Some(100.0),
        }];
        let svg = render("soak", &samples, &events).unwrap();
        assert!(svg.starts_with("<svg"));
        // The kill's line in each panel.
        assert_eq!(svg.matches("#D22828").count(), 3, "{svg}");
        assert!(svg.contains("RssAnon") && svg.contains("descriptors"));
        // An hour of samples: 400 points a line, the peak kept.
        let mut long: Vec<Sample> = (0..3600)
            .map(|t| Sample {
                t_s: t as f64,
                ..samples[0]
            })
            .collect();
        long[1234].anon_kib = 99_000;
        let e = envelope(&long);
        assert_eq!(e.len(), 400);
        assert_eq!(e.iter().map(|s| s.anon_kib).max(), Some(99_000));
    }
}
