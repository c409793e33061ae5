//! Signals during a convert: stop the copy cleanly so the temporary target can be removed.
use anyhow::Result;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// SIGINT, SIGTERM and SIGHUP set a flag the pipeline polls; a second signal exits at once.
pub struct InterruptFlag {
    pub flag: Arc<AtomicBool>,
    ids: Vec<signal_hook::SigId>,
}

impl InterruptFlag {
    pub fn register() -> Result<Self> {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let flag = Arc::new(AtomicBool::new(false));
        let mut ids = Vec::new();
        for sig in [SIGINT, SIGTERM, SIGHUP] {
            // Order matters: the conditional exit only fires when the flag is already set.
            ids.push(signal_hook::flag::register_conditional_shutdown(
                sig,
                130,
                flag.clone(),
            )?);
            ids.push(signal_hook::flag::register(sig, flag.clone())?);
        }
        Ok(InterruptFlag { flag, ids })
    }
}

impl Drop for InterruptFlag {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}
