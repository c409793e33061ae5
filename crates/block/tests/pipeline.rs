//! A pipeline's stages: a request passes the range check and each stage once, in order; a
//! stage that finishes a request keeps it from the stages behind it and from the device; the
//! stages that passed a request on see it complete, innermost first; and a queue dropped with
//! requests it never handed out lets them go in every stage that passed them on.

mod common;

use common::MemDevice;
use cryptblk_block::aio::{
    run_one, Admit, IoBuffers, IoOp, IoQueue, IoRequest, MemoryOwner, OwnedBuffer, Pipeline,
    QueueOptions, SlotRequest, Stage,
};
use cryptblk_block::{BlockDevice, BlockError, BlockErrorKind};
use std::sync::{Arc, Mutex};

type Log = Arc<Mutex<Vec<String>>>;

/// Records what it sees; finishes discards itself (successfully) when `finishes_discards`.
struct Recorder {
    name: &'static str,
    log: Log,
    finishes_discards: bool,
}

impl Recorder {
    fn note(&self, what: &str, req: &SlotRequest) {
        let line = format!("{} {what} {}", self.name, req.op.name());
        self.log.lock().unwrap().push(line);
    }
}

impl Stage for Recorder {
    fn admit(&mut self, _: usize, caller: &SlotRequest, transfer: &mut SlotRequest) -> Admit {
        self.note("admit", caller);
        if self.finishes_discards && transfer.op == IoOp::Discard {
            return Admit::Finish(Ok(()));
        }
        Admit::Pass
    }

    fn complete(&mut self, _: usize, caller: &SlotRequest, _: &mut Result<(), BlockError>) -> u64 {
        self.note("complete", caller);
        0
    }

    fn abandon(&mut self, _: usize, caller: &SlotRequest) {
        self.note("abandon", caller);
    }
}

fn pipeline(log: &Log) -> Pipeline {
    let device: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(1 << 20));
    let mut pipeline = Pipeline::synchronous(device, &QueueOptions { depth: 4 }).unwrap();
    for (name, finishes_discards) in [("inner", true), ("outer", false)] {
        pipeline.push_front(Box::new(Recorder {
            name,
            log: log.clone(),
            finishes_discards,
        }));
    }
    pipeline
}

fn take(log: &Log) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

#[test]
fn stages_see_each_request_once_in_order_and_a_finish_stops_it() {
    let log = Log::default();
    let mut queue = pipeline(&log);
    let buf = IoBuffers::whole(Arc::new(OwnedBuffer::from_bytes(&[7; 4096])), 4096).unwrap();
    run_one(&mut queue, &IoRequest::write(0, &buf, false, 1)).unwrap();
    assert_eq!(
        take(&log),
        [
            "outer admit write",
            "inner admit write",
            "inner complete write",
            "outer complete write"
        ]
    );
    // The memory device cannot discard: success means the request never reached it.
    let discard = IoRequest::range(IoOp::Discard, 0, 4096, 2);
    run_one(&mut queue, &discard).unwrap();
    assert_eq!(
        take(&log),
        [
            "outer admit discard",
            "inner admit discard",
            "outer complete discard"
        ]
    );
    // Refused by the range check, before any stage.
    let err = run_one(&mut queue, &IoRequest::read(1 << 20, &buf, 3)).unwrap_err();
    assert_eq!(err.kind(), BlockErrorKind::OutOfRange, "{err}");
    assert!(take(&log).is_empty());
    assert_eq!(queue.in_flight(), 0);
}

#[test]
fn a_dropped_queue_lets_its_uncollected_requests_go_in_every_stage() {
    let log = Log::default();
    let mut queue = pipeline(&log);
    let buf = IoBuffers::whole(Arc::new(OwnedBuffer::from_bytes(&[7; 4096])), 4096).unwrap();
    queue.push(&IoRequest::write(0, &buf, false, 1)).unwrap();
    queue.submit().unwrap();
    drop(queue);
    assert_eq!(
        take(&log),
        [
            "outer admit write",
            "inner admit write",
            "inner abandon write",
            "outer abandon write"
        ]
    );
}

