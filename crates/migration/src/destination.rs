//! The destination side of a migration: a listener that takes one migration's channels (bulk,
//! urgent, and later resumes), writes what arrives into a new image file, and
//! [`IncomingDisk`], the device the destination serves while blocks may still be missing.
//!
//! Every frame is checked before it has any effect (checksum by the parser; range, alignment
//! and phase here), and a refused frame marks nothing as received. In postcopy, received data
//! never overwrites a block the destination already has (the guest may have written it since),
//! which is why writes of arriving data and guest writes are ordered by one lock, and why a
//! block counts as received before a guest write to it lands.

use crate::channel::{Channel, Closer, Incoming, MigrationAddress, MigrationListener};
use crate::latency::{LatencyHistogram, LatencySummary};
use crate::wire::SESSION_ID_LEN;
use crate::wire::{self, Frame, Hello, Role, WireError, PROTOCOL_VERSION};
use crate::{DirtyBitmap, MigrationError, Phase};
use cryptblk_block::{BlockDevice, BlockError, BlockErrorKind, Extent, ExtentKind, RawFile};
use rustls::ServerConfig;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// Smallest and largest block a source may track at: finer would let a peer make us allocate
/// a huge bitmap, coarser makes every on-demand fetch large.
const MIN_GRANULARITY: u32 = 512;
const MAX_GRANULARITY: u32 = 1 << 20;
/// Most blocks tracked (a 256 MiB bitmap pair at most).
const MAX_BLOCKS: u64 = 1 << 31;
/// Pieces in which arriving data is written in postcopy, so guest writes never wait long for
/// the ordering lock.
const APPLY_PIECE: u64 = 1 << 20;

type SharedWriter = Arc<Mutex<Box<dyn Write + Send>>>;

/// What the destination knows once a source said Hello.
struct Created {
    file: Arc<RawFile>,
    /// Blocks (file offsets) whose current contents are here. Before postcopy: written at
    /// least once; at postcopy: everything but what the source listed as missing.
    received: DirtyBitmap,
    /// Blocks asked for on demand (and maybe not received yet).
    requested: DirtyBitmap,
    hello: Hello,
}

struct DState {
    phase: Phase,
    error: Option<String>,
    session: Option<[u8; SESSION_ID_LEN]>,
    bulk_writer: Option<SharedWriter>,
    urgent_writer: Option<SharedWriter>,
    closers: Vec<Closer>,
    generation: u64,
    missing_listed: bool,
    bytes_received: u64,
    zero_bytes: u64,
    chunks: u64,
    passes: u32,
    urgent_requests: u64,
    latency: LatencyHistogram,
    live_at: Option<Instant>,
    finished_at: Option<Instant>,
}

struct DShared {
    state: Mutex<DState>,
    cond: Condvar,
    /// Orders writes of arriving data against guest writes (postcopy).
    apply: Mutex<()>,
    /// `phase` as a number, for the I/O fast path.
    phase_fast: AtomicU8,
    created: OnceLock<Created>,
    image_path: PathBuf,
    listener: MigrationListener,
    started: Instant,
}

fn phase_code(p: Phase) -> u8 {
    p as u8
}

impl DShared {
    fn lock(&self) -> MutexGuard<'_, DState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_phase(&self, s: &mut DState, phase: Phase) {
        s.phase = phase;
        self.phase_fast.store(phase_code(phase), Ordering::Release);
        if phase == Phase::Postcopy && s.live_at.is_none() {
            s.live_at = Some(Instant::now());
        }
        if phase.is_final() {
            s.finished_at = Some(Instant::now());
            // After Complete the source hangs up once it has read our answer; closing first
            // could let it see a broken channel before that answer.
            if phase != Phase::Completed {
                for c in s.closers.drain(..) {
                    c.close();
                }
            }
            self.listener.shutdown();
        }
        self.cond.notify_all();
    }

    fn created(&self) -> Result<&Created, MigrationError> {
        self.created
            .get()
            .ok_or_else(|| MigrationError::Protocol("data before Hello".into()))
    }

    /// Ends the migration before the destination went live: the half-written image is
    /// removed (it was created by this migration and holds nothing usable).
    fn fail(&self, s: &mut DState, phase: Phase, error: String) {
        tracing::warn!("incoming migration {phase}: {error}");
        s.error = Some(error);
        self.set_phase(s, phase);
        if self.created.get().is_some() {
            let _ = std::fs::remove_file(&self.image_path);
        }
    }
}

