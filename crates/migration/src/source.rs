//! The source side of a migration: one sender thread that owns the outgoing half of every
//! channel, plus a reader thread per channel for what the destination says.
//!
//! ```text
//! connect bulk (+ urgent with preempt), Hello both ways
//! header ............................... Chunk*           (never dirtied: header changes are
//!                                                          refused while migrating)
//! precopy sweeps ....................... Chunk/Zero* PassDone, again and again, each sweep
//!                                        taking what the guest dirtied since
//! switchover (frontend stopped or asked; the disk is fenced first)
//!   precopy mode:   remaining dirty ..... Chunk/Zero*, Complete  <-- Complete (flushed)
//!   postcopy mode:  Missing* Postcopy    (destination live; it asks with Request for what a
//!                                         read needs, answered first, on the urgent channel
//!                                         with preempt, between bulk slices with break-chunks)
//!                   rest of the bulk .... Chunk*, Complete       <-- Complete (flushed)
//! ```
//!
//! Failures: before the destination is live (precopy, or a precopy-mode switchover that did not
//! get its Complete back), the source simply carries on: tracking stops and the disk is
//! unfenced. In postcopy the destination holds the newest data, so a broken channel *pauses*
//! the migration until [`SourceMigration::recover`] reconnects and the destination says what it
//! still lacks.

use crate::channel::{self, Channel, Closer, MigrationAddress};
use crate::link::Link;
use crate::wire::{self, Frame, Hello, Role, WireError, FLAG_POSTCOPY, FLAG_PREEMPT};
use crate::wire::{MAX_CHUNK_LEN, PROTOCOL_VERSION, SESSION_ID_LEN};
use crate::{DirtyBitmap, DirtyTracker, MigrationError, Phase};
use cryptblk_block::{BlockDevice, ExtentKind};
use rustls::ClientConfig;
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most urgent requests queued at once (a destination has at most one per waiting read).
const MAX_QUEUED_URGENT: usize = 1 << 16;

/// How a migration is sent.
#[derive(Debug, Clone)]
pub struct SourceOptions {
    /// Bulk chunk size (4 KiB ..= 64 MiB): the unit read from the image and checksummed.
    pub chunk_size: usize,
    /// Cap on bytes per second over all channels together (the link); `None`: no cap.
    pub max_bandwidth: Option<u64>,
    /// Allow switching over in postcopy mode (send only what is missing, fetch on demand).
    pub postcopy: bool,
    /// Urgent requests on a connection of their own.
    pub preempt: bool,
    /// With preempt: interrupt a bulk chunk between slices to answer an urgent request
    /// (on by default; off only to measure what it brings).
    pub break_chunks: bool,
    /// Bulk data goes to the socket in slices of this many bytes.
    pub slice_size: usize,
    /// Precopy passes (the first, full one included) before resending stops until the
    /// switchover; 0 for no limit.
    pub max_passes: u32,
    pub tls: Option<Arc<ClientConfig>>,
    /// Bound on each connect, TLS handshake and Hello exchange with the destination (a peer
    /// that accepts and never answers fails the start or recovery after this long).
    pub connect_timeout: Duration,
}

