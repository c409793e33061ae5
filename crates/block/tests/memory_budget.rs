//! Queues under one memory budget: a request that does not fit waits in its queue and
//! completes once others make room (never an error), the queue learns of the room through its
//! eventfd without asking, a queue holding nothing goes before a busy one, and the budget is
//! never passed.

use cryptblk_block::aio::{
    Completion, IoBuffers, IoQueue, IoRequest, OwnedBuffer, Pipeline, QueueOptions,
};
use cryptblk_block::{BlockDevice, BlockError, MemoryBudget};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

const KIB64: usize = 64 << 10;

/// A memory device whose writes wait until the gate opens (so requests stay in flight).
struct GatedDevice {
    data: Mutex<Vec<u8>>,
    open: Mutex<bool>,
    opened: Condvar,
}

impl GatedDevice {
    fn new(size: usize) -> Arc<Self> {
        Arc::new(GatedDevice {
            data: Mutex::new(vec![0; size]),
            open: Mutex::new(false),
            opened: Condvar::new(),
        })
    }

    fn open_gate(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl BlockDevice for GatedDevice {
    fn size(&self) -> u64 {
        self.data.lock().unwrap().len() as u64
    }

    fn read_only(&self) -> bool {
        false
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        let data = self.data.lock().unwrap();
        buf.copy_from_slice(&data[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
        drop(open);
        let mut data = self.data.lock().unwrap();
        data[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&self) -> Result<(), BlockError> {
        Ok(())
    }
}

fn queue(device: &Arc<GatedDevice>, budget: &MemoryBudget) -> Pipeline {
    let device: Arc<dyn BlockDevice> = device.clone();
    let mut queue = Pipeline::synchronous(device, &QueueOptions { depth: 16 }).unwrap();
    assert!(queue.set_budget(Some(budget)));
    queue
}

/// Pushes `n` writes of 64 KiB of `fill` bytes, tagged from `first_tag`, and submits them.
fn push_writes(queue: &mut Pipeline, fill: u8, n: usize, first_tag: u64) {
    let data = Arc::new(OwnedBuffer::from_bytes(&[fill; KIB64]));
    let buf = IoBuffers::whole(data, KIB64).unwrap();
    for i in 0..n {
        let offset = (first_tag as usize + i) * KIB64;
        queue
            .push(&IoRequest::write(
                offset as u64,
                &buf,
                false,
                first_tag + i as u64,
            ))
            .unwrap();
    }
    queue.submit().unwrap();
}

/// Drains `queue` until `n` completions came, waiting as needed.
fn collect(queue: &mut Pipeline, n: usize) -> Vec<Completion> {
    let mut done = Vec::new();
    while done.len() < n {
        queue.drain(&mut |c| done.push(c));
        if done.len() < n {
            queue.wait();
        }
    }
    done
}

/// Whether `fd` becomes readable within `timeout`.
fn readable_within(fd: BorrowedFd<'_>, timeout: Duration) -> bool {
    let mut pfd = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    let timeout = Timespec::try_from(timeout).unwrap();
    poll(&mut pfd, Some(&timeout)) == Ok(1)
}

#[test]
fn requests_over_the_budget_wait_and_all_complete() {
    // Four 64 KiB writes fit; the busy queue pushes eight, the quiet one two.
    let budget = MemoryBudget::new(4 * KIB64 as u64);
    let device = GatedDevice::new(64 * KIB64);
    let mut busy = queue(&device, &budget);
    let mut quiet = queue(&device, &budget);
    push_writes(&mut busy, 1, 8, 0);
    push_writes(&mut quiet, 2, 2, 32);
    let usage = budget.usage();
    assert_eq!(usage.reserved, 4 * KIB64 as u64);
    assert_eq!(usage.waiting, 2, "{usage:?}");
    assert_eq!((busy.in_flight(), quiet.in_flight()), (8, 2));
    // Nothing for the quiet queue yet.
    assert!(!readable_within(
        quiet.notifier(),
        Duration::from_millis(50)
    ));

    device.open_gate();
    // Each queue has its own owner thread. As the busy queue's first four complete and are
    // handed out, the room they leave goes to the quiet queue first (it held nothing), which
    // hears of it through its eventfd, without asking.
    let quiet_owner = std::thread::spawn(move || {
        assert!(readable_within(quiet.notifier(), Duration::from_secs(10)));
        collect(&mut quiet, 2)
    });
    let busy_done = collect(&mut busy, 8);
    let quiet_done = quiet_owner.join().unwrap();
    for c in busy_done.iter().chain(&quiet_done) {
        assert!(c.result.is_ok(), "request {} failed: {:?}", c.tag, c.result);
    }
    let usage = budget.usage();
    assert_eq!((usage.reserved, usage.waiting), (0, 0), "{usage:?}");
    assert!(usage.peak <= usage.limit, "{usage:?}");
    assert!(usage.waits >= 2, "{usage:?}");
    // What was written is there.
    let data = device.data.lock().unwrap();
    assert!(data[7 * KIB64..8 * KIB64].iter().all(|&b| b == 1));
    assert!(data[33 * KIB64..34 * KIB64].iter().all(|&b| b == 2));
}

#[test]
fn a_dropped_queue_gives_its_share_back_to_those_waiting() {
    let budget = MemoryBudget::new(2 * KIB64 as u64);
    let device = GatedDevice::new(64 * KIB64);
    let mut other = queue(&device, &budget);
    {
        let mut gone = queue(&device, &budget);
        push_writes(&mut gone, 4, 2, 0);
        push_writes(&mut other, 3, 1, 8);
        assert_eq!(budget.usage().waiting, 1);
        // Dropping a queue waits for its requests on the device: let them through.
        device.open_gate();
    }
    assert!(readable_within(other.notifier(), Duration::from_secs(10)));
    let done = collect(&mut other, 1);
    assert!(done[0].result.is_ok());
    drop(other);
    assert_eq!(budget.usage().reserved, 0);
}
