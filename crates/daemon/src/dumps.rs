//! Keeping the daemon's memory out of core dumps and away from debuggers. Its memory holds
//! every disk's volume key, the cipher engines' expanded key schedules (in OpenSSL's and the
//! engines' own allocations, which cannot be placed on locked pages the way `SecretKey`s are)
//! and mappings of every connected VM's RAM: a core dump or a `ptrace` of the daemon by its
//! user would hand all of them out. Not dumpable means: no core file on a crash, and no
//! `ptrace` attach or `/proc/PID/mem` for processes without `CAP_SYS_PTRACE`, even of the same
//! user (`/proc/PID/*` then belongs to root).
use crate::error::{Error, Result};
use rustix::process::{dumpable_behavior, set_dumpable_behavior, DumpableBehavior};

/// Marks this process not dumpable (`PR_SET_DUMPABLE` 0). It stays so across the daemon's
/// life; an `execve` would reset it, and the daemon runs none.
pub fn forbid_core_dumps() -> Result<()> {
    set_dumpable_behavior(DumpableBehavior::NotDumpable).map_err(|e| {
        Error::caused(
            "making the daemon not dumpable (PR_SET_DUMPABLE)",
            std::io::Error::from(e),
        )
    })
}

/// Whether this process may be dumped (`PR_GET_DUMPABLE`).
pub fn is_dumpable() -> bool {
    matches!(dumpable_behavior(), Ok(DumpableBehavior::Dumpable))
}
