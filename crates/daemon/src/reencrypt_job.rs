//! A disk's re-encryption job as the disk holds it from its attachment on: the progress
//! `reencrypt-status` shows (paused from the start when the image is in mid-reencryption), the
//! pause flag its driver thread checks between hotzones, and that thread. `reencrypt` runs the
//! job; the disk and the registry only make, stop and read it.

use cryptblk_control::api::{Hotzone, ReencryptPhase, ReencryptStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

/// A disk's reencryption as `reencrypt-status` shows it.
pub(crate) struct ReencryptJob {
    pub(crate) status: Mutex<Progress>,
    /// `reencrypt-pause` asked the driver to stop after its hotzone.
    pub(crate) pause: AtomicBool,
    pub(crate) thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// What a run does to the disk: a new volume key, or a raw disk encrypted in place.
pub(crate) use cryptblk_volume::OnlineMode as Mode;

#[derive(Clone)]
pub(crate) struct Progress {
    pub(crate) phase: ReencryptPhase,
    pub(crate) mode: Option<Mode>,
    pub(crate) done: u64,
    pub(crate) total: u64,
    /// Where this run started: bytes done then, and when.
    pub(crate) run_start: Option<(u64, Instant)>,
    pub(crate) resilience: Option<String>,
    pub(crate) cipher: Option<String>,
    pub(crate) hotzone: Option<Hotzone>,
    pub(crate) max_bandwidth: u64,
    pub(crate) last_error: Option<String>,
}

impl ReencryptJob {
    /// The job of a disk just attached: paused when its image is in mid-reencryption.
    pub(crate) fn new(segments: &cryptblk_volume::SegmentMap) -> Arc<ReencryptJob> {
        let (phase, done, total) = if segments.is_split() {
            (
                ReencryptPhase::Paused,
                segments.committed(),
                segments.size(),
            )
        } else {
            (ReencryptPhase::Idle, 0, 0)
        };
        let mode = Mode::under_way(segments);
        Arc::new(ReencryptJob {
            status: Mutex::new(Progress {
                phase,
                mode,
                done,
                total,
                run_start: None,
                resilience: None,
                cipher: None,
                hotzone: None,
                max_bandwidth: 0,
                last_error: None,
            }),
            pause: AtomicBool::new(false),
            thread: Mutex::new(None),
        })
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut Progress)) {
        f(&mut self.status.lock().unwrap_or_else(PoisonError::into_inner));
    }

    pub(crate) fn status(&self, name: &str) -> ReencryptStatus {
        let p = self
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let rate = match (p.phase, p.run_start) {
            (ReencryptPhase::Running | ReencryptPhase::Pausing, Some((from, at))) => {
                let secs = at.elapsed().as_secs_f64();
                if secs > 0.0 {
                    (p.done.saturating_sub(from) as f64 / secs) as u64
                } else {
                    0
                }
            }
            _ => 0,
        };
        ReencryptStatus {
            name: name.to_string(),
            phase: p.phase,
            mode: p.mode.map(|m| m.name().to_string()),
            bytes_done: p.done,
            bytes_total: p.total,
            rate,
            eta_seconds: (rate > 0).then(|| p.total.saturating_sub(p.done) / rate),
            resilience: p.resilience,
            cipher: p.cipher,
            hotzone: p.hotzone,
            max_bandwidth: p.max_bandwidth,
            last_error: p.last_error,
        }
    }

    /// Pauses a running reencryption and waits until it has committed its hotzone (the disk
    /// is being detached).
    pub(crate) fn stop(&self) {
        self.pause.store(true, Ordering::Release);
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }

    /// Whether a reencryption thread is running (not paused or finished).
    pub(crate) fn is_running(&self) -> bool {
        self.thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(|t| !t.is_finished())
    }

    /// Bytes rewritten so far (the metrics' counter).
    pub(crate) fn bytes_done(&self) -> u64 {
        self.status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .done
    }
}