impl Default for SourceOptions {
    fn default() -> Self {
        SourceOptions {
            chunk_size: 2 << 20,
            max_bandwidth: None,
            postcopy: false,
            preempt: false,
            break_chunks: true,
            slice_size: 16 << 10,
            max_passes: 30,
            tls: None,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

impl SourceOptions {
    fn validate(&self) -> Result<(), MigrationError> {
        if !(4096..=MAX_CHUNK_LEN).contains(&self.chunk_size) {
            return Err(MigrationError::InvalidOptions(format!(
                "chunk size {} is not within 4096..={MAX_CHUNK_LEN}",
                self.chunk_size
            )));
        }
        if self.slice_size == 0 {
            return Err(MigrationError::InvalidOptions(
                "slice size must be positive".into(),
            ));
        }
        if self.max_bandwidth == Some(0) {
            return Err(MigrationError::InvalidOptions(
                "max bandwidth must be positive".into(),
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(MigrationError::InvalidOptions(
                "connect timeout must be positive".into(),
            ));
        }
        if self.preempt && !self.postcopy {
            return Err(MigrationError::InvalidOptions(
                "preempt needs postcopy: urgent requests only exist in postcopy".into(),
            ));
        }
        Ok(())
    }
}

/// A snapshot of the source's progress.
#[derive(Debug, Clone)]
pub struct SourceStatus {
    pub phase: Phase,
    /// Why the migration failed or paused.
    pub error: Option<String>,
    pub bytes_sent: u64,
    pub zero_bytes: u64,
    pub chunks: u64,
    /// Sweeps over the disk completed (the first one sends everything).
    pub passes: u32,
    /// Blocks the destination does not have yet (dirty in precopy, missing in postcopy).
    pub dirty_blocks: u64,
    pub dirty_bytes: u64,
    pub granularity: u64,
    pub elapsed: Duration,
    pub throughput_bytes_per_sec: f64,
    /// Urgent requests answered.
    pub urgent_served: u64,
    /// From fencing the disk to the destination being able to serve it.
    pub downtime: Option<Duration>,
    pub postcopy: bool,
    pub preempt: bool,
}

struct State {
    phase: Phase,
    error: Option<String>,
    bytes_sent: u64,
    zero_bytes: u64,
    chunks: u64,
    passes: u32,
    urgent_served: u64,
    urgent: VecDeque<(u64, u64)>,
    /// `Some(postcopy)` once a switchover was asked for.
    switchover: Option<bool>,
    fenced_at: Option<Instant>,
    downtime: Option<Duration>,
    cancel: bool,
    /// The destination confirmed Complete.
    peer_complete: bool,
    /// Channels of the current generation broke (reader saw an error or an Error frame).
    broken: Option<String>,
    generation: u64,
    /// New channels from `recover`, for the sender to take.
    recovered: Option<Channels>,
    finished_at: Option<Instant>,
    /// The bulk sender is inside a chunk (without break-chunks, urgent answers wait for it).
    bulk_in_chunk: bool,
}

struct Shared {
    state: Mutex<State>,
    cond: Condvar,
    file: Arc<dyn BlockDevice>,
    tracker: Arc<DirtyTracker>,
    opts: SourceOptions,
    session: [u8; SESSION_ID_LEN],
    started: Instant,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bitmap(&self) -> &DirtyBitmap {
        self.tracker
            .bitmap()
            .expect("tracking started before the sender runs")
    }

    fn hello(&self, role: Role) -> Hello {
        let mut flags = 0;
        if self.opts.postcopy {
            flags |= FLAG_POSTCOPY;
        }
        if self.opts.preempt {
            flags |= FLAG_PREEMPT;
        }
        Hello {
            version: PROTOCOL_VERSION,
            disk_size_bytes: self.file.size(),
            granularity: self.tracker.granularity() as u32,
            header_len: self.tracker.payload_offset(),
            role,
            flags,
            session: self.session,
        }
    }
}

/// The writing halves the sender owns, and what closes them.
struct Channels {
    bulk: Box<dyn Write + Send>,
    urgent: Option<Box<dyn Write + Send>>,
    closers: Vec<Closer>,
}

impl Channels {
    fn close(&self) {
        for c in &self.closers {
            c.close();
        }
    }
}

/// A running outgoing migration of one disk.
pub struct SourceMigration {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for SourceMigration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceMigration")
            .field("phase", &self.shared.lock().phase)
            .finish()
    }
}

fn random_session() -> [u8; SESSION_ID_LEN] {
    let mut s = [0u8; SESSION_ID_LEN];
    // Unpredictable enough that a stray connection cannot guess it; TLS is what
    // authenticates peers.
    getrandom(&mut s);
    s
}

fn getrandom(buf: &mut [u8]) {
    use std::io::Read as _;
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        if f.read_exact(buf).is_ok() {
            return;
        }
    }
    let t = Instant::now().elapsed().as_nanos() ^ u128::from(std::process::id());
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (t >> ((i % 16) * 8)) as u8;
    }
}

/// Connects one channel and exchanges Hellos, each step bounded by `timeout`; returns the
/// channel's halves, without a time limit from then on.
fn open_channel(
    to: &MigrationAddress,
    hello: Hello,
    tls: Option<&Arc<ClientConfig>>,
    timeout: Duration,
) -> Result<Channel, MigrationError> {
    let connect_error = |e: std::io::Error| MigrationError::Connect {
        to: to.to_string(),
        reason: if channel::is_timeout(&e) {
            format!(
                "no answer within {} ms (the connect timeout)",
                timeout.as_millis()
            )
        } else {
            e.to_string()
        },
    };
    let mut ch = channel::connect(to, tls, timeout).map_err(connect_error)?;
    let answer = wire::write_frame(&mut ch.writer, &Frame::Hello(hello))
        .and_then(|()| wire::read_frame(&mut ch.reader));
    let answer = match answer {
        Err(WireError::Io(e)) if channel::is_timeout(&e) => {
            ch.closer.close();
            return Err(MigrationError::Connect {
                to: to.to_string(),
                reason: format!(
                    "connected, but no Hello came back within {} ms (the connect timeout): \
                     is this a migrate-incoming address?",
                    timeout.as_millis()
                ),
            });
        }
        Err(e) => {
            ch.closer.close();
            return Err(e.into());
        }
        Ok(frame) => frame,
    };
    ch.set_timeouts(None).map_err(connect_error)?;
    match answer {
        Frame::Hello(theirs) => {
            if theirs.version != PROTOCOL_VERSION {
                return Err(MigrationError::VersionMismatch {
                    ours: PROTOCOL_VERSION,
                    theirs: theirs.version,
                });
            }
            if theirs.disk_size_bytes != hello.disk_size_bytes {
                return Err(MigrationError::SizeMismatch {
                    ours: hello.disk_size_bytes,
                    theirs: theirs.disk_size_bytes,
                });
            }
            Ok(ch)
        }
        Frame::Error { message } => Err(MigrationError::Refused(message)),
        other => Err(MigrationError::Protocol(format!(
            "expected Hello from the destination, got {}",
            other.name()
        ))),
    }
}

impl SourceMigration {
    /// Connects to the destination at `to` (all channels, handshakes done, so that a wrong
    /// address, refused TLS or a busy destination is reported here) and starts sending.
    /// `file` is the image file under the encryption; `tracker` wraps the disk the guest uses.
    pub fn start(
        file: Arc<dyn BlockDevice>,
        tracker: Arc<DirtyTracker>,
        to: &MigrationAddress,
        opts: SourceOptions,
    ) -> Result<Arc<SourceMigration>, MigrationError> {
        opts.validate()?;
        if tracker.payload_offset() + tracker.size() != file.size() {
            return Err(MigrationError::InvalidOptions(format!(
                "the disk ({} bytes at offset {}) does not end where its image file does ({} \
                 bytes)",
                tracker.size(),
                tracker.payload_offset(),
                file.size()
            )));
        }
        if tracker.is_fenced() {
            return Err(MigrationError::InvalidOptions(
                "the disk was already handed over to a destination".into(),
            ));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                phase: Phase::Setup,
                error: None,
                bytes_sent: 0,
                zero_bytes: 0,
                chunks: 0,
                passes: 0,
                urgent_served: 0,
                urgent: VecDeque::new(),
                switchover: None,
                fenced_at: None,
                downtime: None,
                cancel: false,
                peer_complete: false,
                broken: None,
                generation: 0,
                recovered: None,
                finished_at: None,
                bulk_in_chunk: false,
            }),
            cond: Condvar::new(),
            file,
            tracker,
            opts,
            session: random_session(),
            started: Instant::now(),
        });
        let channels = connect_all(&shared, to, Role::Bulk, 0)?;
        // Tracking (everything dirty) starts before the first byte of payload is read.
        shared.tracker.start_tracking()?;
        shared.lock().phase = Phase::Precopy;
        let sender_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("migrate-send".into())
            .spawn(move || run_sender(sender_shared, channels))
            .map_err(|e| MigrationError::InvalidOptions(format!("cannot start a thread: {e}")))?;
        Ok(Arc::new(SourceMigration {
            shared,
            thread: Mutex::new(Some(thread)),
        }))
    }

    pub fn status(&self) -> SourceStatus {
        let s = self.shared.lock();
        let bitmap = self.shared.tracker.bitmap();
        let end = s.finished_at.unwrap_or_else(Instant::now);
        let elapsed = end.duration_since(self.shared.started);
        let secs = elapsed.as_secs_f64();
        SourceStatus {
            phase: s.phase,
            error: s.error.clone(),
            bytes_sent: s.bytes_sent,
            zero_bytes: s.zero_bytes,
            chunks: s.chunks,
            passes: s.passes,
            dirty_blocks: bitmap.map_or(0, DirtyBitmap::count),
            dirty_bytes: bitmap.map_or(0, DirtyBitmap::dirty_bytes),
            granularity: self.shared.tracker.granularity(),
            elapsed,
            throughput_bytes_per_sec: if secs > 0.0 {
                s.bytes_sent as f64 / secs
            } else {
                0.0
            },
            urgent_served: s.urgent_served,
            downtime: s.downtime,
            postcopy: self.shared.opts.postcopy,
            preempt: self.shared.opts.preempt,
        }
    }

    /// Hands the disk over: fences it (every later guest I/O fails; I/O under way finishes
    /// first), then has the sender send what is left (`postcopy: false`) or only the list of
    /// what is missing (`postcopy: true`). Returns once the disk is fenced; `wait` for the end.
    pub fn switchover(&self, postcopy: bool) -> Result<(), MigrationError> {
        if postcopy && !self.shared.opts.postcopy {
            return Err(MigrationError::InvalidOptions(
                "this migration was started without postcopy".into(),
            ));
        }
        {
            let s = self.shared.lock();
            if s.phase != Phase::Precopy || s.switchover.is_some() {
                return Err(MigrationError::WrongPhase {
                    phase: s.phase,
                    action: "switch over",
                });
            }
        }
        self.shared.tracker.fence();
        let mut s = self.shared.lock();
        if s.phase != Phase::Precopy {
            // It failed while we were fencing: the source carries on.
            self.shared.tracker.unfence();
            return Err(MigrationError::WrongPhase {
                phase: s.phase,
                action: "switch over",
            });
        }
        s.fenced_at = Some(Instant::now());
        s.switchover = Some(postcopy);
        self.shared.cond.notify_all();
        Ok(())
    }

    /// Switches over in the mode the migration was started with.
    pub fn switchover_default(&self) -> Result<(), MigrationError> {
        self.switchover(self.shared.opts.postcopy)
    }

    /// Stops a migration whose destination is not live yet; the source keeps serving.
    pub fn cancel(&self) -> Result<(), MigrationError> {
        let mut s = self.shared.lock();
        match s.phase {
            Phase::Setup | Phase::Precopy => {
                s.cancel = true;
                self.shared.cond.notify_all();
                Ok(())
            }
            phase => Err(MigrationError::WrongPhase {
                phase,
                action: "cancel (the destination already holds the newest data)",
            }),
        }
    }

    /// Resumes a paused postcopy over new connections to `to`.
    pub fn recover(&self, to: &MigrationAddress) -> Result<(), MigrationError> {
        // The new generation is current before its readers start, so that what they hear
        // counts; the old channels are dead already.
        let generation = {
            let mut s = self.shared.lock();
            if s.phase != Phase::PostcopyPaused || s.recovered.is_some() {
                return Err(MigrationError::WrongPhase {
                    phase: s.phase,
                    action: "recover",
                });
            }
            s.generation += 1;
            s.broken = None;
            s.generation
        };
        let channels = connect_all(&self.shared, to, Role::Resume, generation)?;
        let mut s = self.shared.lock();
        s.error = None;
        s.recovered = Some(channels);
        self.shared.cond.notify_all();
        Ok(())
    }

    /// Waits until the migration completed, failed or was cancelled, or `timeout` passed;
    /// returns the phase it is in.
    pub fn wait(&self, timeout: Duration) -> Phase {
        let s = self.shared.lock();
        crate::wait_until(&self.shared.cond, s, timeout, |s| s.phase.is_final()).phase
    }

    /// Waits until the phase is `phase` or final (or `timeout` passed).
    pub fn wait_for(&self, phase: Phase, timeout: Duration) -> Phase {
        let s = self.shared.lock();
        crate::wait_until(&self.shared.cond, s, timeout, |s| {
            s.phase == phase || s.phase.is_final()
        })
        .phase
    }
}

