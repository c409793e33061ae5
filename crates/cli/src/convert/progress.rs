//! Progress reporting for long copies: a terminal bar or JSON lines, rendered from a counter
//! the pipeline bumps, so the data path never waits on the display.
use super::pipeline::Progress;
use crate::args::ProgressMode;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub struct Reporter {
    mode: Option<ProgressMode>,
    total: u64,
    started: Instant,
    bar: Option<ProgressBar>,
}

impl Reporter {
    pub fn new(mode: Option<ProgressMode>, total: u64) -> Self {
        let bar = (mode == Some(ProgressMode::Bar)).then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:40.cyan/blue} {percent:>3}% {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
                )
                .expect("static template is valid"),
            );
            bar
        });
        Reporter {
            mode,
            total,
            started: Instant::now(),
            bar,
        }
    }

    /// Renders until `finished` returns true, then once more with the final count.
    pub fn run_until(&self, progress: &Progress, finished: impl Fn() -> bool) {
        let interval = match self.mode {
            None => return,
            Some(ProgressMode::Bar) => Duration::from_millis(100),
            Some(ProgressMode::Json) => Duration::from_millis(500),
        };
        while !finished() {
            self.render(progress.done.load(Ordering::Relaxed), false);
            std::thread::sleep(interval);
        }
    }

    /// Shows `done` now, for callers that report from their own loop (they pace it).
    pub fn show(&self, done: u64) {
        self.render(done, false);
    }

    pub fn finish(&self, done: u64) {
        self.render(done, true);
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }

    fn render(&self, done: u64, last: bool) {
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-6);
        match self.mode {
            None => {}
            Some(ProgressMode::Bar) => {
                if let Some(bar) = &self.bar {
                    bar.set_position(done);
                }
            }
            Some(ProgressMode::Json) => {
                let rate = done as f64 / elapsed;
                let eta = if rate > 0.0 {
                    (self.total.saturating_sub(done)) as f64 / rate
                } else {
                    f64::NAN
                };
                let line = serde_json::json!({
                    "event": if last { "done" } else { "progress" },
                    "done_bytes": done,
                    "total_bytes": self.total,
                    "percent": if self.total == 0 { 100.0 } else { done as f64 * 100.0 / self.total as f64 },
                    "bytes_per_second": rate.round(),
                    "elapsed_seconds": (elapsed * 1000.0).round() / 1000.0,
                    "eta_seconds": if eta.is_finite() { Some((eta * 10.0).round() / 10.0) } else { None },
                });
                let mut err = std::io::stderr().lock();
                let _ = writeln!(err, "{line}");
            }
        }
    }
}