/// A snapshot of the destination's progress.
#[derive(Debug, Clone)]
pub struct IncomingStatus {
    pub phase: Phase,
    pub error: Option<String>,
    /// Where it listens.
    pub address: String,
    pub disk_size: Option<u64>,
    pub bytes_received: u64,
    pub zero_bytes: u64,
    pub chunks: u64,
    pub passes: u32,
    /// Blocks still missing (postcopy), of `granularity` bytes.
    pub missing_blocks: u64,
    pub granularity: u64,
    /// On-demand fetches and how long reads waited for them.
    pub urgent_requests: u64,
    pub latency: LatencySummary,
    pub elapsed: Duration,
}

/// What the destination needs to open the disk: the image file, whose header has arrived.
#[derive(Debug, Clone)]
pub struct HeaderReady {
    pub file: Arc<RawFile>,
    /// Bytes of format header (LUKS data offset) at the start of the file; 0 for raw.
    pub header_len: u64,
    pub disk_size: u64,
}

/// An incoming migration of one disk.
pub struct IncomingMigration {
    shared: Arc<DShared>,
    address: MigrationAddress,
}

impl std::fmt::Debug for IncomingMigration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncomingMigration")
            .field("address", &self.address)
            .field("phase", &self.shared.lock().phase)
            .finish()
    }
}

impl IncomingMigration {
    /// Listens on `addr` for a migration into a new image file at `image` (which must not
    /// exist; it is created when the source says how large it is). With `tls`, every channel
    /// is TLS and the source must present a certificate signed by the CA.
    pub fn listen(
        addr: &MigrationAddress,
        image: &Path,
        tls: Option<Arc<ServerConfig>>,
    ) -> Result<Arc<IncomingMigration>, MigrationError> {
        if image.exists() {
            return Err(MigrationError::DestinationExists {
                path: image.to_path_buf(),
            });
        }
        let listener = MigrationListener::bind(addr, tls).map_err(MigrationError::Listen)?;
        let address = listener.local_addr().map_err(MigrationError::Listen)?;
        let shared = Arc::new(DShared {
            state: Mutex::new(DState {
                phase: Phase::Setup,
                error: None,
                session: None,
                bulk_writer: None,
                urgent_writer: None,
                closers: Vec::new(),
                generation: 0,
                missing_listed: false,
                bytes_received: 0,
                zero_bytes: 0,
                chunks: 0,
                passes: 0,
                urgent_requests: 0,
                latency: LatencyHistogram::default(),
                live_at: None,
                finished_at: None,
            }),
            cond: Condvar::new(),
            apply: Mutex::new(()),
            phase_fast: AtomicU8::new(phase_code(Phase::Setup)),
            created: OnceLock::new(),
            image_path: image.to_path_buf(),
            listener,
            started: Instant::now(),
        });
        let acceptor = shared.clone();
        std::thread::Builder::new()
            .name("migrate-listen".into())
            .spawn(move || accept_loop(acceptor))
            .map_err(MigrationError::Listen)?;
        Ok(Arc::new(IncomingMigration { shared, address }))
    }

    pub fn address(&self) -> &MigrationAddress {
        &self.address
    }

    pub fn phase(&self) -> Phase {
        self.shared.lock().phase
    }

    pub fn status(&self) -> IncomingStatus {
        let s = self.shared.lock();
        let created = self.shared.created.get();
        let missing_blocks = match created {
            Some(c) if matches!(s.phase, Phase::Postcopy | Phase::PostcopyPaused) => {
                c.received.blocks() - c.received.count()
            }
            _ => 0,
        };
        let end = s.finished_at.unwrap_or_else(Instant::now);
        IncomingStatus {
            phase: s.phase,
            error: s.error.clone(),
            address: self.address.to_string(),
            disk_size: created.map(|c| c.hello.disk_size_bytes),
            bytes_received: s.bytes_received,
            zero_bytes: s.zero_bytes,
            chunks: s.chunks,
            passes: s.passes,
            missing_blocks,
            granularity: created.map_or(0, |c| u64::from(c.hello.granularity)),
            urgent_requests: s.urgent_requests,
            latency: s.latency.summary(),
            elapsed: end.duration_since(self.shared.started),
        }
    }