impl Drop for SourceMigration {
    fn drop(&mut self) {
        {
            let mut s = self.shared.lock();
            if matches!(s.phase, Phase::Setup | Phase::Precopy) {
                s.cancel = true;
            }
            self.shared.cond.notify_all();
        }
        let done = self.shared.lock().phase.is_final();
        if done {
            if let Some(t) = self
                .thread
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
            {
                let _ = t.join();
            }
        }
    }
}

/// Opens the bulk channel (as `role`) and, with preempt, the urgent one; starts their reader
/// threads. For `Role::Resume`, also reads the destination's list of missing ranges and makes
/// it the new dirty set.
fn connect_all(
    shared: &Arc<Shared>,
    to: &MigrationAddress,
    role: Role,
    generation: u64,
) -> Result<Channels, MigrationError> {
    let tls = shared.opts.tls.as_ref();
    let timeout = shared.opts.connect_timeout;
    let mut bulk = open_channel(to, shared.hello(role), tls, timeout)?;
    if role == Role::Resume {
        let missing = read_missing(shared, &mut bulk.reader);
        if let Err(e) = missing {
            bulk.closer.close();
            return Err(e);
        }
    }
    let mut closers = vec![bulk.closer.clone()];
    let urgent = if shared.opts.preempt {
        match open_channel(to, shared.hello(Role::Urgent), tls, timeout) {
            Ok(ch) => Some(ch),
            Err(e) => {
                bulk.closer.close();
                return Err(e);
            }
        }
    } else {
        None
    };
    spawn_reader(shared.clone(), bulk.reader, generation, "bulk");
    let urgent_writer = urgent.map(|ch| {
        closers.push(ch.closer.clone());
        spawn_reader(shared.clone(), ch.reader, generation, "urgent");
        ch.writer
    });
    Ok(Channels {
        bulk: bulk.writer,
        urgent: urgent_writer,
        closers,
    })
}

