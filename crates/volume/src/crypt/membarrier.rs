//! `membarrier(2)`: a full memory barrier in every thread of the process, which the segment
//! map runs between publishing a generation and reading the stages' counts (see
//! `segments.rs`), so that the stages' request path needs no fence of its own.
use cryptblk_block::BlockError;
use rustix::thread::MembarrierCommand;
use std::sync::atomic::Ordering;

fn membarrier_call(cmd: MembarrierCommand) -> bool {
    rustix::thread::membarrier(cmd).is_ok()
}

/// Registers the process for expedited barriers (needed once, before the first).
pub(super) fn register_membarrier() -> Result<(), BlockError> {
    if membarrier_call(MembarrierCommand::RegisterPrivateExpedited) {
        return Ok(());
    }
    // The global barrier needs no registration (slower: it waits for an RCU grace period).
    if membarrier_call(MembarrierCommand::Global) {
        return Ok(());
    }
    Err(BlockError::unsupported(
        "membarrier(2), which online reencryption needs to fence the queues, is not available (Linux 4.14 or later, not filtered by seccomp)",
    ))
}

/// A full memory barrier in every thread of the process.
pub(super) fn membarrier() {
    if !membarrier_call(MembarrierCommand::PrivateExpedited)
        && !membarrier_call(MembarrierCommand::Global)
    {
        // Only reached when no reencryption could have started (`register_membarrier`).
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}
