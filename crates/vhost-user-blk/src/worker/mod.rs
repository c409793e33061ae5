//! One worker per virtqueue: a thread that owns everything of its ring that the data path
//! touches, driven by messages from the vhost-user message thread.
//!
//! The worker owns the ring handle (from the ring's start to its stop), the ring's kick, its
//! asynchronous I/O queue (an io_uring ring of its own on a raw file or a LUKS volume over
//! one), the requests it has taken, by tag (`take`, `answer`) and the ring's inflight record
//! (`inflight::RingRecord`). Its one epoll waits on three things: the kick (the guest added
//! requests), the I/O queue's eventfd (completions to answer) and its message eventfd. The
//! message thread only sends: the ring started (`Start`, after it read the inflight region),
//! was enabled, is stopping (`Stop`, answered once every request taken is answered), the
//! daemon drains (`Drain`), the connection ended (`Exit`). Nothing the worker owns is
//! behind a lock; the locks a request still takes are not the worker's own: the vring's
//! `RwLock` inside vhost-user-backend (the message thread sets the ring up and reads its
//! index at a stop through it) and whatever the I/O queue beneath takes.
//!
//! Restarts (`inflight`): every head taken from the ring is marked in the inflight record
//! before anything else happens to it and every answer goes through `inflight::add_used`,
//! under the ring's lock; a ring that starts (or is enabled) first resubmits what a
//! predecessor daemon left in the inflight record and signals the guest even with nothing
//! to do.

mod answer;
mod driver;
mod take;

pub use driver::RingDriver;

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use cryptblk_block::aio::{IoBuffers, IoQueue, MemoryOwner};
use cryptblk_block::IoStats;
use vhost_user_backend::{VringRwLock, VringT};
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::event::EventConsumer;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::config::ConfigSpace;
use crate::device::VirtioBlkDevice;
use crate::inflight::{RingRecord, RingStart};
use crate::request::{Request, Segment};
use crate::GuestMem;

/// A ring as the workers and the message thread share it (vhost-user-backend's handle).
pub(crate) type Vring = VringRwLock<GuestMemoryAtomic<GuestMem>>;

/// What requests need, shared by the workers of a connection.
pub(crate) struct RequestContext {
    pub(crate) disk: VirtioBlkDevice,
    /// Config space (the guest's write cache mode).
    pub(crate) config: ConfigSpace,
    /// VIRTIO_RING_F_EVENT_IDX negotiated.
    pub(crate) event_idx: AtomicBool,
    /// Name for log lines.
    pub(crate) name: String,
    /// Busy-poll for completions this long before sleeping (0: never).
    pub(crate) poll: Duration,
}

/// What the message thread tells a worker.
pub(crate) enum Message {
    /// The frontend started the ring (`RingStart`: what the inflight region holds for it).
    Start(Vring, RingStart),
    /// The frontend enabled (true) or disabled the ring.
    Enable(bool),
    /// GET_VRING_BASE: take nothing more from the ring, answer every request taken, then
    /// reply and let the ring go.
    Stop(Sender<()>),
    /// The daemon stops: take no more requests, reply once every request taken is answered
    /// and the guest signalled.
    Drain(Sender<()>),
    /// The connection ended: finish the requests taken, then end the thread.
    Exit,
}

