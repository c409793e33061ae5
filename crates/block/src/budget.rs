//! `MemoryBudget`: one bound on the bytes of request data a whole process holds at once, shared
//! fairly between its queues.
//!
//! Every queue (a virtqueue's pipeline, an NBD connection) takes a [`BudgetShare`] and reserves
//! the bytes a request may make the process hold (its ciphertext, a bounce buffer, an NBD
//! payload) before admitting it, and releases them when the request is done. When the budget
//! has no room, the request is not refused: the share joins a wait list and the request waits
//! in its queue, in order. Bytes released are granted to the waiting shares in turn, the one at
//! the head first, before anyone else may reserve: whoever waits is served within one turn of
//! the others, whatever they submit, and the bytes granted are the share's at once (no one
//! takes them between the grant and the owner's wake-up). The owner learns of a grant through
//! its share's [`Notifier`], the eventfd its event loop already waits on: nobody polls.
//!
//! Two lists make the turns: shares that hold nothing wait in `hungry`, served before those
//! that hold some (`fed`). So a queue with nothing in flight gets its first request in at the
//! next release whatever the busy ones want, and a busy queue cannot take more than its turn
//! while others wait; a request of any size (up to the limit) is served once it is at the head,
//! because nobody behind it is served before it.
//!
//! The fast path, with nobody waiting, is one load and one compare-and-swap to reserve and one
//! subtraction and one load to release. The wait lists' lock is taken only while someone waits.

use crate::aio::Notifier;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

/// No limit: the process budget of a program that did not set one.
pub const UNLIMITED: u64 = u64::MAX;

/// Shares woken per pass over the wait lists; the lock is let go before the wake-ups (eventfd
/// writes) and taken again for the next pass.
const WAKE_BATCH: usize = 8;

/// A memory budget, shared by every queue that takes a share of it. Cloning it gives another
/// handle on the same budget.
#[derive(Clone)]
pub struct MemoryBudget {
    shared: Arc<Shared>,
}

struct Shared {
    limit: AtomicU64,
    /// Bytes reserved by the shares, granted ones included.
    reserved: AtomicU64,
    /// Shares in the wait lists: while any is, every reservation goes through the lists.
    waiting: AtomicUsize,
    lists: Mutex<WaitLists>,
    /// The most bytes reserved at once.
    peak: AtomicU64,
    /// Reservations that had to wait.
    waits: AtomicU64,
}

#[derive(Default)]
struct WaitLists {
    /// Shares that held nothing when they began to wait, oldest first.
    hungry: VecDeque<Waiter>,
    /// Shares that held some, oldest first.
    fed: VecDeque<Waiter>,
}

struct Waiter {
    share: Arc<ShareState>,
    bytes: u64,
}

/// What a share's granter and owner both see.
struct ShareState {
    /// Bytes granted while it waited, not yet collected by the owner.
    granted: AtomicU64,
    /// In a wait list (changed under the lists' lock).
    queued: AtomicBool,
    wake: Arc<Notifier>,
}

/// The counters of a budget, for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetUsage {
    pub limit: u64,
    pub reserved: u64,
    pub peak: u64,
    /// Shares waiting now.
    pub waiting: usize,
    /// Reservations that waited, since the budget was made.
    pub waits: u64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes (at least one byte).
    pub fn new(limit: u64) -> Self {
        MemoryBudget {
            shared: Arc::new(Shared {
                limit: AtomicU64::new(limit.max(1)),
                reserved: AtomicU64::new(0),
                waiting: AtomicUsize::new(0),
                lists: Mutex::new(WaitLists::default()),
                peak: AtomicU64::new(0),
                waits: AtomicU64::new(0),
            }),
        }
    }

    /// The process's budget: what every queue uses unless given another. Unlimited until
    /// [`set_limit`](Self::set_limit) (the daemon sets it from `--memory-budget` at start).
    pub fn process() -> &'static MemoryBudget {
        static PROCESS: OnceLock<MemoryBudget> = OnceLock::new();
        PROCESS.get_or_init(|| MemoryBudget::new(UNLIMITED))
    }

    /// Changes the limit. Meant for a program's start, before its queues run; a lower limit
    /// while bytes are reserved only makes new reservations wait longer.
    pub fn set_limit(&self, limit: u64) {
        self.shared.limit.store(limit.max(1), Ordering::SeqCst);
        self.shared.grant();
    }

    pub fn limit(&self) -> u64 {
        self.shared.limit.load(Ordering::Relaxed)
    }

    pub fn usage(&self) -> BudgetUsage {
        let s = &self.shared;
        BudgetUsage {
            limit: s.limit.load(Ordering::Relaxed),
            reserved: s.reserved.load(Ordering::Relaxed),
            peak: s.peak.load(Ordering::Relaxed),
            waiting: s.waiting.load(Ordering::Relaxed),
            waits: s.waits.load(Ordering::Relaxed),
        }
    }

    /// A share for one queue, woken through `wake` when bytes are granted to it.
    pub fn share(&self, wake: Arc<Notifier>) -> BudgetShare {
        BudgetShare {
            budget: self.clone(),
            state: Arc::new(ShareState {
                granted: AtomicU64::new(0),
                queued: AtomicBool::new(false),
                wake,
            }),
            held: 0,
        }
    }
}

