//! Every bounded wait of the harness: a condition polled until it holds, or an error that
//! says what did not happen in time.
use anyhow::{bail, Result};
use std::time::{Duration, Instant};

/// Polls `ready` every `every` until it gives a value (an error from it ends the wait at
/// once); after `bound`, fails with `what()` (built then, so that it can show a log).
pub fn until<T>(
    bound: Duration,
    every: Duration,
    what: impl Fn() -> String,
    mut ready: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let start = Instant::now();
    loop {
        if let Some(value) = ready()? {
            return Ok(value);
        }
        if start.elapsed() > bound {
            bail!("{} (waited {bound:?})", what());
        }
        std::thread::sleep(every);
    }
}