/// Resume handshake: the destination lists every payload range it does not have.
fn read_missing(shared: &Shared, reader: &mut dyn Read) -> Result<(), MigrationError> {
    let bitmap = shared
        .tracker
        .bitmap()
        .ok_or_else(|| MigrationError::Protocol("resume before tracking started".into()))?;
    let payload = shared.tracker.payload_offset();
    let size = shared.file.size();
    let mut ranges = Vec::new();
    loop {
        match wire::read_frame(reader)? {
            Frame::Missing { offset, len } => {
                if offset < payload || offset.checked_add(len).is_none_or(|e| e > size) {
                    return Err(MigrationError::OutOfRange {
                        offset,
                        len,
                        disk_size: size,
                    });
                }
                ranges.push((offset - payload, len));
            }
            Frame::MissingEnd => break,
            Frame::Error { message } => return Err(MigrationError::Refused(message)),
            other => {
                return Err(MigrationError::Protocol(format!(
                    "expected Missing or MissingEnd, got {}",
                    other.name()
                )))
            }
        }
    }
    // The source is fenced, so its bitmap only changes here: exactly what the destination
    // lacks is what remains to send.
    bitmap.clear_all();
    for (off, len) in ranges {
        bitmap.set_range(off, len);
    }
    Ok(())
}