    /// Waits until the image header has arrived (right after the source connected: it is sent
    /// first), so the volume can be opened and served; I/O on it waits for the switchover.
    pub fn wait_header(&self, timeout: Duration) -> Result<HeaderReady, MigrationError> {
        let deadline = Instant::now() + timeout;
        let mut s = self.shared.lock();
        loop {
            if let Some(c) = self.shared.created.get() {
                if c.received.all_set(0, c.hello.header_len) {
                    return Ok(HeaderReady {
                        file: c.file.clone(),
                        header_len: c.hello.header_len,
                        disk_size: c.hello.disk_size_bytes,
                    });
                }
            }
            if s.phase.is_final() {
                return Err(MigrationError::Refused(
                    s.error
                        .clone()
                        .unwrap_or_else(|| format!("migration {}", s.phase)),
                ));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(MigrationError::Protocol(
                    "timed out waiting for the source to send the image header".into(),
                ));
            }
            s = self
                .shared
                .cond
                .wait_timeout(s, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Waits until the phase is `phase` or final, or `timeout` passed; returns the phase.
    pub fn wait_for(&self, phase: Phase, timeout: Duration) -> Phase {
        let s = self.shared.lock();
        crate::wait_until(&self.shared.cond, s, timeout, |s| {
            s.phase == phase || s.phase.is_final()
        })
        .phase
    }

    /// The device to serve: `inner` is the disk opened over the received image file (the
    /// LUKS volume, or the raw file), whose payload starts `header_len` bytes into the file.
    pub fn disk(&self, inner: Arc<dyn BlockDevice>) -> Result<Arc<IncomingDisk>, MigrationError> {
        let created = self.shared.created()?;
        if inner.size() + created.hello.header_len != created.hello.disk_size_bytes {
            return Err(MigrationError::InvalidOptions(format!(
                "the opened disk ({} bytes) does not fill the image after its {}-byte header",
                inner.size(),
                created.hello.header_len
            )));
        }
        Ok(Arc::new(IncomingDisk {
            inner,
            shared: self.shared.clone(),
            payload_offset: created.hello.header_len,
        }))
    }

    /// Gives up before the destination went live; the partial image is removed.
    pub fn cancel(&self) -> Result<(), MigrationError> {
        let mut s = self.shared.lock();
        match s.phase {
            Phase::Setup | Phase::Precopy => {
                self.shared.fail(
                    &mut s,
                    Phase::Cancelled,
                    "cancelled on the destination".into(),
                );
                Ok(())
            }
            phase => Err(MigrationError::WrongPhase {
                phase,
                action: "cancel (the destination is live)",
            }),
        }
    }
}

impl Drop for IncomingMigration {
    fn drop(&mut self) {
        let mut s = self.shared.lock();
        if !s.phase.is_final() {
            match s.phase {
                Phase::Setup | Phase::Precopy => {
                    self.shared
                        .fail(&mut s, Phase::Cancelled, "the destination went away".into())
                }
                _ => {
                    for c in s.closers.drain(..) {
                        c.close();
                    }
                    self.shared.listener.shutdown();
                }
            }
        }
    }
}

fn accept_loop(shared: Arc<DShared>) {
    loop {
        let incoming = match shared.listener.accept() {
            Ok(i) => i,
            Err(e) => {
                if shared.lock().phase.is_final() {
                    return;
                }
                tracing::warn!("migration listener: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if shared.lock().phase.is_final() {
            incoming.refuse();
            return;
        }
        let conn_shared = shared.clone();
        let _ = std::thread::Builder::new()
            .name("migrate-conn".into())
            .spawn(move || handle_connection(conn_shared, incoming));
    }
}

/// Tells a peer why it is refused and hangs up. Only a version mismatch is answered with our
/// Hello first (so the peer can report both versions); otherwise the Error comes instead of
/// the Hello, and the source reports it as the answer to its connection attempt.
fn refuse(ch: &mut Channel, ours: Option<Hello>, message: String) {
    tracing::warn!(peer = %ch.peer, "refusing a migration connection: {message}");
    if let Some(hello) = ours {
        let _ = wire::write_frame(&mut ch.writer, &Frame::Hello(hello));
    }
    let _ = wire::write_frame(&mut ch.writer, &Frame::Error { message });
    ch.closer.close();
}

fn validate_hello(h: &Hello) -> Result<(), String> {
    if h.disk_size_bytes == 0 {
        return Err("the disk is empty".into());
    }
    if !(MIN_GRANULARITY..=MAX_GRANULARITY).contains(&h.granularity)
        || !h.granularity.is_power_of_two()
    {
        return Err(format!(
            "granularity {} is not a power of two within {MIN_GRANULARITY}..={MAX_GRANULARITY}",
            h.granularity
        ));
    }
    let g = u64::from(h.granularity);
    if h.header_len > h.disk_size_bytes || !h.header_len.is_multiple_of(g) {
        return Err(format!(
            "header length {} is not a multiple of {g} within the {}-byte disk",
            h.header_len, h.disk_size_bytes
        ));
    }
    if h.disk_size_bytes.div_ceil(g) > MAX_BLOCKS {
        return Err(format!(
            "a {}-byte disk at {g}-byte granularity needs too large a bitmap",
            h.disk_size_bytes
        ));
    }
    Ok(())
}

fn handle_connection(shared: Arc<DShared>, incoming: Incoming) {
    let peer = incoming.peer().to_string();
    let mut ch = match incoming.establish() {
        Ok(ch) => ch,
        Err(e) => {
            tracing::warn!(%peer, "migration connection refused: {e}");
            return;
        }
    };
    let theirs = match wire::read_frame(&mut ch.reader) {
        // Set up: the connection now carries the migration, with no time limit.
        Ok(Frame::Hello(h)) => match ch.set_timeouts(None) {
            Ok(()) => h,
            Err(e) => {
                tracing::warn!(%peer, "migration connection: {e}");
                ch.closer.close();
                return;
            }
        },
        Ok(other) => {
            tracing::warn!(%peer, "migration connection sent {} before Hello", other.name());
            ch.closer.close();
            return;
        }
        Err(e) => {
            tracing::warn!(%peer, "migration connection: {e}");
            ch.closer.close();
            return;
        }
    };
    let mut ours = theirs;
    ours.version = PROTOCOL_VERSION;
    if theirs.version != PROTOCOL_VERSION {
        let msg = format!(
            "protocol version mismatch: the destination speaks version {PROTOCOL_VERSION}, the \
             source version {}",
            theirs.version
        );
        return refuse(&mut ch, Some(ours), msg);
    }
    let generation = match theirs.role {
        Role::Bulk => match start_session(&shared, &theirs) {
            Ok(g) => g,
            Err(msg) => return refuse(&mut ch, None, msg),
        },
        Role::Urgent | Role::Resume => {
            let mut s = shared.lock();
            if s.session != Some(theirs.session) {
                drop(s);
                return refuse(&mut ch, None, "no migration with this session".into());
            }
            let c = shared.created.get().expect("session implies created");
            if c.hello.disk_size_bytes != theirs.disk_size_bytes {
                drop(s);
                return refuse(&mut ch, None, "disk size differs from the session's".into());
            }
            match (theirs.role, s.phase) {
                (Role::Urgent, Phase::Precopy | Phase::Postcopy | Phase::PostcopyPaused) => {}
                (Role::Resume, Phase::Postcopy | Phase::PostcopyPaused) => {
                    // Whatever the old channels are doing, they are over.
                    for c in s.closers.drain(..) {
                        c.close();
                    }
                    s.generation += 1;
                    s.bulk_writer = None;
                    s.urgent_writer = None;
                    shared.set_phase(&mut s, Phase::PostcopyPaused);
                }
                (_, phase) => {
                    drop(s);
                    return refuse(
                        &mut ch,
                        None,
                        format!("cannot join a migration in phase {phase}"),
                    );
                }
            }
            s.generation
        }
    };
    if wire::write_frame(&mut ch.writer, &Frame::Hello(ours)).is_err() {
        ch.closer.close();
        return;
    }
    let Channel {
        mut reader,
        mut writer,
        closer,
        ..
    } = ch;
    if theirs.role == Role::Resume {
        if let Err(e) = send_missing(&shared, &mut writer) {
            tracing::warn!("resume: {e}");
            closer.close();
            return;
        }
    }
    let writer: SharedWriter = Arc::new(Mutex::new(writer));
    let outstanding = {
        let mut s = shared.lock();
        if s.generation != generation {
            closer.close();
            return;
        }
        s.closers.push(closer.clone());
        match theirs.role {
            Role::Urgent => s.urgent_writer = Some(writer.clone()),
            _ => s.bulk_writer = Some(writer.clone()),
        }
        if theirs.role == Role::Resume {
            shared.set_phase(&mut s, Phase::Postcopy);
            s.error = None;
        }
        theirs.role != Role::Bulk
    };
    if outstanding {
        resend_outstanding(&shared);
    }
    let res = read_frames(&shared, &mut *reader, &writer, theirs.role, generation);
    if let Err(e) = res {
        channel_failed(&shared, generation, &writer, e);
    }
}

/// The first bulk connection: creates the image and the session.
fn start_session(shared: &DShared, h: &Hello) -> Result<u64, String> {
    let mut s = shared.lock();
    if s.session.is_some() || s.phase != Phase::Setup {
        return Err("this destination already receives a migration".into());
    }
    validate_hello(h)?;
    let file = RawFile::create(&shared.image_path, h.disk_size_bytes)
        .map_err(|e| format!("cannot create the destination image: {e}"))?;
    let g = u64::from(h.granularity);
    let bitmaps = DirtyBitmap::new(h.disk_size_bytes, g)
        .and_then(|r| Ok((r, DirtyBitmap::new(h.disk_size_bytes, g)?)));
    let (received, requested) = match bitmaps {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_file(&shared.image_path);
            return Err(e.to_string());
        }
    };
    let _ = shared.created.set(Created {
        file: Arc::new(file),
        received,
        requested,
        hello: *h,
    });
    s.session = Some(h.session);
    s.generation += 1;
    shared.set_phase(&mut s, Phase::Precopy);
    Ok(s.generation)
}

/// Resume: every payload range not received, then MissingEnd.
fn send_missing(shared: &DShared, w: &mut dyn Write) -> Result<(), MigrationError> {
    let c = shared.created()?;
    let first_payload_block = c.hello.header_len / u64::from(c.hello.granularity);
    let mut frames = Vec::new();
    let mut block = first_payload_block;
    while let Some((first, count)) = c.received.next_run(block, false) {
        let (offset, len) = c.received.block_range(first, count);
        Frame::Missing { offset, len }.encode_into(&mut frames);
        block = first + count;
        if frames.len() > 1 << 20 {
            w.write_all(&frames).map_err(WireError::from)?;
            frames.clear();
        }
    }
    Frame::MissingEnd.encode_into(&mut frames);
    w.write_all(&frames).map_err(WireError::from)?;
    Ok(())
}

/// After a resume (or a new urgent channel): asks again for everything still awaited.
fn resend_outstanding(shared: &DShared) {
    let Ok(c) = shared.created() else { return };
    let mut ranges = Vec::new();
    let mut block = 0;
    while let Some((first, count)) = c.requested.next_run(block, true) {
        for b in first..first + count {
            if !c.received.is_set(b) {
                ranges.push(c.received.block_range(b, 1));
            }
        }
        block = first + count;
    }
    if !ranges.is_empty() {
        send_requests(shared, &ranges);
    }
}

fn request_writer(shared: &DShared) -> Option<SharedWriter> {
    let s = shared.lock();
    s.urgent_writer.clone().or_else(|| s.bulk_writer.clone())
}

fn send_requests(shared: &DShared, ranges: &[(u64, u64)]) {
    let Some(w) = request_writer(shared) else {
        return; // paused: resent on resume
    };
    let mut bytes = Vec::new();
    for &(offset, len) in ranges {
        Frame::Request { offset, len }.encode_into(&mut bytes);
    }
    let mut w = w.lock().unwrap_or_else(PoisonError::into_inner);
    // A failed send is found by the reader of that channel; the request is resent on resume.
    let _ = w.write_all(&bytes);
}

fn channel_failed(shared: &DShared, generation: u64, writer: &SharedWriter, e: MigrationError) {
    let stream_broken = matches!(
        e,
        MigrationError::Wire(WireError::Io(_) | WireError::Closed) | MigrationError::Refused(_)
    );
    if !stream_broken {
        let mut w = writer.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = wire::write_frame(
            &mut *w,
            &Frame::Error {
                message: format!("destination: {e}"),
            },
        );
    }
    let mut s = shared.lock();
    if s.generation != generation {
        return;
    }
    match s.phase {
        Phase::Setup | Phase::Precopy => shared.fail(&mut s, Phase::Failed, e.to_string()),
        Phase::Postcopy => {
            tracing::warn!("postcopy paused: {e}");
            s.error = Some(format!("{e}; waiting for the source to recover"));
            for c in s.closers.drain(..) {
                c.close();
            }
            s.bulk_writer = None;
            s.urgent_writer = None;
            shared.set_phase(&mut s, Phase::PostcopyPaused);
        }
        _ => {}
    }
}

fn read_frames(
    shared: &DShared,
    reader: &mut dyn Read,
    writer: &SharedWriter,
    role: Role,
    generation: u64,
) -> Result<(), MigrationError> {
    let c = shared.created()?;
    loop {
        let frame = wire::read_frame(reader)?;
        if shared.lock().generation != generation {
            return Ok(()); // superseded by a resume
        }
        match (role, frame) {
            (_, Frame::Chunk { offset, data, .. }) => {
                apply(shared, c, offset, Payload::Data(&data))?
            }
            (Role::Urgent, other) => {
                return Err(MigrationError::Protocol(format!(
                    "{} on the urgent channel",
                    other.name()
                )))
            }
            (_, Frame::Zero { offset, len }) => apply(shared, c, offset, Payload::Zero(len))?,
            (_, Frame::PassDone { pass, .. }) => shared.lock().passes = pass,
            (_, Frame::Missing { offset, len }) => {
                let mut s = shared.lock();
                if s.phase != Phase::Precopy {
                    return Err(MigrationError::Protocol(format!(
                        "Missing in phase {}",
                        s.phase
                    )));
                }
                check_range(c, offset, len)?;
                if offset < c.hello.header_len {
                    return Err(MigrationError::Protocol(
                        "the header cannot be missing".into(),
                    ));
                }
                if !s.missing_listed {
                    s.missing_listed = true;
                    c.received.set_all();
                }
                c.received.clear_range(offset, len);
            }
            (_, Frame::Postcopy) => {
                let mut s = shared.lock();
                if s.phase != Phase::Precopy {
                    return Err(MigrationError::Protocol(format!(
                        "Postcopy in phase {}",
                        s.phase
                    )));
                }
                if !c.received.all_set(0, c.hello.header_len) && !s.missing_listed {
                    return Err(MigrationError::Protocol(
                        "postcopy before the header was sent".into(),
                    ));
                }
                if !s.missing_listed {
                    s.missing_listed = true;
                    c.received.set_all();
                }
                shared.set_phase(&mut s, Phase::Postcopy);
            }
            (_, Frame::Complete) => {
                let missing = c.received.blocks() - c.received.count();
                if missing != 0 {
                    return Err(MigrationError::Protocol(format!(
                        "the source completed with {missing} blocks never sent"
                    )));
                }
                c.file.flush()?;
                {
                    let mut w = writer.lock().unwrap_or_else(PoisonError::into_inner);
                    wire::write_frame(&mut *w, &Frame::Complete)?;
                }
                let mut s = shared.lock();
                shared.set_phase(&mut s, Phase::Completed);
                return Ok(());
            }
            (_, Frame::Error { message }) => return Err(MigrationError::Refused(message)),
            (_, other) => {
                return Err(MigrationError::Protocol(format!(
                    "unexpected {} from the source",
                    other.name()
                )))
            }
        }
    }
}

enum Payload<'a> {
    Data(&'a [u8]),
    Zero(u64),
}

impl Payload<'_> {
    fn len(&self) -> u64 {
        match self {
            Payload::Data(d) => d.len() as u64,
            Payload::Zero(n) => *n,
        }
    }
}

fn check_range(c: &Created, offset: u64, len: u64) -> Result<(), MigrationError> {
    let size = c.hello.disk_size_bytes;
    let end = offset.checked_add(len).filter(|&e| e <= size);
    let g = u64::from(c.hello.granularity);
    match end {
        None => Err(MigrationError::OutOfRange {
            offset,
            len,
            disk_size: size,
        }),
        Some(end) if !offset.is_multiple_of(g) || (end % g != 0 && end != size) => {
            Err(MigrationError::Protocol(format!(
                "range of {len} bytes at {offset} is not aligned to the {g}-byte blocks"
            )))
        }
        Some(_) => Ok(()),
    }
}

/// Writes arriving data (or zeros). Before postcopy everything is written (later passes
/// replace earlier ones); from postcopy on, only blocks not received yet.
fn apply(
    shared: &DShared,
    c: &Created,
    offset: u64,
    payload: Payload<'_>,
) -> Result<(), MigrationError> {
    let len = payload.len();
    check_range(c, offset, len)?;
    let g = u64::from(c.hello.granularity);
    let mut piece = offset;
    let end = offset + len;
    while piece < end {
        let piece_end = (piece + APPLY_PIECE).min(end);
        // The phase is read under the ordering lock: a piece that started as precopy data
        // (written whatever the bitmap says) must not land after a guest write that the
        // switchover to postcopy allowed.
        let _order = shared.apply.lock().unwrap_or_else(PoisonError::into_inner);
        let phase = shared.lock().phase;
        match phase {
            Phase::Precopy => {
                write_payload(&c.file, &payload, offset, piece - offset, piece_end - piece)?;
                c.received.set_range(piece, piece_end - piece);
            }
            Phase::Postcopy | Phase::PostcopyPaused => {
                let mut block = piece / g;
                let last = (piece_end - 1) / g;
                while let Some((first, count)) = c.received.next_run(block, false) {
                    if first > last {
                        break;
                    }
                    let count = count.min(last + 1 - first);
                    let (run_off, run_len) = c.received.block_range(first, count);
                    write_payload(&c.file, &payload, offset, run_off - offset, run_len)?;
                    c.received.set_range(run_off, run_len);
                    block = first + count;
                }
            }
            phase => {
                return Err(MigrationError::Protocol(format!("data in phase {phase}")));
            }
        }
        piece = piece_end;
    }
    let mut s = shared.lock();
    match payload {
        Payload::Data(_) => {
            s.bytes_received += len;
            s.chunks += 1;
        }
        Payload::Zero(_) => s.zero_bytes += len,
    }
    shared.cond.notify_all();
    Ok(())
}

/// Writes `len` bytes of `payload` starting `skip` bytes into it, at `base + skip`.
fn write_payload(
    file: &RawFile,
    payload: &Payload<'_>,
    base: u64,
    skip: u64,
    len: u64,
) -> Result<(), MigrationError> {
    let at = base + skip;
    match payload {
        Payload::Data(d) => file.write_at(&d[skip as usize..(skip + len) as usize], at)?,
        Payload::Zero(_) => {
            if file.punch_hole(at, len).is_err() {
                let zeros = vec![0u8; len.min(1 << 20) as usize];
                let mut pos = at;
                while pos < at + len {
                    let n = (at + len - pos).min(zeros.len() as u64) as usize;
                    file.write_at(&zeros[..n], pos)?;
                    pos += n as u64;
                }
            }
        }
    }
    Ok(())
}

/// The disk a destination serves while a migration brings it in: before switchover every I/O
/// waits; in postcopy a read of a block not here yet asks the source for it and waits for that
/// block only, and a write makes the blocks it fully covers "received" (partially covered ones
/// are fetched first); once complete it is a plain pass-through.
pub struct IncomingDisk {
    inner: Arc<dyn BlockDevice>,
    shared: Arc<DShared>,
    payload_offset: u64,
}

impl std::fmt::Debug for IncomingDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncomingDisk")
            .field("size", &self.inner.size())
            .field("payload_offset", &self.payload_offset)
            .finish()
    }
}

fn fetch_error(op: &'static str, why: String) -> BlockError {
    BlockError::new(
        BlockErrorKind::Io,
        format!("the incoming migration of this disk failed: {why}"),
    )
    .with_op(op)
}

impl IncomingDisk {
    fn complete(&self) -> bool {
        self.shared.phase_fast.load(Ordering::Acquire) == phase_code(Phase::Completed)
    }

