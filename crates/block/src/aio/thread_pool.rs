//! The process-wide pool of threads that run blocking I/O for the thread-based engines (the
//! `threads` aio engine and `SyncQueue`). Threads are started on demand, up to a cap, and
//! sleep on a channel when idle: no polling.

use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

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
    tx: Sender<Box<dyn Job>>,
    rx: Receiver<Box<dyn Job>>,
    started: AtomicUsize,
    idle: AtomicUsize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let (tx, rx) = crossbeam_channel::unbounded();
        Pool {
            tx,
            rx,
            started: AtomicUsize::new(0),
            idle: AtomicUsize::new(0),
        }
    })
}

/// Runs `job` on a pool thread, starting one if none is idle and the cap allows.
pub(crate) fn spawn(job: Box<dyn Job>) {
    let pool = pool();
    if pool.idle.load(Ordering::Acquire) == 0 {
        start_thread(pool);
    }
    // The pool owns both ends for the life of the process, so sending cannot fail.
    let _ = pool.tx.send(job);
}

fn start_thread(pool: &'static Pool) {
    let n = pool.started.fetch_add(1, Ordering::AcqRel);
    if n >= io_thread_count() {
        pool.started.fetch_sub(1, Ordering::AcqRel);
        return;
    }
    let spawned = std::thread::Builder::new()
        .name(format!("cryptblk-io-{n}"))
        .spawn(move || loop {
            pool.idle.fetch_add(1, Ordering::AcqRel);
            let job = pool.rx.recv();
            pool.idle.fetch_sub(1, Ordering::AcqRel);
            match job {
                Ok(job) => job.run(),
                Err(_) => return,
            }
        });
    if let Err(e) = spawned {
        pool.started.fetch_sub(1, Ordering::AcqRel);
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
        assert!(pool().started.load(Ordering::Relaxed) <= io_thread_count());
    }
}
