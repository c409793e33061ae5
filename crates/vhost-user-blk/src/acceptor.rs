//! One thread that accepts frontends on every disk's listening socket.
//!
//! Each listener is in one epoll set, armed one-shot: after an event it stays quiet until the
//! acceptor arms it again, which it does at once when nothing was accepted (a refused peer, a
//! connection that vanished) and otherwise only when that frontend's connection has ended. So
//! a disk serves one frontend at a time (a second one waits in the socket's backlog, as
//! before), and an idle disk costs a socket and no thread: the connection's thread, its
//! vhost-user message thread and its queue workers exist while the frontend is connected.
//!
//! A daemon handing its disks to a successor (an upgrade) needs nothing of the acceptor: the
//! successor serves a disk's listener only once this daemon has stopped serving that disk
//! (`Served::stop`), which takes the listener out of the epoll set.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::server::{Server, StopHandle};
use crate::Error;

/// Told when a disk's connection fails in a way that is not the frontend's doing (its I/O
/// queues cannot be opened, a thread cannot start): the disk then accepts no one else.
pub type FailureListener = Box<dyn Fn(Error) + Send + Sync>;

/// The token of the acceptor's own wake-up eventfd; disks count from 1.
const WAKE: u64 = 0;

/// The accepting thread of a daemon; cheap to clone.
#[derive(Clone)]
pub struct Acceptor {
    inner: Arc<Inner>,
}

struct Inner {
    epoll: Epoll,
    wake: EventFd,
    quit: AtomicBool,
    disks: Mutex<HashMap<u64, Arc<Listening>>>,
    next_token: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// A disk in the acceptor.
struct Listening {
    server: Server,
    token: u64,
    state: Mutex<ConnectionState>,
    on_failure: Option<FailureListener>,
}

#[derive(Default)]
struct ConnectionState {
    /// `Served::stop` has begun: accept nothing more.
    stopping: bool,
    /// A connection thread is serving a frontend (the listener is disarmed meanwhile).
    serving: bool,
    thread: Option<JoinHandle<()>>,
}

/// A disk being served by an acceptor.
pub struct Served {
    inner: Arc<Inner>,
    listening: Arc<Listening>,
}

impl Acceptor {
    /// Starts the accepting thread (with no disk yet).
    pub fn start() -> Result<Acceptor, Error> {
        let inner = Arc::new(Inner {
            epoll: Epoll::new()?,
            wake: EventFd::new(EFD_NONBLOCK)?,
            quit: AtomicBool::new(false),
            disks: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(WAKE + 1),
            thread: Mutex::new(None),
        });
        inner.epoll.ctl(
            ControlOperation::Add,
            inner.wake.as_raw_fd(),
            EpollEvent::new(EventSet::IN, WAKE),
        )?;
        let looping = inner.clone();
        let thread = std::thread::Builder::new()
            .name("vhost-accept".into())
            .spawn(move || looping.run())?;
        *lock(&inner.thread) = Some(thread);
        Ok(Acceptor { inner })
    }

    /// Starts accepting frontends for `server`'s disk.
    pub fn serve(
        &self,
        server: Server,
        on_failure: Option<FailureListener>,
    ) -> Result<Served, Error> {
        let token = self.inner.next_token.fetch_add(1, Ordering::Relaxed);
        let listening = Arc::new(Listening {
            server,
            token,
            state: Mutex::new(ConnectionState::default()),
            on_failure,
        });
        lock(&self.inner.disks).insert(token, listening.clone());
        if let Err(e) = self.inner.epoll.ctl(
            ControlOperation::Add,
            listening.server.listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN | EventSet::ONE_SHOT, token),
        ) {
            lock(&self.inner.disks).remove(&token);
            return Err(e.into());
        }
        Ok(Served {
            inner: self.inner.clone(),
            listening,
        })
    }

    /// Ends the accepting thread (the disks should have been stopped first).
    pub fn shutdown(&self) {
        self.inner.quit.store(true, Ordering::SeqCst);
        let _ = self.inner.wake.write(1);
        let thread = lock(&self.inner.thread).take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

impl Inner {
    fn run(self: Arc<Self>) {
        let mut events = vec![EpollEvent::default(); 64];
        loop {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("vhost-user acceptor: epoll_wait: {e}");
                    return;
                }
            };
            for event in &events[..n] {
                if event.data() == WAKE {
                    let _ = self.wake.read();
                    if self.quit.load(Ordering::SeqCst) {
                        return;
                    }
                    continue;
                }
                let listening = lock(&self.disks).get(&event.data()).cloned();
                if let Some(listening) = listening {
                    self.accept(&listening);
                }
            }
        }
    }