impl std::fmt::Debug for MemoryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MemoryBudget").field(&self.usage()).finish()
    }
}

impl Shared {
    fn lists(&self) -> MutexGuard<'_, WaitLists> {
        // The lists stay consistent whatever a panicking holder did (each change is one push
        // or pop).
        self.lists.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds `bytes` to the reserved total if that stays within the limit.
    fn try_add(&self, bytes: u64) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        let mut current = self.reserved.load(Ordering::SeqCst);
        loop {
            let Some(next) = current.checked_add(bytes).filter(|&n| n <= limit) else {
                return false;
            };
            match self.reserved.compare_exchange_weak(
                current,
                next,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::Relaxed);
                    return true;
                }
                Err(now) => current = now,
            }
        }
    }

    fn release(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.reserved.fetch_sub(bytes, Ordering::SeqCst);
        // Pairs with the waiter's increment before its last try (`BudgetShare::try_reserve`):
        // either it saw these bytes free, or this sees it waiting.
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.grant();
        }
    }

    /// Grants what is free to the waiting shares, the head of `hungry` first, then of `fed`,
    /// until the head's bytes do not fit; wakes each share granted.
    fn grant(&self) {
        loop {
            let mut woken: [Option<Arc<ShareState>>; WAKE_BATCH] = Default::default();
            let mut n = 0;
            let more = {
                let mut lists = self.lists();
                loop {
                    if n == WAKE_BATCH {
                        break true;
                    }
                    let WaitLists { hungry, fed } = &mut *lists;
                    let list = if hungry.is_empty() { fed } else { hungry };
                    let Some(head) = list.front() else {
                        break false;
                    };
                    if !self.try_add(head.bytes) {
                        break false;
                    }
                    let Some(head) = list.pop_front() else {
                        break false;
                    };
                    head.share.granted.fetch_add(head.bytes, Ordering::SeqCst);
                    head.share.queued.store(false, Ordering::SeqCst);
                    self.waiting.fetch_sub(1, Ordering::SeqCst);
                    woken[n] = Some(head.share);
                    n += 1;
                }
            };
            for share in woken.iter().flatten() {
                share.wake.notify();
            }
            if !more {
                return;
            }
        }
    }
}

/// One queue's part of a budget. Used by its owner's thread only; the bytes it still holds
/// are released when it drops.
pub struct BudgetShare {
    budget: MemoryBudget,
    state: Arc<ShareState>,
    /// Bytes reserved by this share and not released (grants collected included).
    held: u64,
}

impl BudgetShare {
    /// The budget this is a share of.
    pub fn budget(&self) -> &MemoryBudget {
        &self.budget
    }

    /// Bytes this share holds.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// Whether the share waits for a grant (its owner should not ask again before one came).
    pub fn is_waiting(&self) -> bool {
        self.state.queued.load(Ordering::SeqCst)
    }

    /// What a reservation of `bytes` is charged: no more than the whole budget, so that a
    /// request larger than the limit still runs (alone).
    pub fn charge_for(&self, bytes: u64) -> u64 {
        bytes.min(self.budget.limit())
    }

