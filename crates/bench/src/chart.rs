//! Charts as SVG (plotters, SVG backend only): per preset and transport, a grouped bar chart of
//! IOPS per workload and peer (the ceiling first), one of server CPU per I/O, and the latency
//! distribution: one chart each of the p50, p99 and p99.9 latency per workload and peer.
use crate::summary::Row;
use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// What a chart shows of each peer in a row.
#[derive(Clone, Copy)]
enum Figure {
    Iops,
    CpuPerIo,
    LatP50,
    LatP99,
    LatP999,
}

impl Figure {
    const ALL: [Figure; 5] = [
        Figure::Iops,
        Figure::CpuPerIo,
        Figure::LatP50,
        Figure::LatP99,
        Figure::LatP999,
    ];
}

impl Figure {
    fn label(self) -> &'static str {
        match self {
            Figure::Iops => "IOPS (median over rounds)",
            Figure::CpuPerIo => "server CPU per I/O, µs",
            Figure::LatP50 => "latency p50, µs (median over rounds)",
            Figure::LatP99 => "latency p99, µs (median over rounds)",
            Figure::LatP999 => "latency p99.9, µs (median over rounds)",
        }
    }
    fn metric(self) -> &'static str {
        match self {
            Figure::Iops => "iops",
            Figure::CpuPerIo => "server_cpu_us_per_io",
            Figure::LatP50 => "lat_p50_us",
            Figure::LatP99 => "lat_p99_us",
            Figure::LatP999 => "lat_p999_us",
        }
    }
    fn file(self) -> &'static str {
        match self {
            Figure::Iops => "iops",
            Figure::CpuPerIo => "cpu-per-io",
            Figure::LatP50 => "lat-p50",
            Figure::LatP99 => "lat-p99",
            Figure::LatP999 => "lat-p999",
        }
    }
}

/// One bar series: a name and its value per workload.
struct Series {
    name: String,
    values: Vec<Option<f64>>,
}

fn series(rows: &[&Row], figure: Figure) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    if matches!(figure, Figure::Iops) {
        out.push(Series {
            name: "ceiling (fio on the image)".into(),
            values: rows.iter().map(|r| r.median(None, "iops")).collect(),
        });
    }
    let mut peers: Vec<(&str, &str)> = Vec::new();
    for r in rows {
        for &(id, name) in &r.arms {
            if !peers.iter().any(|(p, _)| *p == id) {
                peers.push((id, name));
            }
        }
    }
    for (id, name) in peers {
        out.push(Series {
            name: format!("({id}) {name}"),
            values: rows
                .iter()
                .map(|r| r.median(Some(id), figure.metric()))
                .collect(),
        });
    }
    out
}

/// Writes the charts of every preset and transport into `dir`; returns the files written.
pub fn write_all(rows: &[&Row], dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for r in rows {
        if !keys.contains(&(r.preset, r.transport)) {
            keys.push((r.preset, r.transport));
        }
    }
    let mut written = Vec::new();
    for (preset, transport) in keys {
        let mine: Vec<&Row> = rows
            .iter()
            .copied()
            .filter(|r| {
                r.preset == preset && r.transport == transport && r.median(None, "iops").is_some()
            })
            .collect();
        if mine.is_empty() {
            continue;
        }
        for figure in Figure::ALL {
            let path = dir.join(format!("{preset}-{transport}-{}.svg", figure.file()));
            let svg = render(&format!("{preset}, {transport}"), &mine, figure)?;
            std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
            written.push(path);
        }
    }
    Ok(written)
}

fn render(title: &str, rows: &[&Row], figure: Figure) -> Result<String> {
    let all = series(rows, figure);
    let top = all
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .copied()
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.1;
    let n = rows.len();
    let width = (160 * n as u32).max(640);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, 480)).into_drawing_area();
        let e = |e: DrawingAreaErrorKind<_>| anyhow!("drawing the chart: {e:?}");
        root.fill(&WHITE).map_err(e)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(30)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..n as f64, 0f64..top)
            .map_err(e)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_desc(figure.label())
            .draw()
            .map_err(e)?;
        let slots = all.len() as f64;
        for (k, s) in all.iter().enumerate() {
            let color = Palette99::pick(k).to_rgba();
            let bars = s.values.iter().enumerate().filter_map(move |(i, v)| {
                let x0 = i as f64 + 0.1 + 0.8 * k as f64 / slots;
                let x1 = x0 + 0.8 / slots;
                v.map(|v| Rectangle::new([(x0, 0.0), (x1, v)], color.filled()))
            });
            chart
                .draw_series(bars)
                .map_err(e)?
                .label(s.name.clone())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(e)?;
        // Workload names under their group of bars.
        for (i, r) in rows.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
            let style = ("sans-serif", 13).into_font().color(&BLACK).pos(
                plotters::style::text_anchor::Pos::new(
                    plotters::style::text_anchor::HPos::Center,
                    plotters::style::text_anchor::VPos::Top,
                ),
            );
            root.draw(&Text::new(r.workload.name.clone(), (x, y + 6), style))
                .map_err(e)?;
        }
        root.present().map_err(e)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::tests::sample;

    #[test]
    fn charts_are_svg_files_naming_every_peer_and_workload() {
        let g = "r1/vhost/rr4k-d32-q1";
        let recs = vec![
            sample(g, "f", "file", 100.0),
            sample(g, "a", "vhost", 80.0),
            sample(g, "d", "vhost", 90.0),
            sample(g, "f", "file", 100.0),
        ];
        let rows = crate::summary::rows(&recs, false);
        let rows: Vec<&Row> = rows.iter().map(|(_, r)| r).collect();
        let dir = tempfile::tempdir().unwrap();
        let files = write_all(&rows, dir.path()).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "demo-vhost-iops.svg",
                "demo-vhost-cpu-per-io.svg",
                "demo-vhost-lat-p50.svg",
                "demo-vhost-lat-p99.svg",
                "demo-vhost-lat-p999.svg",
            ]
        );
        let svg = std::fs::read_to_string(&files[0]).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80]);
        for text in [
            "(a) peer a",
            "(d) peer d",
            "ceiling (fio on the image)",
            "rr4k-d32-q1",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }
        // Three bars (ceiling, a, d) plus three legend swatches and the background.
        assert!(svg.matches("<rect").count() >= 6);
        // The latency charts: the peers' bars (no ceiling), under their own axis.
        let p50 = std::fs::read_to_string(&files[2]).unwrap();
        assert!(p50.contains("latency p50") && p50.contains("(a) peer a"));
        assert!(!p50.contains("ceiling (fio on the image)"));
        assert!(p50.matches("<rect").count() >= 4);
    }
}