    /// Takes the pending connection of a listener that fired (it is disarmed now).
    fn accept(self: &Arc<Self>, listening: &Arc<Listening>) {
        let server = &listening.server;
        match crate::accept::accept_allowed(
            &server.listener,
            &server.opts.allowed_peer,
            &server.path,
        ) {
            Ok(Some(stream)) => {
                let mut state = lock(&listening.state);
                if state.stopping {
                    return;
                }
                // A previous connection's thread has ended (it armed the listener as its last
                // step); reap it.
                if let Some(previous) = state.thread.take() {
                    let _ = previous.join();
                }
                let inner = self.clone();
                let conn = listening.clone();
                let spawned = std::thread::Builder::new()
                    .name(thread_name(&server.opts.name))
                    .spawn(move || {
                        let result = conn.server.serve_connection(stream);
                        lock(&conn.state).serving = false;
                        match result {
                            Ok(()) => inner.arm_unless_busy(&conn),
                            Err(e) => conn.fail(e),
                        }
                    });
                match spawned {
                    Ok(thread) => {
                        state.serving = true;
                        state.thread = Some(thread);
                    }
                    Err(e) => {
                        drop(state);
                        listening.fail(e.into());
                    }
                }
            }
            Ok(None) => self.arm_unless_busy(listening),
            Err(e) => listening.fail(e.into()),
        }
    }

    /// Arms the listener unless its disk is serving a frontend or stopping.
    fn arm_unless_busy(&self, listening: &Listening) {
        let state = lock(&listening.state);
        if state.serving || state.stopping {
            return;
        }
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Modify,
            listening.server.listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN | EventSet::ONE_SHOT, listening.token),
        ) {
            tracing::error!(
                "vhost-user socket {}: cannot watch for frontends: {e}",
                listening.server.path.display()
            );
        }
    }
}

impl Listening {
    fn fail(&self, e: Error) {
        match &self.on_failure {
            Some(tell) => tell(e),
            None => tracing::error!(
                "vhost-user socket {}: {e}; accepting no more frontends",
                self.server.path.display()
            ),
        }
    }
}

impl Served {
    pub fn stop_handle(&self) -> StopHandle {
        self.listening.server.stop_handle()
    }

    /// Stops serving the disk: no new frontend, the current one's requests answered and its
    /// connection closed, the disk flushed, the socket file removed (unless handed over).
    pub fn stop(&self) -> Result<(), Error> {
        lock(&self.listening.state).stopping = true;
        let _ = self.inner.epoll.ctl(
            ControlOperation::Delete,
            self.listening.server.listener.as_raw_fd(),
            EpollEvent::default(),
        );
        lock(&self.inner.disks).remove(&self.listening.token);
        self.stop_handle().stop();
        let thread = lock(&self.listening.state).thread.take();
        if let Some(thread) = thread {
            if thread.join().is_err() {
                return Err(Error::Daemon(
                    "the vhost-user connection thread panicked".into(),
                ));
            }
        }
        self.listening.server.finish()
    }

    /// The listening socket and its file's identity, to hand over to a successor daemon.
    pub fn listener(
        &self,
    ) -> (
        std::os::fd::BorrowedFd<'_>,
        cryptblk_net::unix_socket::FileId,
    ) {
        (
            self.listening.server.listener_fd(),
            self.listening.server.file_id(),
        )
    }

    /// Becomes ready when `StopHandle::stop` is called (for `Server::run`).
    pub(crate) fn stopped_signal(&self) -> crossbeam_channel::Receiver<()> {
        self.listening.server.shared.stopped.1.clone()
    }
}

/// A thread name of at most 15 bytes (the kernel cuts longer ones) that still tells disks
/// apart: "vhost-" and the start of the disk's name.
fn thread_name(disk: &str) -> String {
    let mut name = String::from("vhost-");
    for c in disk.chars() {
        if name.len() + c.len_utf8() > 15 {
            break;
        }
        name.push(c);
    }
    name
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