    /// Reserves `charge` bytes (from [`charge_for`](Self::charge_for)) for a request: returns
    /// the bytes now held for it, `charge` reserved now if there is room and nobody waits
    /// ahead, or the grant the share waited for (what it asked for then). Otherwise `None`:
    /// the share joins the wait list for `charge` (unless it waits already) and the owner asks
    /// again once woken. Never blocks.
    pub fn try_reserve(&mut self, charge: u64) -> Option<u64> {
        if charge == 0 {
            return Some(0);
        }
        if self.is_waiting() {
            return None;
        }
        // Granted since the owner last asked: set before `queued` was cleared.
        if self.state.granted.load(Ordering::SeqCst) > 0 {
            let granted = self.take_grant();
            if granted > 0 {
                return Some(granted);
            }
        }
        let shared = &self.budget.shared;
        if shared.waiting.load(Ordering::SeqCst) == 0 && shared.try_add(charge) {
            self.held += charge;
            return Some(charge);
        }
        let mut lists = shared.lists();
        // Announced before the last try: a release either frees bytes this try sees, or sees
        // the announcement and grants from the list once this lock is let go.
        shared.waiting.fetch_add(1, Ordering::SeqCst);
        let hungry = self.held == 0;
        let ahead = if hungry {
            !lists.hungry.is_empty()
        } else {
            !lists.hungry.is_empty() || !lists.fed.is_empty()
        };
        if !ahead && shared.try_add(charge) {
            shared.waiting.fetch_sub(1, Ordering::SeqCst);
            self.held += charge;
            return Some(charge);
        }
        let waiter = Waiter {
            share: self.state.clone(),
            bytes: charge,
        };
        self.state.queued.store(true, Ordering::SeqCst);
        if hungry {
            lists.hungry.push_back(waiter);
        } else {
            lists.fed.push_back(waiter);
        }
        shared.waits.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Bytes granted since the last call (the charge the share waited for, or 0), now held.
    pub fn take_grant(&mut self) -> u64 {
        let granted = self.state.granted.swap(0, Ordering::SeqCst);
        self.held += granted;
        granted
    }

    /// Gives back `charge` bytes this share reserved.
    pub fn release(&mut self, charge: u64) {
        debug_assert!(charge <= self.held, "releasing more than the share holds");
        let charge = charge.min(self.held);
        self.held -= charge;
        self.budget.shared.release(charge);
    }

    /// Reserves `charge` bytes, blocking until they are granted (for a thread that serves one
    /// request at a time and has nothing else to wait for); returns the bytes held, as
    /// `try_reserve`. `give_up` is asked after every wake-up and ends the wait (`None`,
    /// nothing reserved) when it says so.
    pub fn reserve_blocking(
        &mut self,
        charge: u64,
        mut give_up: impl FnMut() -> bool,
    ) -> Option<u64> {
        if let Some(held) = self.try_reserve(charge) {
            return Some(held);
        }
        loop {
            self.state.wake.wait();
            self.state.wake.clear();
            let granted = self.take_grant();
            if granted > 0 {
                return Some(granted);
            }
            if give_up() {
                self.leave_wait_list();
                return None;
            }
        }
    }

    /// Stops waiting; a grant that arrived meanwhile is released again.
    fn leave_wait_list(&mut self) {
        let shared = &self.budget.shared;
        {
            let mut lists = shared.lists();
            if self.state.queued.swap(false, Ordering::SeqCst) {
                let me = Arc::as_ptr(&self.state);
                lists.hungry.retain(|w| Arc::as_ptr(&w.share) != me);
                lists.fed.retain(|w| Arc::as_ptr(&w.share) != me);
                shared.waiting.fetch_sub(1, Ordering::SeqCst);
            }
        }
        let granted = self.take_grant();
        self.release(granted);
    }
}

impl Drop for BudgetShare {
    fn drop(&mut self) {
        self.leave_wait_list();
        let held = std::mem::take(&mut self.held);
        self.budget.shared.release(held);
    }
}

impl std::fmt::Debug for BudgetShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BudgetShare")
            .field("held", &self.held)
            .field("waiting", &self.is_waiting())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(budget: &MemoryBudget) -> BudgetShare {
        budget.share(Arc::new(Notifier::new().unwrap()))
    }

    /// Whether the share's notifier was set (and clears it).
    fn woken(share: &BudgetShare) -> bool {
        share.state.wake.clear()
    }

    #[test]
    fn reservations_within_the_limit_pass_and_come_back() {
        let budget = MemoryBudget::new(100);
        let mut a = share(&budget);
        assert!(a.try_reserve(60).is_some());
        assert!(a.try_reserve(40).is_some());
        assert_eq!(budget.usage().reserved, 100);
        a.release(40);
        assert_eq!((a.held(), budget.usage().reserved), (60, 60));
        drop(a);
        assert_eq!(budget.usage().reserved, 0);
        assert_eq!(budget.usage().peak, 100);
    }

