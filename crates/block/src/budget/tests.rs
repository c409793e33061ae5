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
fn requests_are_served_from_the_share_s_credit_which_goes_back_when_idle() {
    let budget = MemoryBudget::new(1 << 30);
    let mut a = share(&budget);
    // The first 4 KiB request reserves a chunk; the next ones come out of it.
    assert_eq!(a.try_reserve(4096), Some(4096));
    assert_eq!(budget.usage().reserved, CREDIT_CHUNK);
    for _ in 1..64 {
        assert_eq!(a.try_reserve(4096), Some(4096));
    }
    assert_eq!(budget.usage().reserved, CREDIT_CHUNK);
    assert_eq!(a.try_reserve(4096), Some(4096));
    assert_eq!(budget.usage().reserved, 2 * CREDIT_CHUNK);
    // Released: kept as credit up to two chunks, one chunk kept when more comes back.
    for _ in 0..65 {
        a.release(4096);
    }
    assert_eq!(budget.usage().reserved, 2 * CREDIT_CHUNK);
    assert_eq!(a.held(), 2 * CREDIT_CHUNK);
    a.return_credit();
    assert_eq!((a.held(), budget.usage().reserved), (0, 0));
    // While anyone waits, what a request gives back goes to the budget at once.
    let small = MemoryBudget::new(64 * CREDIT_CHUNK);
    let mut busy = share(&small);
    let mut waiter = share(&small);
    assert_eq!(busy.try_reserve(63 * CREDIT_CHUNK), Some(63 * CREDIT_CHUNK));
    assert_eq!(busy.try_reserve(4096), Some(4096));
    assert_eq!(small.usage().reserved, 64 * CREDIT_CHUNK);
    assert!(waiter.try_reserve(CREDIT_CHUNK).is_none());
    busy.release(4096);
    assert_eq!(waiter.take_grant(), CREDIT_CHUNK);
    assert_eq!(busy.held(), 63 * CREDIT_CHUNK);
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
fn room_goes_to_whoever_holds_least_until_the_shares_even_out() {
    let budget = MemoryBudget::new(100);
    let mut greedy = share(&budget);
    let mut modest = share(&budget);
    // The greedy queue took 80 while nobody waited; the modest one 10.
    assert_eq!(greedy.try_reserve(80), Some(80));
    assert_eq!(modest.try_reserve(10), Some(10));
    assert_eq!(greedy.try_reserve(10), Some(10));
    assert!(greedy.try_reserve(10).is_none());
    assert!(modest.try_reserve(10).is_none());
    // Each release goes to the modest queue while it holds less, though the greedy one
    // waited first.
    for expected_modest in [20, 30, 40, 50] {
        greedy.release(10);
        assert_eq!(modest.take_grant(), 10);
        assert_eq!(modest.held(), expected_modest);
        assert!(modest.try_reserve(10).is_none());
    }
    assert_eq!(greedy.take_grant(), 0);
    // Now the greedy one (40 + its 10 waited for) and the modest one (50) are even.
    greedy.release(10);
    assert_eq!((greedy.take_grant(), modest.take_grant()), (10, 0));
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