fn spawn_reader(
    shared: Arc<Shared>,
    mut reader: Box<dyn Read + Send>,
    generation: u64,
    what: &'static str,
) {
    let _ = std::thread::Builder::new()
        .name(format!("migrate-rx-{what}"))
        .spawn(move || {
            let err = loop {
                match wire::read_frame(&mut reader) {
                    Ok(Frame::Request { offset, len }) => {
                        let mut s = shared.lock();
                        if s.generation != generation {
                            return;
                        }
                        // Bounded by what the destination can have outstanding; a peer that
                        // floods is cut off.
                        if s.urgent.len() >= MAX_QUEUED_URGENT {
                            if s.broken.is_none() {
                                s.broken = Some("the destination flooded urgent requests".into());
                                shared.cond.notify_all();
                            }
                            return;
                        }
                        s.urgent.push_back((offset, len));
                        shared.cond.notify_all();
                    }
                    Ok(Frame::Complete) => {
                        let mut s = shared.lock();
                        if s.generation == generation {
                            s.peer_complete = true;
                            shared.cond.notify_all();
                        }
                    }
                    Ok(Frame::Error { message }) => {
                        break format!("the destination aborted: {message}")
                    }
                    Ok(other) => break format!("unexpected {} from the destination", other.name()),
                    Err(WireError::Closed) => break "the destination closed the connection".into(),
                    Err(e) => break format!("{what} channel: {e}"),
                }
            };
            let mut s = shared.lock();
            if s.generation == generation && s.broken.is_none() {
                s.broken = Some(err);
                shared.cond.notify_all();
            }
        });
}

/// Why the sender stopped sending on the current channels.
enum Stop {
    Broken(String),
    Cancelled,
}

impl From<MigrationError> for Stop {
    fn from(e: MigrationError) -> Self {
        Stop::Broken(e.to_string())
    }
}

impl From<WireError> for Stop {
    fn from(e: WireError) -> Self {
        Stop::Broken(e.to_string())
    }
}

impl From<std::io::Error> for Stop {
    fn from(e: std::io::Error) -> Self {
        Stop::Broken(e.to_string())
    }
}

struct Sender {
    shared: Arc<Shared>,
    ch: Channels,
    link: Arc<Mutex<Link>>,
    buf: Vec<u8>,
    urgent_buf: Vec<u8>,
    /// Next block of the current sweep.
    cursor: u64,
    /// Whether the current sweep took anything.
    sweep_sent: bool,
    /// The image file is known to hold data up to here (data never turns into a hole behind
    /// our back except by a discard, and reading a hole as data is still correct). Holes are
    /// not cached: a guest write can fill one at any time.
    data_until: u64,
    /// The switchover's own sending is under way (it must not break itself off).
    switching: bool,
}

