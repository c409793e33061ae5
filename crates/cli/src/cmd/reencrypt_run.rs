//! Running an offline reencryption or decryption to its end: recover an interrupted hotzone,
//! rewrite the rest hotzone by hotzone with progress, stop cleanly on a signal with the run
//! saved, and finish. `reencrypt` and `reencrypt --decrypt` both end here.
use crate::args::ReencryptArgs;
use crate::convert::interrupt::InterruptFlag;
use crate::convert::pipeline::Progress;
use crate::convert::progress::Reporter;
use crate::exit::UsageError;
use anyhow::{bail, Context, Result};
use cryptblk_luks::luks2::reencrypt::Reencryption;
use cryptblk_luks::HeaderIo;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Default hotzone: large enough to keep every core busy, small enough for a modest machine.
const DEFAULT_HOTZONE: u64 = 64 << 20;

/// Recover an interrupted hotzone, rewrite the rest with progress, and finish; a signal stops
/// after the current hotzone with the reencryption saved.
pub(super) fn run_to_end(
    a: &ReencryptArgs,
    file: &(dyn HeaderIo + Sync),
    mut r: Reencryption<'_>,
    path: &str,
    interrupt: &InterruptFlag,
    resume_options: &str,
) -> Result<()> {
    if r.is_interrupted() {
        r.recover()
            .with_context(|| format!("recovering the interrupted hotzone of {path}"))?;
    }
    let hotzone = hotzone_size(a, &r)?;
    let total = r.device_size()?;
    let progress = Arc::new(Progress {
        done: r.done_bytes()?.into(),
    });
    let reporter = Reporter::new(a.progress, total);
    let finished = AtomicBool::new(false);
    let outcome = std::thread::scope(|scope| {
        scope.spawn(|| reporter.run_until(&progress, || finished.load(Ordering::Acquire)));
        let result = (|| -> Result<bool> {
            let interrupted = || interrupt.flag.load(Ordering::Relaxed);
            if !interrupted() {
                // Nothing else writes the image (locked since it was opened), so the next
                // hotzone can be read while this one is rewritten.
                let rep = r
                    .run_reading_ahead(hotzone, file, |rep| {
                        progress.done.store(rep.done, Ordering::Relaxed);
                        !interrupted()
                    })
                    .with_context(|| format!("reencrypting {path}"))?;
                if rep.done >= rep.total {
                    return Ok(true);
                }
            }
            r.checkpoint()?;
            Ok(false)
        })();
        finished.store(true, Ordering::Release);
        result
    });
    reporter.finish(progress.done.load(Ordering::Relaxed));
    if !outcome? {
        bail!("{path}: interrupted; the reencryption is saved, continue it with `cryptblk reencrypt --resume-only{resume_options} {path}`");
    }
    r.finish()
        .with_context(|| format!("finishing the reencryption of {path}"))?;
    Ok(())
}

fn hotzone_size(a: &ReencryptArgs, r: &Reencryption<'_>) -> Result<u64> {
    let align = r.alignment();
    let max = r.max_hotzone();
    match a.hotzone_size {
        Some(n) if n == 0 || !n.is_multiple_of(align) => bail!(UsageError(format!(
            "--hotzone-size {n} must be a positive multiple of {align} bytes"
        ))),
        Some(n) if n > max => bail!(UsageError(format!(
            "--hotzone-size {n} is above the {max} bytes the checksum area can protect"
        ))),
        Some(n) => Ok(n),
        None => {
            let n = DEFAULT_HOTZONE.min(max);
            Ok((n - n % align).max(align))
        }
    }
}