    #[test]
    fn a_share_over_the_limit_waits_and_is_granted_in_order() {
        let budget = MemoryBudget::new(100);
        let mut busy = share(&budget);
        let mut first = share(&budget);
        let mut second = share(&budget);
        assert!(busy.try_reserve(100).is_some());
        assert!(first.try_reserve(30).is_none());
        assert!(second.try_reserve(30).is_none());
        assert!(first.is_waiting() && second.is_waiting());
        // Asking again while waiting keeps the place and takes nothing.
        assert!(first.try_reserve(30).is_none());
        assert_eq!(first.try_reserve(0), Some(0));
        assert_eq!(budget.usage().waiting, 2);
        // 40 free: the first gets its 30, the second's 30 does not fit the 10 left.
        busy.release(40);
        assert!(woken(&first) && !woken(&second));
        assert_eq!(first.take_grant(), 30);
        assert_eq!(second.take_grant(), 0);
        assert!(second.is_waiting());
        // Nobody overtakes a waiter, even with room for a smaller request.
        let mut third = share(&budget);
        assert!(third.try_reserve(5).is_none());
        busy.release(20);
        assert!(woken(&second) && !woken(&third));
        assert_eq!((second.take_grant(), third.take_grant()), (30, 0));
        assert_eq!(budget.usage().reserved, 100);
        busy.release(5);
        assert_eq!(third.take_grant(), 5);
    }

    #[test]
    fn asking_again_collects_the_grant_waited_for() {
        let budget = MemoryBudget::new(100);
        let mut busy = share(&budget);
        let mut waiter = share(&budget);
        assert_eq!(busy.try_reserve(100), Some(100));
        assert_eq!(waiter.try_reserve(40), None);
        busy.release(50);
        // Granted: asked again (for the same request) it holds the 40, and no more.
        assert_eq!(waiter.try_reserve(40), Some(40));
        assert_eq!((waiter.held(), budget.usage().reserved), (40, 90));
        assert_eq!(waiter.take_grant(), 0);
    }

    #[test]
    fn nobody_overtakes_a_large_request_at_the_head() {
        let budget = MemoryBudget::new(100);
        let mut busy = share(&budget);
        let mut large = share(&budget);
        let mut small = share(&budget);
        assert!(busy.try_reserve(90).is_some());
        assert!(large.try_reserve(80).is_none());
        // 10 bytes are free, but the head wants 80: a newcomer waits behind it.
        assert!(small.try_reserve(5).is_none());
        busy.release(50);
        assert_eq!((large.take_grant(), small.take_grant()), (0, 0));
        busy.release(40);
        assert_eq!((large.take_grant(), small.take_grant()), (80, 5));
    }

    #[test]
    fn a_share_holding_nothing_is_served_before_busy_ones() {
        let budget = MemoryBudget::new(100);
        let mut busy = share(&budget);
        let mut other = share(&budget);
        let mut idle = share(&budget);
        assert!(busy.try_reserve(50).is_some());
        assert!(other.try_reserve(50).is_some());
        assert!(busy.try_reserve(10).is_none());
        assert!(idle.try_reserve(10).is_none());
        other.release(10);
        assert_eq!((idle.take_grant(), busy.take_grant()), (10, 0));
        other.release(10);
        assert_eq!(busy.take_grant(), 10);
    }

    #[test]
    fn a_dropped_waiter_leaves_the_list_and_its_bytes_come_back() {
        let budget = MemoryBudget::new(100);
        let mut busy = share(&budget);
        let mut gone = share(&budget);
        let mut next = share(&budget);
        assert!(busy.try_reserve(100).is_some());
        assert!(gone.try_reserve(0).is_some());
        assert!(gone.try_reserve(60).is_none());
        assert!(next.try_reserve(60).is_none());
        drop(gone);
        assert_eq!(budget.usage().waiting, 1);
        busy.release(60);
        assert_eq!(next.take_grant(), 60);
        // A waiter granted and dropped before it collected gives the grant back.
        let mut granted_then_dropped = share(&budget);
        assert!(granted_then_dropped.try_reserve(40).is_none());
        busy.release(40);
        assert_eq!(budget.usage().reserved, 100);
        drop(granted_then_dropped);
        assert_eq!(budget.usage().reserved, 60);
    }