/// Counts the bytes of the reads and writes it has passed on and not seen complete, and the
/// most at once.
#[derive(Default)]
struct Held {
    now: u64,
    most: u64,
}

struct HeldBytes(Arc<Mutex<Held>>);

impl Stage for HeldBytes {
    fn admit(&mut self, _: usize, caller: &SlotRequest, _: &mut SlotRequest) -> Admit {
        let mut held = self.0.lock().unwrap();
        held.now += caller.len;
        held.most = held.most.max(held.now);
        Admit::Pass
    }

    fn complete(&mut self, _: usize, caller: &SlotRequest, _: &mut Result<(), BlockError>) -> u64 {
        self.0.lock().unwrap().now -= caller.len;
        0
    }
}

#[test]
fn a_queue_full_of_large_writes_holds_at_most_the_data_budget_and_runs_them_all() {
    const WRITE: usize = 12 << 20;
    const WRITES: usize = 6;
    let device: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(WRITE * WRITES));
    let mut queue = Pipeline::synchronous(device.clone(), &QueueOptions { depth: 8 }).unwrap();
    let held = Arc::new(Mutex::new(Held::default()));
    queue.push_front(Box::new(HeldBytes(held.clone())));
    for i in 0..WRITES {
        let data = OwnedBuffer::from_bytes(&vec![i as u8 + 1; WRITE]);
        let buf = IoBuffers::whole(Arc::new(data), WRITE).unwrap();
        // The queue keeps the memory: the caller's handle goes at once.
        queue
            .push(&IoRequest::write((i * WRITE) as u64, &buf, false, i as u64))
            .unwrap();
    }
    queue.submit().unwrap();
    let mut done = Vec::new();
    while done.len() < WRITES {
        queue.wait();
        queue.drain(&mut |c| {
            c.result.unwrap();
            done.push(c.tag);
        });
    }
    done.sort();
    assert_eq!(done, (0..WRITES as u64).collect::<Vec<_>>());
    let most = held.lock().unwrap().most;
    assert!(
        most <= cryptblk_block::aio::DATA_BUDGET,
        "{most} bytes of writes held at once, over the budget of {}",
        cryptblk_block::aio::DATA_BUDGET
    );
    assert!(
        most >= 2 * WRITE as u64,
        "writes ran one by one ({most} bytes at most)"
    );
    let mut back = vec![0u8; WRITE];
    for i in 0..WRITES {
        device.read_at(&mut back, (i * WRITE) as u64).unwrap();
        assert!(
            back.iter().all(|&b| b == i as u8 + 1),
            "write {i} did not land"
        );
    }
}

#[test]
fn a_request_keeps_its_memory_until_its_completion_is_handed_out_and_no_longer() {
    let log = Log::default();
    let mut queue = pipeline(&log);
    let owner = Arc::new(OwnedBuffer::zeroed(8192));
    let alive = Arc::downgrade(&owner);
    let mut buffers = IoBuffers::new();
    buffers.set_owner(owner);
    buffers.add(4096, 4096).unwrap();
    queue.push(&IoRequest::read(0, &buffers, 1)).unwrap();
    // The frontend lets go of its handles (a vhost-user memory table replaced meanwhile).
    drop(buffers);
    queue.submit().unwrap();
    while queue.in_flight() > 0 {
        queue.wait();
        assert!(
            alive.upgrade().is_some(),
            "memory of a request in flight was freed"
        );
        queue.drain(&mut |c| {
            c.result.unwrap();
            assert!(
                alive.upgrade().is_none(),
                "the queue still holds a completed request's memory"
            );
        });
    }
}

#[test]
fn a_buffer_outside_its_memory_never_reaches_a_queue() {
    // A malicious descriptor: a guest address past the end of what the owner maps.
    let owner: Arc<dyn MemoryOwner> = Arc::new(OwnedBuffer::zeroed(4096));
    let mut buffers = IoBuffers::new();
    buffers.set_owner(owner);
    let err = buffers.add(4000, 200).unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    assert_eq!(buffers.len(), 0);
}
