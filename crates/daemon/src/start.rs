//! Attaching the disks named at start: unlocked in parallel, each exported as soon as its key
//! is derived, within a memory budget for the key derivations.
//!
//! A LUKS2 keyslot's argon2 takes seconds of one core and up to gigabytes (cryptblk's and
//! cryptsetup's default: about 2 s and 1 GiB at most), so thirty disks unlocked one after
//! another keep the last VM waiting a minute. Here one worker per core takes the next disk,
//! derives its key and exports it at once. Before it derives, a worker reserves the memory
//! the disk's costliest keyslot needs from the budget (`--unlock-memory`), waiting while
//! other derivations hold it; a keyslot larger than the whole budget runs alone.
//!
//! The start still succeeds or fails as a whole: the first disk that cannot be opened stops
//! the workers from taking more, and the caller detaches every disk already exported.

use crate::error::{Error, Result};
use crate::key_file::Passphrase;
use crate::registry::Daemon;
use crate::Secret;
use cryptblk_control::api::{DiskConfig, DiskInfo};
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, PoisonError};

/// A disk to attach at start, with the passphrase when the caller asked for it on a terminal.
pub struct StartDisk {
    pub config: DiskConfig,
    pub passphrase: Option<Passphrase>,
}

/// How messages name a disk at start.
pub(crate) fn label(config: &DiskConfig, by_name: bool) -> String {
    if by_name {
        format!("disk \"{}\" ({})", config.name, config.image)
    } else {
        config.image.to_string()
    }
}

/// Memory for key derivations running at once, in KiB.
pub struct UnlockBudget {
    total_kib: u64,
    free_kib: Mutex<u64>,
    freed: Condvar,
}

/// Memory reserved for one derivation, given back when dropped.
struct Reserved<'a> {
    budget: &'a UnlockBudget,
    kib: u64,
}

impl UnlockBudget {
    pub fn new(total_kib: u64) -> UnlockBudget {
        UnlockBudget {
            total_kib,
            free_kib: Mutex::new(total_kib),
            freed: Condvar::new(),
        }
    }

    /// Half of the memory available now (`MemAvailable`), or 1 GiB when it cannot be read.
    pub fn default_kib() -> u64 {
        std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("MemAvailable:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .map_or(1 << 20, |available| available / 2)
    }

    /// Waits until `kib` (at most the whole budget) is free and takes it.
    fn reserve(&self, kib: u64) -> Reserved<'_> {
        let kib = kib.min(self.total_kib);
        let mut free = self.free_kib.lock().unwrap_or_else(PoisonError::into_inner);
        while *free < kib {
            free = self
                .freed
                .wait(free)
                .unwrap_or_else(PoisonError::into_inner);
        }
        *free -= kib;
        Reserved { budget: self, kib }
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        *self
            .budget
            .free_kib
            .lock()
            .unwrap_or_else(PoisonError::into_inner) += self.kib;
        self.budget.freed.notify_all();
    }
}

/// Opens, unlocks and exports `disks` with one worker per core; returns the first failure
/// (with the disk named), after which no further disk is started. Disks already exported
/// stay: the caller detaches them.
pub fn attach_all(
    daemon: &Daemon,
    disks: Vec<StartDisk>,
    name_disks: bool,
    budget: &UnlockBudget,
    serving: impl Fn(&DiskConfig, &DiskInfo, std::time::Duration) + Sync,
) -> Result<()> {
    let workers = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(disks.len())
        .max(1);
    let queue = Mutex::new(disks.into_iter().collect::<VecDeque<_>>());
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    let next = || {
        if failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
        {
            return None;
        }
        queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
    };
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                while let Some(StartDisk { config, passphrase }) = next() {
                    let what = label(&config, name_disks);
                    let reserved = budget.reserve(unlock_memory_kib(daemon, &config));
                    let unlocking = std::time::Instant::now();
                    let prepared = daemon.prepare(config.clone(), Secret::Passphrase(passphrase));
                    let took = unlocking.elapsed();
                    drop(reserved);
                    let attached = prepared.and_then(|p| daemon.publish(p));
                    match attached {
                        Ok(info) => serving(&config, &info, took),
                        Err(e) => {
                            failure
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .get_or_insert(e.context(what));
                        }
                    }
                }
            });
        }
    });
    failure
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
        .map_or(Ok(()), Err)
}

/// What unlocking `config`'s image may take at once: its costliest keyslot's KDF memory.
/// Cheap (the header only); an image not readable here costs nothing now and fails properly
/// when it is opened. An RBD image is not opened twice: it counts as the largest derivation
/// the daemon allows.
fn unlock_memory_kib(daemon: &Daemon, config: &DiskConfig) -> u64 {
    if config.image.rbd().is_some() {
        return daemon.unlock.max_pbkdf_memory_kib;
    }
    let Ok(file) = std::fs::File::open(config.image.path()) else {
        return 0;
    };
    match cryptblk_luks::LuksImage::read(&file) {
        Ok((header, _)) => header.unlock_memory_kib(),
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    #[test]
    fn derivations_share_the_budget_and_an_oversized_one_runs_alone() {
        let budget = UnlockBudget::new(1000);
        let held = AtomicU64::new(0);
        let most = AtomicU64::new(0);
        std::thread::scope(|s| {
            for kib in [600, 600, 300, 5000, 100] {
                let (budget, held, most) = (&budget, &held, &most);
                s.spawn(move || {
                    let r = budget.reserve(kib);
                    let now = held.fetch_add(r.kib, Ordering::SeqCst) + r.kib;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(20));
                    held.fetch_sub(r.kib, Ordering::SeqCst);
                });
            }
        });
        assert!(most.load(Ordering::SeqCst) <= 1000);
        assert_eq!(*budget.free_kib.lock().unwrap(), 1000);
    }
}
