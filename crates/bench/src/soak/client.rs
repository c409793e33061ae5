//! The soak's clients: each worker picks a free attached disk, connects (libblkio over
//! vhost-user-blk, or NBD for a share of them), runs a random mix of verified writes and reads
//! of 4-64 KiB, one at a time, for a random few seconds, and leaves. A request whose
//! connection dropped in an upgrade, a kill or a detach is sent again on a new connection,
//! as a VM with reconnect does; a client whose disk was detached moves on.
use super::disks::Disk;
use super::model::{Model, BLOCK};
use super::record::{Recorder, SoakRecord};
use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use cryptblk_testutil::nbd::{NbdClient, NbdError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The largest request, in blocks.
const MAX_BLOCKS: u64 = 16;
/// A request unanswered this long with no event to explain it is a failure.
const STALL: Duration = Duration::from_secs(30);
/// How long a client keeps reconnecting to a disk that should be there.
const RECONNECT: Duration = Duration::from_secs(60);
/// How often a waiting vhost-user request looks whether an event happened.
const POLL: Duration = Duration::from_millis(50);
/// How long a vhost-user handshake may go unanswered, with no event under way, before the
/// disk counts as not accepting (libblkio's connect has no timeout of its own).
const HANDSHAKE: Duration = Duration::from_secs(20);

/// What the workers, the sampler and the events share.
pub struct Fleet {
    pub disks: Vec<Disk>,
    pub nbd_socket: PathBuf,
    /// Bumped before and after every upgrade and kill (odd while one is under way).
    pub daemon_changes: AtomicU64,
    pub stop: AtomicBool,
    pub ops: AtomicU64,
    pub verify_errors: AtomicU64,
    pub client_errors: AtomicU64,
    pub connected: AtomicU32,
    /// Per worker: 1 + when (ns from `t0`) the last request it completed was started.
    pub progress: Vec<AtomicU64>,
    pub t0: Instant,
    /// The share of sessions over NBD instead of vhost-user.
    pub nbd_share: f64,
    pub recorder: Recorder,
}

impl Fleet {
    pub fn now_s(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    pub fn now_ns(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    fn fail(&self, kind: &str, detail: String) {
        eprintln!("soak: {kind} failure: {detail}");
        let counter = if kind == "verify" {
            // Fatal: the run stops at once with the data as it is for a post-mortem.
            self.stop.store(true, Ordering::SeqCst);
            &self.verify_errors
        } else {
            &self.client_errors
        };
        counter.fetch_add(1, Ordering::SeqCst);
        let _ = self.recorder.push(SoakRecord::Failure {
            t_s: self.now_s(),
            kind: kind.into(),
            detail,
        });
    }
}

/// One worker until `fleet.stop`.
pub fn worker(fleet: &Fleet, index: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(0x9e37_79b9).wrapping_add(index as u64));
    let mut buf = vec![0u8; MAX_BLOCKS as usize * BLOCK];
    while !fleet.stop.load(Ordering::SeqCst) {
        let i = rng.gen_range(0..fleet.disks.len());
        let disk = &fleet.disks[i];
        let Some(mut model) = disk.take() else {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        };
        let nbd = rng.gen_bool(fleet.nbd_share);
        let length = Duration::from_secs_f64(rng.gen_range(1.0..5.0));
        session(
            fleet, index, disk, &mut model, &mut rng, &mut buf, nbd, length,
        );
        disk.give_back(model);
    }
}

#[allow(clippy::too_many_arguments)]
fn session(
    fleet: &Fleet,
    worker: usize,
    disk: &Disk,
    model: &mut Model,
    rng: &mut StdRng,
    buf: &mut [u8],
    nbd: bool,
    length: Duration,
) {
    let until = Instant::now() + length;
    let mut conn = connect(fleet, disk, nbd);
    if conn.is_none() {
        return;
    }
    fleet.connected.fetch_add(1, Ordering::SeqCst);
    let result = requests(fleet, worker, disk, model, rng, buf, nbd, until, &mut conn);
    fleet.connected.fetch_sub(1, Ordering::SeqCst);
    if let Some(conn) = conn {
        conn.close();
    }
    if let Err((kind, detail)) = result {
        fleet.fail(kind, detail);
    }
}

/// The session's requests until `until`; a dropped connection is closed before the next one
/// is made (the daemon serves one frontend per disk: a second connection would wait behind
/// the first). `conn` is `None` afterwards if the disk went away.
#[allow(clippy::too_many_arguments)]
fn requests(
    fleet: &Fleet,
    worker: usize,
    disk: &Disk,
    model: &mut Model,
    rng: &mut StdRng,
    buf: &mut [u8],
    nbd: bool,
    until: Instant,
    conn: &mut Option<Conn>,
) -> Result<(), (&'static str, String)> {
    while Instant::now() < until && !fleet.stop.load(Ordering::SeqCst) {
        let count = rng.gen_range(1..=MAX_BLOCKS.min(model.blocks()));
        let first = rng.gen_range(0..=model.blocks() - count);
        let data = &mut buf[..count as usize * BLOCK];
        let generation = rng.gen_bool(0.5).then(|| model.begin_write(first, data));
        let started = fleet.now_ns();
        let transport = loop {
            let Some(c) = conn.as_mut() else {
                // Detached for good: a write stays in doubt in the model.
                return Ok(());
            };
            match c.transfer(
                fleet,
                disk,
                generation.is_some(),
                first * BLOCK as u64,
                data,
            ) {
                Outcome::Done => break c.transport(),
                Outcome::Dropped => {
                    *conn = None;
                    *conn = connect(fleet, disk, nbd);
                }
                Outcome::Failed(why) => {
                    return Err((
                        "client",
                        format!(
                            "disk {} ({}): {why}",
                            disk.name,
                            if nbd { "nbd" } else { "vhost-user" }
                        ),
                    ))
                }
            }
        };
        match generation {
            Some(g) => model.acknowledged(first, count, g),
            None => {
                if let Err(m) = model.check(first, data) {
                    return Err(("verify", format!("{} over {transport}: {m}", disk.name)));
                }
            }
        }
        fleet.ops.fetch_add(1, Ordering::Relaxed);
        fleet.progress[worker].store(started + 1, Ordering::SeqCst);
    }
    Ok(())
}

/// A new connection to `disk`, retried while it should come (the daemon restarting, the disk
/// being added back); `None` if the disk is detached, or did not come back within the bound
/// (a failure).
fn connect(fleet: &Fleet, disk: &Disk, nbd: bool) -> Option<Conn> {
    let since = Instant::now();
    loop {
        let daemon_at = fleet.daemon_changes.load(Ordering::SeqCst);
        let disk_at = disk.changes.load(Ordering::SeqCst);
        if !disk.attached.load(Ordering::SeqCst) && disk_at.is_multiple_of(2) {
            return None;
        }
        let link = if nbd {
            NbdClient::connect(&fleet.nbd_socket, &disk.name)
                .map(Link::Nbd)
                .map_err(|e| e.to_string())
        } else {
            match vhost_handshake(fleet, disk) {
                Some(result) => result.map(Link::Vhost),
                None => {
                    fleet.fail(
                        "client",
                        format!(
                            "disk {}: the daemon left a vhost-user connection unanswered for \
                             {HANDSHAKE:?} with no event under way (not accepted from the \
                             socket's backlog)",
                            disk.name
                        ),
                    );
                    return None;
                }
            }
        };
        match link {
            Ok(link) => {
                return Some(Conn {
                    link,
                    daemon_at,
                    disk_at,
                })
            }
            Err(e) if since.elapsed() > RECONNECT => {
                fleet.fail(
                    "client",
                    format!(
                        "disk {}: no connection for {RECONNECT:?} ({}): {e}",
                        disk.name,
                        if nbd { "nbd" } else { "vhost-user" }
                    ),
                );
                return None;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

enum Outcome {
    Done,
    /// The connection went away under an event: connect again and resend.
    Dropped,
    Failed(String),
}

enum Link {
    Vhost(Vhost),
    Nbd(NbdClient),
}

struct Conn {
    link: Link,
    /// The event counters when it connected.
    daemon_at: u64,
    disk_at: u64,
}

impl Conn {
    /// Whether an event may have cut this connection: one happened since it connected, or
    /// one is under way.
    fn cut(&self, fleet: &Fleet, disk: &Disk) -> bool {
        cut(fleet, disk, self.daemon_at, self.disk_at)
    }

    fn transport(&self) -> &'static str {
        match self.link {
            Link::Vhost(_) => "vhost-user",
            Link::Nbd(_) => "nbd",
        }
    }

    fn transfer(
        &mut self,
        fleet: &Fleet,
        disk: &Disk,
        write: bool,
        offset: u64,
        data: &mut [u8],
    ) -> Outcome {
        let (daemon_at, disk_at) = (self.daemon_at, self.disk_at);
        let result = match &mut self.link {
            Link::Vhost(v) => {
                let since = Instant::now();
                let len = data.len();
                let outcome = v.transfer(write, offset, data, &|| {
                    if cut(fleet, disk, daemon_at, disk_at) {
                        Some(Outcome::Dropped)
                    } else if since.elapsed() > STALL {
                        Some(Outcome::Failed(format!(
                            "a request at {offset}+{len} unanswered for {STALL:?} with no event"
                        )))
                    } else {
                        None
                    }
                });
                return match outcome {
                    // A request failed as its disk went away (disk-remove answers what it
                    // drains): sent again once the disk is back.
                    Outcome::Failed(_) if self.cut(fleet, disk) => Outcome::Dropped,
                    other => other,
                };
            }
            Link::Nbd(c) => {
                if write {
                    c.write(offset, data, false)
                } else {
                    c.read(offset, data.len() as u32).map(|got| {
                        data.copy_from_slice(&got);
                    })
                }
            }
        };
        match result {
            Ok(()) => Outcome::Done,
            Err(NbdError::Io(_)) if self.cut(fleet, disk) => Outcome::Dropped,
            // The server closing the connection shows as a protocol error too.
            Err(_) if self.cut(fleet, disk) => Outcome::Dropped,
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }

    fn close(self) {
        match self.link {
            Link::Nbd(c) => {
                let _ = c.disconnect();
            }
            Link::Vhost(v) => drop(v),
        }
    }
}

/// libblkio's connect and handshake on a thread of its own, so that a daemon that never
/// accepts cannot hang the worker: `None` if it did not finish within [`HANDSHAKE`] (the
/// thread is left blocked; it ends when the daemon closes the socket).
fn vhost_handshake(fleet: &Fleet, disk: &Disk) -> Option<Result<Vhost, String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let socket = disk.socket.clone();
    std::thread::spawn(move || {
        let _ = tx.send(Vhost::connect(&socket));
    });
    let mut quiet = Instant::now();
    loop {
        match rx.recv_timeout(POLL) {
            Ok(result) => return Some(result),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Some(Err("the handshake thread ended without an answer".into()))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let d = fleet.daemon_changes.load(Ordering::SeqCst);
                let k = disk.changes.load(Ordering::SeqCst);
                if !d.is_multiple_of(2) || !k.is_multiple_of(2) {
                    quiet = Instant::now();
                } else if quiet.elapsed() > HANDSHAKE {
                    return None;
                }
            }
        }
    }
}

fn cut(fleet: &Fleet, disk: &Disk, daemon_at: u64, disk_at: u64) -> bool {
    let d = fleet.daemon_changes.load(Ordering::SeqCst);
    let k = disk.changes.load(Ordering::SeqCst);
    d != daemon_at || k != disk_at || !d.is_multiple_of(2) || !k.is_multiple_of(2)
}

/// A libblkio vhost-user-blk connection with one queue and a buffer for the largest request.
struct Vhost {
    queue: Blkioq,
    region: MemoryRegion,
    // Kept last: the queue and the region belong to this instance.
    _blkio: Blkio,
}

impl Vhost {
    fn connect(socket: &std::path::Path) -> Result<Vhost, String> {
        fn e(what: &'static str) -> impl Fn(blkio::Error) -> String {
            move |err| format!("libblkio: {what}: {err}")
        }
        let mut b = Blkio::new("virtio-blk-vhost-user").map_err(e("new"))?;
        let path = socket.to_str().ok_or("socket path is not UTF-8")?;
        b.set_str("path", path).map_err(e("path"))?;
        b.connect().map_err(e("connect"))?;
        b.set_i32("num-queues", 1).map_err(e("num-queues"))?;
        let mut started = b.start().map_err(e("start"))?;
        let region = b
            .alloc_mem_region(MAX_BLOCKS as usize * BLOCK)
            .map_err(e("memory"))?;
        b.map_mem_region(&region).map_err(e("mapping memory"))?;
        let queue = started.queues.pop().ok_or("libblkio started no queue")?;
        Ok(Vhost {
            queue,
            region,
            _blkio: b,
        })
    }

    /// One request; `give_up` is asked while it waits whether to stop waiting.
    fn transfer(
        &mut self,
        write: bool,
        offset: u64,
        data: &mut [u8],
        give_up: &dyn Fn() -> Option<Outcome>,
    ) -> Outcome {
        let buffer = self.region.addr as *mut u8;
        assert!(data.len() <= self.region.len);
        if write {
            // SAFETY: `data.len()` bytes of the mapped region, which no request uses now; the
            // two do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buffer, data.len()) };
            self.queue
                .write(offset, buffer, data.len(), 0, ReqFlags::empty());
        } else {
            self.queue
                .read(offset, buffer, data.len(), 0, ReqFlags::empty());
        }
        let mut done = [MaybeUninit::<Completion>::uninit()];
        loop {
            let mut timeout = POLL;
            match self.queue.do_io(&mut done, 1, Some(&mut timeout), None) {
                Ok(1) => break,
                Ok(_) | Err(_) => {
                    if let Some(outcome) = give_up() {
                        return outcome;
                    }
                }
            }
        }
        // SAFETY: do_io filled in the first entry.
        let c = unsafe { done[0].assume_init_read() };
        if c.ret != 0 {
            return Outcome::Failed(format!(
                "the daemon failed a {} at {offset}+{}: {}",
                if write { "write" } else { "read" },
                data.len(),
                std::io::Error::from_raw_os_error(-c.ret)
            ));
        }
        if !write {
            // SAFETY: the request completed, so nothing writes the region now; `data.len()`
            // bytes of it are mapped.
            unsafe { std::ptr::copy_nonoverlapping(buffer, data.as_mut_ptr(), data.len()) };
        }
        Outcome::Done
    }
}
