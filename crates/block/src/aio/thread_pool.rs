//! The process-wide pool of threads that run blocking I/O for the thread-based engines (the
//! `threads` aio engine and synchronous devices). Threads are started on demand, up to a cap, and
//! sleep on a condition variable when idle: no polling, and no spinning or yielding before
//! they sleep either (on a 2-vCPU guest a yield costs more than the 4 KiB copy it waits for).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};

/// A unit of blocking work. Jobs are boxed once by their queue and recycled: `run` hands the
/// box back to its queue together with the result, so steady-state I/O allocates nothing.
pub(crate) trait Job: Send {
    fn run(self: Box<Self>);
}

/// Most threads the pool starts: what one pool serving every disk of a process may keep
/// waiting in the kernel at once (QEMU's thread pool has the same default cap).
pub fn io_thread_count() -> usize {
    64
}

struct Pool {
    state: Mutex<PoolState>,
    wake: Condvar,
}

#[derive(Default)]
struct PoolState {
    jobs: VecDeque<Box<dyn Job>>,
    started: usize,
    idle: usize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        state: Mutex::new(PoolState::default()),
        wake: Condvar::new(),
    })
}

impl Pool {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A queue of boxed jobs stays consistent whatever a panicking holder did.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Runs `job` on a pool thread: an idle one is woken, else one is started if the cap allows
/// (else the job waits for the next thread to finish its current one).
pub(crate) fn spawn(job: Box<dyn Job>) {
    let pool = pool();
    let mut state = pool.lock();
    state.jobs.push_back(job);
    if state.idle > state.jobs.len() - 1 {
        drop(state);
        pool.wake.notify_one();
        return;
    }
    if state.started < io_thread_count() {
        state.started += 1;
        let n = state.started;
        drop(state);
        start_thread(pool, n);
    }
}

fn start_thread(pool: &'static Pool, n: usize) {
    let spawned = std::thread::Builder::new()
        .name(format!("cryptblk-io-{n}"))
        .spawn(move || loop {
            let job = {
                let mut state = pool.lock();
                loop {
                    if let Some(job) = state.jobs.pop_front() {
                        break job;
                    }
                    state.idle += 1;
                    state = pool
                        .wake
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                    state.idle -= 1;
                }
            };
            job.run();
        });
    if let Err(e) = spawned {
        pool.lock().started -= 1;
        // Jobs still run on the threads already started; with none at all they would wait
        // forever, so say why loudly.
        tracing::error!("cannot start an I/O thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    struct Echo(mpsc::Sender<usize>, usize);

    impl Job for Echo {
        fn run(self: Box<Self>) {
            let _ = self.0.send(self.1);
        }
    }

    #[test]
    fn runs_every_job() {
        let (tx, rx) = mpsc::channel();
        for i in 0..100 {
            spawn(Box::new(Echo(tx.clone(), i)));
        }
        let mut got: Vec<usize> = (0..100).map(|_| rx.recv().unwrap()).collect();
        got.sort_unstable();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
        assert!(pool().lock().started <= io_thread_count());
    }
}