fn run_sender(shared: Arc<Shared>, ch: Channels) {
    let link = Arc::new(Mutex::new(Link::new(shared.opts.max_bandwidth)));
    let mut ch = ch;
    if let Some(w) = ch.urgent.take() {
        spawn_urgent_answerer(shared.clone(), link.clone(), w, 0);
    }
    let mut s = Sender {
        link,
        shared,
        ch,
        buf: Vec::new(),
        urgent_buf: Vec::new(),
        cursor: 0,
        sweep_sent: false,
        data_until: 0,
        switching: false,
    };
    let outcome = s.precopy();
    let postcopy = match outcome {
        Ok(true) => true,
        Ok(false) => {
            s.finish(Phase::Completed, None);
            return;
        }
        Err(Stop::Cancelled) => {
            let _ = wire::write_frame(
                &mut s.ch.bulk,
                &Frame::Error {
                    message: "migration cancelled on the source".into(),
                },
            );
            s.abandon(Phase::Cancelled, None);
            return;
        }
        Err(Stop::Broken(e)) => {
            tracing::warn!("migration failed before the destination was live: {e}");
            s.abandon(Phase::Failed, Some(e));
            return;
        }
    };
    debug_assert!(postcopy);
    loop {
        match s.postcopy() {
            Ok(()) => {
                s.finish(Phase::Completed, None);
                return;
            }
            Err(Stop::Broken(e)) => {
                tracing::warn!("postcopy paused: {e}");
                s.ch.close();
                let mut st = s.shared.lock();
                st.phase = Phase::PostcopyPaused;
                st.error = Some(format!("{e}; resume with migrate-recover"));
                s.shared.cond.notify_all();
                loop {
                    if let Some(mut ch) = st.recovered.take() {
                        if let Some(w) = ch.urgent.take() {
                            spawn_urgent_answerer(
                                s.shared.clone(),
                                s.link.clone(),
                                w,
                                st.generation,
                            );
                        }
                        s.ch = ch;
                        st.phase = Phase::Postcopy;
                        st.urgent.clear();
                        s.shared.cond.notify_all();
                        break;
                    }
                    st = s
                        .shared
                        .cond
                        .wait(st)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                drop(st);
                s.cursor = 0;
            }
            // Nothing cancels a postcopy (the destination has the newest data).
            Err(Stop::Cancelled) => unreachable!("postcopy cannot be cancelled"),
        }
    }
}

impl Sender {
    fn bitmap(&self) -> &DirtyBitmap {
        self.shared.bitmap()
    }

    /// Ends the migration with the destination live (or complete): the source stays fenced.
    fn finish(&mut self, phase: Phase, error: Option<String>) {
        self.ch.close();
        let mut s = self.shared.lock();
        s.phase = phase;
        s.error = error;
        s.finished_at = Some(Instant::now());
        self.shared.cond.notify_all();
    }

    /// Ends a migration that never made the destination live: the source carries on.
    fn abandon(&mut self, phase: Phase, error: Option<String>) {
        self.ch.close();
        self.shared.tracker.stop_tracking();
        self.shared.tracker.unfence();
        self.finish(phase, error);
    }

    /// Checks what other threads asked for; `Err` to stop.
    fn check(&self) -> Result<Option<bool>, Stop> {
        let s = self.shared.lock();
        if s.cancel {
            return Err(Stop::Cancelled);
        }
        if let Some(e) = &s.broken {
            return Err(Stop::Broken(e.clone()));
        }
        Ok(s.switchover)
    }

    /// Sends the header, then sweeps until a switchover is asked for; sends what the
    /// switchover needs. `Ok(true)`: the destination is live in postcopy; `Ok(false)`:
    /// migration complete.
    fn precopy(&mut self) -> Result<bool, Stop> {
        let header_len = self.shared.tracker.payload_offset();
        let chunk = self.shared.opts.chunk_size as u64;
        let mut off = 0;
        while off < header_len {
            let len = chunk.min(header_len - off);
            self.send_file_range(off, len, false)?;
            off += len;
        }
        let max_passes = self.shared.opts.max_passes;
        loop {
            if let Some(postcopy) = self.check()? {
                return self.switch_over(postcopy);
            }
            // After the pass limit, what the guest dirties waits for the switchover instead
            // of being sent again and again.
            let passes_done = self.shared.lock().passes;
            if (max_passes != 0 && passes_done >= max_passes && self.cursor == 0)
                || !self.send_next_run(false)?
            {
                self.idle(Duration::from_millis(20));
            }
        }
    }

    /// Sleeps until something is asked of the sender (or `max` passed).
    fn idle(&self, max: Duration) {
        let s = self.shared.lock();
        if s.urgent.is_empty() && s.switchover.is_none() && !s.cancel && s.broken.is_none() {
            let _ = self.shared.cond.wait_timeout(s, max);
        }
    }

    /// Takes the next dirty run of the current sweep and sends it; at the end of a sweep
    /// reports the pass. Returns false when nothing at all was dirty this sweep.
    fn send_next_run(&mut self, urgent_between_slices: bool) -> Result<bool, Stop> {
        let max_blocks =
            (self.shared.opts.chunk_size as u64 / self.shared.tracker.granularity()).max(1);
        match self.bitmap().take_next_run(self.cursor, max_blocks) {
            Some((first, count)) => {
                self.cursor = first + count;
                self.sweep_sent = true;
                let (off, len) = self.bitmap().block_range(first, count);
                let (foff, flen) = self.shared.tracker.file_range(off, len);
                if let Err(e) = self.send_file_range(foff, flen, urgent_between_slices) {
                    // Not sent: still dirty.
                    self.bitmap().set_range(off, len);
                    return Err(e);
                }
                Ok(true)
            }
            None => {
                let had = std::mem::take(&mut self.sweep_sent);
                self.cursor = 0;
                if had {
                    let passes = {
                        let mut s = self.shared.lock();
                        s.passes += 1;
                        s.passes
                    };
                    self.frame_bulk(&Frame::PassDone {
                        pass: passes,
                        dirty_left: self.bitmap().dirty_bytes(),
                    })?;
                }
                Ok(had)
            }
        }
    }

    fn switch_over(&mut self, postcopy: bool) -> Result<bool, Stop> {
        self.switching = true;
        if !postcopy {
            // Fenced: one more sweep takes everything, and nothing gets dirty again.
            while self.bitmap().count() > 0 {
                if !self.send_next_run(false)? {
                    break;
                }
            }
            self.frame_bulk(&Frame::Complete)?;
            self.wait_peer_complete(false)?;
            let mut s = self.shared.lock();
            s.downtime = s.fenced_at.map(|t| t.elapsed());
            return Ok(false);
        }
        let payload = self.shared.tracker.payload_offset();
        let mut block = 0;
        while let Some((first, count)) = self.bitmap().next_run(block, true) {
            let (off, len) = self.bitmap().block_range(first, count);
            self.frame_bulk(&Frame::Missing {
                offset: off + payload,
                len,
            })?;
            block = first + count;
        }
        self.frame_bulk(&Frame::Postcopy)?;
        {
            let mut s = self.shared.lock();
            s.phase = Phase::Postcopy;
            s.downtime = s.fenced_at.map(|t| t.elapsed());
            self.shared.cond.notify_all();
        }
        self.cursor = 0;
        Ok(true)
    }

    /// Postcopy: urgent requests first, bulk the rest; then Complete both ways.
    fn postcopy(&mut self) -> Result<(), Stop> {
        let break_chunks = self.shared.opts.preempt && self.shared.opts.break_chunks;
        loop {
            self.serve_urgent()?;
            if self.bitmap().count() == 0 {
                break;
            }
            self.send_next_run(break_chunks)?;
        }
        self.frame_bulk(&Frame::Complete)?;
        self.wait_peer_complete(true)
    }

    /// Waits for the destination's Complete, answering urgent requests meanwhile (reads that
    /// raced with the end of the bulk stream).
    fn wait_peer_complete(&mut self, serve: bool) -> Result<(), Stop> {
        loop {
            {
                let s = self.shared.lock();
                // The destination hangs up right after its Complete: that is success.
                if s.peer_complete {
                    return Ok(());
                }
                if let Some(e) = &s.broken {
                    return Err(Stop::Broken(e.clone()));
                }
                if s.urgent.is_empty() || !serve || self.shared.opts.preempt {
                    let _ = self
                        .shared
                        .cond
                        .wait_timeout(s, Duration::from_millis(100))
                        .unwrap_or_else(PoisonError::into_inner);
                    continue;
                }
            }
            self.serve_urgent()?;
        }
    }

    /// Without preempt: answers every queued urgent request on the bulk channel. With
    /// preempt the urgent-answer thread does that; this only reports a broken channel.
    fn serve_urgent(&mut self) -> Result<(), Stop> {
        loop {
            let next = {
                let mut s = self.shared.lock();
                if let Some(e) = &s.broken {
                    return Err(Stop::Broken(e.clone()));
                }
                if self.shared.opts.preempt {
                    return Ok(());
                }
                s.urgent.pop_front()
            };
            let Some((offset, len)) = next else {
                return Ok(());
            };
            answer_urgent(
                &self.shared,
                &self.link,
                &mut self.ch.bulk,
                &mut self.urgent_buf,
                offset,
                len,
            )?;
        }
    }

    /// Waits until the link is nearly free (with no cap, at once). Up to `LINK_QUEUE` of
    /// queued transmission is allowed, as in a NIC queue: sleeping for every few microseconds
    /// would cost more than the wait itself (a sleep overshoots by tens of microseconds).
    fn wait_link(&self) {
        wait_link(&self.link);
    }

    fn frame_bulk(&mut self, frame: &Frame) -> Result<(), Stop> {
        let bytes = frame.encode();
        self.wait_link();
        self.ch.bulk.write_all(&bytes)?;
        link_sent(&self.link, bytes.len());
        Ok(())
    }

    /// Sends `len` bytes of the image file at `offset`: holes as Zero frames, data as chunks.
    fn send_file_range(
        &mut self,
        offset: u64,
        len: u64,
        urgent_between_slices: bool,
    ) -> Result<(), Stop> {
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let (kind, n) = if pos < self.data_until {
                (ExtentKind::Data, self.data_until.min(end) - pos)
            } else {
                // Ask about the rest of the file, not just this range: finding the next hole
                // costs the same (on tmpfs, a walk to it), and one answer then covers many
                // chunks.
                let size = self.shared.file.size();
                let ext = self
                    .shared
                    .file
                    .block_status(pos, size - pos)
                    .map_err(|e| Stop::Broken(e.to_string()))?;
                let ext_len = ext.len.max(1);
                if ext.kind == ExtentKind::Data {
                    self.data_until = pos + ext_len;
                }
                (ext.kind, ext_len.min(end - pos))
            };
            match kind {
                ExtentKind::Data => self.send_chunk(pos, n, urgent_between_slices)?,
                ExtentKind::Zero | ExtentKind::Unallocated => {
                    self.frame_bulk(&Frame::Zero {
                        offset: pos,
                        len: n,
                    })?;
                    self.shared.lock().zero_bytes += n;
                }
            }
            pos += n;
        }
        Ok(())
    }

    fn send_chunk(
        &mut self,
        offset: u64,
        len: u64,
        urgent_between_slices: bool,
    ) -> Result<(), Stop> {
        let mut data = std::mem::take(&mut self.buf);
        data.resize(len as usize, 0);
        self.shared.lock().bulk_in_chunk = true;
        let res = self.send_chunk_data(&mut data, offset, urgent_between_slices);
        {
            let mut s = self.shared.lock();
            s.bulk_in_chunk = false;
            self.shared.cond.notify_all();
            // Preempt without break-chunks: urgent answers go between chunks, so let the
            // answering thread empty its queue before the next chunk starts.
            if self.shared.opts.preempt && !self.shared.opts.break_chunks {
                while !s.urgent.is_empty() && s.broken.is_none() {
                    s = self
                        .shared
                        .cond
                        .wait_timeout(s, Duration::from_millis(10))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        }
        self.buf = data;
        let sent = res?;
        let mut s = self.shared.lock();
        s.bytes_sent += sent;
        s.chunks += 1;
        Ok(())
    }

    /// Whether a switchover waits for the bulk stream (and this is not the switchover's own
    /// sending).
    fn switchover_waiting(&self) -> bool {
        !self.switching && self.shared.lock().switchover.is_some()
    }

    /// Reads one bulk chunk in pieces and sends it as one frame per slice (each with its own
    /// checksum). With `urgent_between_slices`, urgent requests are answered between slices,
    /// so a large chunk never holds one up for more than a slice. A switchover asked for
    /// meanwhile breaks the chunk off: what was not sent is marked dirty again, so the
    /// switchover waits for one slice, not for a chunk at the bandwidth cap. Returns the bytes
    /// sent.
    fn send_chunk_data(
        &mut self,
        data: &mut [u8],
        offset: u64,
        urgent_between_slices: bool,
    ) -> Result<u64, Stop> {
        const READ_PIECE: usize = 256 << 10;
        let slice = self.shared.opts.slice_size;
        let payload = self.shared.tracker.payload_offset();
        let mut pos = 0;
        while pos < data.len() {
            let piece_end = (pos + READ_PIECE.max(slice)).min(data.len());
            self.shared
                .file
                .read_at(&mut data[pos..piece_end], offset + pos as u64)
                .map_err(|e| Stop::Broken(e.to_string()))?;
            while pos < piece_end {
                if urgent_between_slices {
                    self.serve_urgent()?;
                }
                let at = offset + pos as u64;
                if at >= payload && self.switchover_waiting() {
                    let unsent = data.len() as u64 - pos as u64;
                    self.bitmap().set_range(at - payload, unsent);
                    return Ok(pos as u64);
                }
                let end = (pos + slice).min(piece_end);
                self.wait_link();
                wire::write_chunk(&mut self.ch.bulk, at, &data[pos..end])?;
                link_sent(&self.link, end - pos + wire::CHUNK_OVERHEAD);
                pos = end;
            }
        }
        Ok(data.len() as u64)
    }
}

/// Waits until the link is nearly free (with no cap, at once). Up to `LINK_QUEUE` of queued
/// transmission is allowed, as in a NIC queue: sleeping for every few microseconds would cost
/// more than the wait itself (a sleep overshoots by tens of microseconds).
fn wait_link(link: &Mutex<Link>) {
    const LINK_QUEUE: Duration = Duration::from_micros(200);
    let busy = link
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .busy_for();
    if busy > LINK_QUEUE {
        std::thread::sleep(busy - LINK_QUEUE / 2);
    }
}

fn link_sent(link: &Mutex<Link>, bytes: usize) {
    link.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .sent(bytes);
}

/// Sends the `len` bytes at `offset` the destination asked for, on `w`.
fn answer_urgent(
    shared: &Shared,
    link: &Mutex<Link>,
    w: &mut dyn Write,
    buf: &mut Vec<u8>,
    offset: u64,
    len: u64,
) -> Result<(), Stop> {
    let size = shared.file.size();
    let payload = shared.tracker.payload_offset();
    if offset < payload
        || len > MAX_CHUNK_LEN as u64
        || offset.checked_add(len).is_none_or(|e| e > size)
    {
        return Err(Stop::Broken(format!(
            "the destination asked for {len} bytes at {offset}, outside the {size}-byte disk's \
             payload"
        )));
    }
    buf.resize(len as usize, 0);
    shared
        .file
        .read_at(buf, offset)
        .map_err(|e| Stop::Broken(e.to_string()))?;
    let prefix = wire::chunk_prefix(offset, buf);
    wait_link(link);
    w.write_all(&prefix)?;
    w.write_all(buf)?;
    link_sent(link, prefix.len() + buf.len());
    // Sent: the bulk stream need not send it again.
    shared
        .tracker
        .bitmap()
        .expect("tracking started")
        .clear_range(offset - payload, len);
    let mut s = shared.lock();
    s.urgent_served += 1;
    s.bytes_sent += len;
    s.chunks += 1;
    shared.cond.notify_all();
    Ok(())
}

/// With preempt, urgent requests are answered by a thread of their own, on the preempt
/// connection: the bulk sender may sit in a write to a full socket for milliseconds (Linux
/// wakes a writer only once a third of the buffer has drained), and an urgent answer must not
/// wait for that. Without break-chunks it still waits until the bulk sender is between chunks.
fn spawn_urgent_answerer(
    shared: Arc<Shared>,
    link: Arc<Mutex<Link>>,
    mut w: Box<dyn Write + Send>,
    generation: u64,
) {
    let _ = std::thread::Builder::new()
        .name("migrate-urgent".into())
        .spawn(move || {
            let mut buf = Vec::new();
            loop {
                let (offset, len) = {
                    let mut s = shared.lock();
                    loop {
                        if s.generation != generation || s.phase.is_final() || s.broken.is_some() {
                            return;
                        }
                        if shared.opts.break_chunks || !s.bulk_in_chunk {
                            if let Some(r) = s.urgent.pop_front() {
                                break r;
                            }
                        }
                        s = shared
                            .cond
                            .wait_timeout(s, Duration::from_millis(100))
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                };
                if let Err(stop) = answer_urgent(&shared, &link, &mut *w, &mut buf, offset, len) {
                    let e = match stop {
                        Stop::Broken(e) => e,
                        Stop::Cancelled => "cancelled".into(),
                    };
                    let mut s = shared.lock();
                    if s.generation == generation && s.broken.is_none() {
                        s.broken = Some(format!("urgent channel: {e}"));
                        shared.cond.notify_all();
                    }
                    return;
                }
            }
        });
}
