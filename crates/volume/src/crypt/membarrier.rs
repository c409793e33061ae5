//! `membarrier(2)`: a full memory barrier in every thread of the process, which the segment
//! map runs between publishing a generation and reading the stages' counts (see
//! `segments.rs`), so that the stages' request path needs no fence of its own.
use cryptblk_block::BlockError;
use std::sync::atomic::Ordering;

const MEMBARRIER_CMD_GLOBAL: libc::c_int = 1;
const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

fn membarrier_call(cmd: libc::c_int) -> bool {
    // SAFETY: membarrier(2) takes two integers and touches no memory of ours.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0, 0) == 0 }
}

/// Registers the process for expedited barriers (needed once, before the first).
pub(super) fn register_membarrier() -> Result<(), BlockError> {
    if membarrier_call(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) {
        return Ok(());
    }
    // The global barrier needs no registration (slower: it waits for an RCU grace period).
    if membarrier_call(MEMBARRIER_CMD_GLOBAL) {
        return Ok(());
    }
    Err(BlockError::unsupported(
        "membarrier(2), which online reencryption needs to fence the queues, is not available (Linux 4.14 or later, not filtered by seccomp)",
    ))
}

/// A full memory barrier in every thread of the process.
pub(super) fn membarrier() {
    if !membarrier_call(MEMBARRIER_CMD_PRIVATE_EXPEDITED) && !membarrier_call(MEMBARRIER_CMD_GLOBAL)
    {
        // Only reached when no reencryption could have started (`register_membarrier`).
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}