    #[test]
    fn a_request_larger_than_the_budget_runs_alone() {
        let budget = MemoryBudget::new(100);
        let mut a = share(&budget);
        let charge = a.charge_for(1000);
        assert_eq!(charge, 100);
        assert_eq!(a.try_reserve(charge), Some(100));
        let mut b = share(&budget);
        assert!(b.try_reserve(1).is_none());
        a.release(charge);
        assert_eq!(b.take_grant(), 1);
    }

    #[test]
    fn a_blocking_reservation_waits_for_a_release_on_another_thread() {
        let budget = MemoryBudget::new(100);
        let mut busy = share(&budget);
        assert!(busy.try_reserve(100).is_some());
        let waiter = std::thread::spawn({
            let budget = budget.clone();
            move || {
                let mut mine = share(&budget);
                let got = mine.reserve_blocking(70, || false);
                (got, mine.held())
            }
        });
        while budget.usage().waiting == 0 {
            std::thread::yield_now();
        }
        busy.release(100);
        assert_eq!(waiter.join().unwrap(), (Some(70), 70));
        assert_eq!(budget.usage().reserved, 0);
    }

    /// Eight queues that each want eight requests in flight where the budget holds sixteen,
    /// the oldest request completing first: every queue is admitted as often as the others.
    #[test]
    fn admissions_go_round_the_waiting_queues() {
        const REQUEST: u64 = 64 << 10;
        let budget = MemoryBudget::new(16 * REQUEST);
        let mut shares: Vec<BudgetShare> = (0..8).map(|_| share(&budget)).collect();
        let mut in_flight: VecDeque<usize> = VecDeque::new();
        let mut queued = [0usize; 8];
        let mut admitted = [0u64; 8];
        for step in 0..10_000 {
            if step > 0 {
                let done = in_flight.pop_front().unwrap();
                queued[done] -= 1;
                shares[done].release(REQUEST);
            }
            // Queues are served in a different order at each step.
            for k in 0..8 {
                let q = (k + step) % 8;
                loop {
                    if queued[q] == 8 {
                        break;
                    }
                    if shares[q].try_reserve(REQUEST).is_none() {
                        break;
                    }
                    queued[q] += 1;
                    // The first requests fill the budget in the order the queues came.
                    if step >= 100 {
                        admitted[q] += 1;
                    }
                    in_flight.push_back(q);
                }
            }
            assert!(budget.usage().reserved <= 16 * REQUEST);
        }
        let (min, max) = (
            admitted.iter().min().unwrap(),
            admitted.iter().max().unwrap(),
        );
        assert!(max - min <= 1, "admissions per queue: {admitted:?}");
    }

    /// Many queues on as many threads, each keeping as many requests in flight as it may and
    /// releasing them as they "complete": nobody is refused or starved, nobody hangs, and the
    /// limit is never passed. (How often each is admitted here follows the CPU time the
    /// scheduler gives its thread; the turns are `admissions_go_round_the_waiting_queues`.)
    #[test]
    fn busy_queues_on_threads_all_progress_within_the_limit() {
        const QUEUES: usize = 8;
        const REQUEST: u64 = 64 << 10;
        const LIMIT: u64 = 16 * REQUEST;
        let budget = MemoryBudget::new(LIMIT);
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = (0..QUEUES)
            .map(|_| {
                let budget = budget.clone();
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut me = share(&budget);
                    let mut in_flight = std::collections::VecDeque::new();
                    let mut admitted = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        // Up to 8 in flight: far more than a fair part of 16 between 8 queues.
                        while in_flight.len() < 8 {
                            if me.try_reserve(REQUEST).is_some() {
                                in_flight.push_back(REQUEST);
                                admitted += 1;
                            } else {
                                break;
                            }
                        }
                        assert!(budget.usage().reserved <= LIMIT);
                        if let Some(done) = in_flight.pop_front() {
                            me.release(done);
                        } else {
                            me.state.wake.wait();
                            me.state.wake.clear();
                        }
                    }
                    admitted
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        // A thread waiting for a grant is woken by the others' releases as they stop.
        let counts: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        eprintln!("admissions per queue: {counts:?}");
        assert!(
            counts.iter().all(|&n| n > 0),
            "a queue was starved: {counts:?}"
        );
        assert_eq!(budget.usage().reserved, 0);
        assert!(budget.usage().peak <= LIMIT);
    }
}