    /// Waits until the destination is live.
    fn live(&self, op: &'static str) -> Result<&Created, BlockError> {
        let mut s = self.shared.lock();
        loop {
            match s.phase {
                Phase::Postcopy | Phase::PostcopyPaused | Phase::Completed => break,
                Phase::Failed | Phase::Cancelled => {
                    return Err(fetch_error(op, s.error.clone().unwrap_or_default()))
                }
                Phase::Setup | Phase::Precopy => {
                    s = self
                        .shared
                        .cond
                        .wait(s)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
        drop(s);
        self.shared
            .created
            .get()
            .ok_or_else(|| fetch_error(op, "no source".into()))
    }

    /// Makes sure the blocks under `len` file bytes at `offset` are here, fetching the
    /// missing ones on demand.
    fn ensure(
        &self,
        c: &Created,
        op: &'static str,
        offset: u64,
        len: u64,
    ) -> Result<(), BlockError> {
        if len == 0 || c.received.all_set(offset, len) {
            return Ok(());
        }
        let started = Instant::now();
        let g = u64::from(c.hello.granularity);
        let (first, last) = (offset / g, (offset + len - 1) / g);
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        {
            let _s = self.shared.lock();
            let mut block = first;
            while let Some((b, count)) = c.received.next_run(block, false) {
                if b > last {
                    break;
                }
                let end = (b + count).min(last + 1);
                for blk in b..end {
                    if !c.requested.is_set(blk) {
                        c.requested.set_range(blk * g, 1);
                        match ranges.last_mut() {
                            Some((o, l)) if *o + *l == blk * g => *l += g,
                            _ => ranges.push((blk * g, g)),
                        }
                    }
                }
                block = end;
            }
        }
        // The last block may be short.
        let size = c.hello.disk_size_bytes;
        for r in &mut ranges {
            r.1 = r.1.min(size - r.0);
        }
        if !ranges.is_empty() {
            send_requests(&self.shared, &ranges);
        }
        let mut s = self.shared.lock();
        while !c.received.all_set(offset, len) {
            if matches!(s.phase, Phase::Failed | Phase::Cancelled) {
                return Err(fetch_error(op, s.error.clone().unwrap_or_default()));
            }
            s = self
                .shared
                .cond
                .wait_timeout(s, Duration::from_secs(1))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        s.urgent_requests += 1;
        s.latency.record(started.elapsed());
        Ok(())
    }

    /// Before a write or discard of `len` plaintext bytes at `offset`: fetches partially
    /// covered edge blocks, then marks the covered blocks received so arriving data will not
    /// overwrite what the guest writes.
    fn before_write(&self, op: &'static str, offset: u64, len: u64) -> Result<(), BlockError> {
        let c = self.live(op)?;
        if len == 0 {
            return Ok(());
        }
        let g = u64::from(c.hello.granularity);
        let size = c.hello.disk_size_bytes;
        let start = offset + self.payload_offset;
        let end = start + len;
        if !start.is_multiple_of(g) {
            let b = start - start % g;
            self.ensure(c, op, b, g.min(size - b))?;
        }
        if !end.is_multiple_of(g) && end != size {
            let b = end - end % g;
            self.ensure(c, op, b, g.min(size - b))?;
        }
        let _order = self
            .shared
            .apply
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        c.received.set_range(start, len);
        self.shared.cond.notify_all();
        Ok(())
    }
}

impl BlockDevice for IncomingDisk {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        if !self.complete() {
            let c = self.live("read")?;
            self.ensure(c, "read", offset + self.payload_offset, buf.len() as u64)?;
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        if !self.complete() {
            self.before_write("write", offset, buf.len() as u64)?;
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), BlockError> {
        if !self.complete() {
            self.live("flush")?;
        }
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        if !self.complete() {
            self.before_write("discard", offset, len)?;
        }
        self.inner.discard(offset, len)
    }
    fn block_status(&self, offset: u64, len: u64) -> Result<Extent, BlockError> {
        if !self.complete() {
            let c = self.live("block_status")?;
            if !c.received.all_set(offset + self.payload_offset, len) {
                // Not here yet: say "data", which is never wrong.
                return Ok(Extent {
                    len: len.min(self.inner.size().saturating_sub(offset)),
                    kind: ExtentKind::Data,
                });
            }
        }
        self.inner.block_status(offset, len)
    }
}