/// The message thread's end of a worker.
pub(crate) struct WorkerHandle {
    messages: Sender<Message>,
    wake: EventFd,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl WorkerHandle {
    /// Starts the worker of queue `index` on its own thread, over the I/O queue `io`.
    pub(crate) fn spawn(
        index: usize,
        ctx: Arc<RequestContext>,
        stats: Arc<IoStats>,
        mem: GuestMemoryAtomic<GuestMem>,
        io: Box<dyn IoQueue>,
        queue_size: u16,
    ) -> io::Result<WorkerHandle> {
        let wake = EventFd::new(EFD_NONBLOCK)?;
        let (messages, inbox) = crossbeam_channel::unbounded();
        let worker = Worker::new(
            index,
            ctx,
            stats,
            mem,
            io,
            queue_size,
            inbox,
            wake.try_clone()?,
        )?;
        let thread = std::thread::Builder::new()
            .name(format!("vu-queue-{index}"))
            .spawn(move || worker.run())?;
        Ok(WorkerHandle {
            messages,
            wake,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub(crate) fn send(&self, message: Message) {
        // A worker that has ended (the connection is closing) needs nothing more.
        if self.messages.send(message).is_ok() {
            let _ = self.wake.write(1);
        }
    }

    /// Sends the message `make` builds around a reply channel and waits for the reply (or for
    /// the worker to end).
    pub(crate) fn call(&self, make: impl FnOnce(Sender<()>) -> Message) {
        let (reply, replied) = crossbeam_channel::bounded(1);
        self.send(make(reply));
        let _ = replied.recv();
    }

    /// Ends the worker once its requests are finished, and waits for it.
    pub(crate) fn exit(&self) {
        self.send(Message::Exit);
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = thread {
            if thread.join().is_err() {
                tracing::error!("a vhost-user queue worker panicked");
            }
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.exit();
    }
}

/// A request between pop and answer.
struct Pending {
    head: u16,
    req: Request,
    segments: Vec<Segment>,
    start: Instant,
    /// The memory table the request's buffers point into, kept mapped until it completes
    /// (a SET_MEM_TABLE meanwhile must not unmap what the kernel is writing into).
    mem: Arc<GuestMem>,
}

/// The ring while it runs: between `Message::Start` and the answer to `Message::Stop`.
struct Ring {
    vring: Vring,
    /// The ring's kick, duplicated so that the descriptor in the epoll is the worker's own.
    kick: Option<EventConsumer>,
    record: Option<RingRecord>,
    /// Heads a predecessor took and did not complete, oldest first, not resubmitted yet.
    resubmit: Vec<u16>,
    /// Started or enabled since the worker last served the ring: resubmit, signal.
    start_seen: bool,
}

/// Someone waiting for the worker to have no request outstanding.
enum Waiter {
    Stop(Sender<()>),
    Drain(Sender<()>),
}

/// Epoll tokens.
const MESSAGES: u64 = 0;
const KICK: u64 = 1;
const COMPLETIONS: u64 = 2;

/// The worker of one virtqueue (see the module doc); lives on its thread.
struct Worker {
    index: usize,
    ctx: Arc<RequestContext>,
    stats: Arc<IoStats>,
    /// The memory table (shared with the message thread, which replaces what it holds;
    /// reading it is a lock-free load).
    mem: GuestMemoryAtomic<GuestMem>,
    io: Box<dyn IoQueue>,
    ring: Option<Ring>,
    /// Requests taken and not answered yet, by tag; a virtqueue of size N holds at most N.
    requests: Vec<Option<Pending>>,
    free: Vec<u16>,
    /// Spare segment lists, so popping allocates nothing in steady state.
    spare_segments: Vec<Vec<Segment>>,
    /// The buffers of the request being taken (reused; the queue keeps its own copy).
    buffers: IoBuffers,
    /// The owner of buffers in the memory table last seen (rebuilt when the table changes).
    ram: Option<(Arc<GuestMem>, Arc<dyn MemoryOwner>)>,
    /// Requests pushed since the last submit, and the bytes they write.
    unsubmitted: usize,
    unsubmitted_bytes: u64,
    /// Take no more requests from the ring (`Drain`, `Exit`).
    draining: bool,
    waiters: Vec<Waiter>,
    inbox: Receiver<Message>,
    wake: EventFd,
    epoll: Epoll,
}

impl Worker {
    #[allow(clippy::too_many_arguments)]
    fn new(
        index: usize,
        ctx: Arc<RequestContext>,
        stats: Arc<IoStats>,
        mem: GuestMemoryAtomic<GuestMem>,
        io: Box<dyn IoQueue>,
        queue_size: u16,
        inbox: Receiver<Message>,
        wake: EventFd,
    ) -> io::Result<Worker> {
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            wake.as_raw_fd(),
            EpollEvent::new(EventSet::IN, MESSAGES),
        )?;
        epoll.ctl(
            ControlOperation::Add,
            io.notifier().as_raw_fd(),
            EpollEvent::new(EventSet::IN, COMPLETIONS),
        )?;
        Ok(Worker {
            index,
            ctx,
            stats,
            mem,
            io,
            ring: None,
            requests: (0..queue_size).map(|_| None).collect(),
            free: (0..queue_size).rev().collect(),
            spare_segments: Vec::new(),
            buffers: IoBuffers::with_capacity(8),
            ram: None,
            unsubmitted: 0,
            unsubmitted_bytes: 0,
            draining: false,
            waiters: Vec::new(),
            inbox,
            wake,
            epoll,
        })
    }

    /// Requests taken from the ring and not answered yet.
    fn outstanding(&self) -> usize {
        self.requests.len() - self.free.len()
    }

    fn run(mut self) {
        let mut events = [EpollEvent::default(); 3];
        let mut exit = false;
        while !exit {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!(disk = %self.ctx.name, "queue {}: epoll: {e}", self.index);
                    break;
                }
            };
            for event in &events[..n] {
                let result = match event.data() {
                    MESSAGES => {
                        exit |= self.read_messages();
                        Ok(())
                    }
                    KICK => self.kicked(),
                    _ => self.completions(),
                };
                if let Err(e) = result {
                    // The ring is unusable (e.g. the frontend reset it); the connection's
                    // next message or its end sorts that out.
                    tracing::warn!(disk = %self.ctx.name, "queue {}: {e}", self.index);
                }
            }
            self.settle();
        }
        self.finish();
    }

    /// Handles the messages waiting; true once told to exit.
    fn read_messages(&mut self) -> bool {
        let _ = self.wake.read();
        let mut exit = false;
        while let Ok(message) = self.inbox.try_recv() {
            let result = match message {
                Message::Start(vring, start) => self.start(vring, start),
                Message::Enable(true) => self.enabled(),
                Message::Enable(false) => Ok(()),
                Message::Stop(reply) => self.stop(reply),
                Message::Drain(reply) => {
                    self.draining = true;
                    self.waiters.push(Waiter::Drain(reply));
                    Ok(())
                }
                Message::Exit => {
                    self.draining = true;
                    exit = true;
                    Ok(())
                }
            };
            if let Err(e) = result {
                tracing::warn!(disk = %self.ctx.name, "queue {}: {e}", self.index);
            }
        }
        exit
    }

    /// The ring started: watch its kick; serve it at once when it is already enabled.
    fn start(&mut self, vring: Vring, start: RingStart) -> io::Result<()> {
        self.let_ring_go();
        let kick = match vring.get_ref().get_kick() {
            Some(kick) => Some(kick.try_clone()?),
            None => None,
        };
        if let Some(kick) = &kick {
            self.epoll.ctl(
                ControlOperation::Add,
                kick.as_raw_fd(),
                EpollEvent::new(EventSet::IN, KICK),
            )?;
        }
        let enabled = vring.get_ref().is_enabled();
        self.ring = Some(Ring {
            vring,
            kick,
            record: start.record,
            resubmit: start.resubmit,
            start_seen: true,
        });
        if enabled {
            self.serve_ring()?;
        }
        Ok(())
    }

    /// The ring was enabled: served as if just started (resubmits, a signal), which also
    /// takes what the guest added while it was disabled.
    fn enabled(&mut self) -> io::Result<()> {
        match &mut self.ring {
            Some(ring) => {
                ring.start_seen = true;
                self.serve_ring()
            }
            None => Ok(()),
        }
    }

    /// The guest kicked the ring.
    fn kicked(&mut self) -> io::Result<()> {
        let Some(ring) = &self.ring else {
            return Ok(());
        };
        // Consumes the kick; a disabled ring is not served (its enable will).
        if ring.vring.read_kick()? {
            self.serve_ring()?;
        }
        Ok(())
    }

    /// GET_VRING_BASE: a ring stopped before the worker served its start still owes the
    /// requests a predecessor left in the inflight record; they run now (the ring takes no new ones). The
    /// reply waits until everything taken is answered.
    fn stop(&mut self, reply: Sender<()>) -> io::Result<()> {
        let mut result = Ok(());
        if let Some(ring) = &mut self.ring {
            if let Some(kick) = ring.kick.take() {
                let _ = self.epoll.ctl(
                    ControlOperation::Delete,
                    kick.as_raw_fd(),
                    EpollEvent::default(),
                );
            }
            let resubmit = std::mem::take(&mut ring.resubmit);
            if !resubmit.is_empty() {
                result = self.take_and_submit(&resubmit);
            }
        }
        // A stopped ring takes nothing until it starts again, maybe with a new memory table:
        // the old one is not kept mapped for it (requests in flight keep their own).
        self.buffers.clear();
        self.ram = None;
        self.waiters.push(Waiter::Stop(reply));
        result
    }

    /// Answers who waits for the worker to be idle, once it is.
    fn settle(&mut self) {
        if self.waiters.is_empty() || self.outstanding() > 0 {
            return;
        }
        for waiter in std::mem::take(&mut self.waiters) {
            match waiter {
                Waiter::Stop(reply) => {
                    self.let_ring_go();
                    let _ = reply.send(());
                }
                Waiter::Drain(reply) => {
                    // Whether or not the guest asked for a notification: a frontend that
                    // disconnects next sees every completion.
                    if let Some(ring) = &self.ring {
                        if let Err(e) = ring.vring.signal_used_queue() {
                            tracing::warn!("queue {}: signalling the guest: {e}", self.index);
                        }
                    }
                    let _ = reply.send(());
                }
            }
        }
    }

    /// Forgets the ring (stopped, or replaced by a new start).
    fn let_ring_go(&mut self) {
        if let Some(kick) = self.ring.take().and_then(|ring| ring.kick) {
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                kick.as_raw_fd(),
                EpollEvent::default(),
            );
        }
    }

    /// The connection ended: requests still on the device complete (and are answered, while the
    /// ring is there) before the memory they point into is released and the I/O queue closes.
    fn finish(&mut self) {
        self.answer_outstanding();
        self.settle();
        self.let_ring_go();
    }

    /// Waits for every request taken and answers it.
    fn answer_outstanding(&mut self) {
        while self.outstanding() > 0 {
            self.io.wait();
            if self.answer_completions().total == 0 && self.io.in_flight() == 0 {
                // Nothing the I/O queue still holds: what is left cannot complete.
                break;
            }
        }
    }
}

/// Whether atomics say EVENT_IDX is on.
fn event_idx(ctx: &RequestContext) -> bool {
    ctx.event_idx.load(Ordering::Relaxed)
}
