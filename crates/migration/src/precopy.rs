//! Precopy migration: the sender copies the whole image file while the guest keeps running,
//! then resends what the guest dirtied, pass after pass, until what is left is small enough to
//! send during a short pause (`final_pass`, at switchover). The receiver writes what it is sent
//! after validating every frame.
//!
//! Conversation (every frame is from `wire`):
//!
//! ```text
//! sender                               receiver
//! Hello{version, file size, ...}  -->
//!                                 <--  Hello{its version, its file size, ...}
//!   (each side checks the other's Hello; on a mismatch the receiver also sends Error)
//! Chunk / Zero ... PassDone{1, dirty}  -->          pass 1: the whole file
//! Chunk / Zero ... PassDone{n, dirty}  -->          dirty passes, until converged
//!   ... the caller stops the guest (switchover) ...
//! Chunk / Zero ... PassDone{last, 0}, Complete -->
//!                                 <--  Complete (everything written and flushed)
//! ```
//!
//! Either side may send `Error{message}` instead and stop; the receiver does so for every frame
//! it refuses, and never writes any part of a refused frame.

use crate::dirty::DirtyBitmap;
use crate::wire::{self, Frame, Hello, WireError, MAX_CHUNK_LEN, PROTOCOL_VERSION};
use crate::{DirtyTracker, MigrationError};
use cryptblk_block::{BlockDevice, ExtentKind, RawFile};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// How the sender paces and ends the precopy phase.
#[derive(Debug, Clone)]
pub struct PrecopyOptions {
    /// Largest chunk of data per frame (1..=`wire::MAX_CHUNK_LEN`); also the largest dirty
    /// run taken from the bitmap at once.
    pub chunk_size: usize,
    /// Passes including the first full one; precopy stops after this many even if the guest
    /// dirties faster than we send (the final pass then has more to do).
    pub max_passes: u32,
    /// Precopy stops once at most this many bytes are dirty.
    pub converge_bytes: u64,
    /// Cap on chunk data sent per second, so migration does not starve the guest's own I/O
    /// or the network; `None` for no cap.
    pub max_bandwidth: Option<u64>,
}

impl Default for PrecopyOptions {
    fn default() -> Self {
        PrecopyOptions {
            chunk_size: 1 << 20,
            max_passes: 10,
            converge_bytes: 64 << 20,
            max_bandwidth: None,
        }
    }
}

impl PrecopyOptions {
    fn validate(&self) -> Result<(), MigrationError> {
        if self.chunk_size == 0 || self.chunk_size > MAX_CHUNK_LEN {
            return Err(MigrationError::InvalidOptions(format!(
                "chunk size {} is not within 1..={MAX_CHUNK_LEN}",
                self.chunk_size
            )));
        }
        if self.max_passes == 0 {
            return Err(MigrationError::InvalidOptions(
                "max_passes must be at least 1".into(),
            ));
        }
        if self.max_bandwidth == Some(0) {
            return Err(MigrationError::InvalidOptions(
                "max_bandwidth must be positive (use None for no limit)".into(),
            ));
        }
        Ok(())
    }
}

/// What the sender did; `final_pass` returns the totals including precopy.
#[derive(Debug, Clone, Default)]
pub struct SendStats {
    /// Chunk data bytes sent (excluding frame overhead).
    pub bytes_sent: u64,
    pub chunks: u64,
    /// Bytes sent as `Zero` ranges (holes), which cost 28 bytes on the wire each.
    pub zero_bytes: u64,
    /// Passes completed, the first full pass included.
    pub passes: u32,
    /// Bytes still dirty when the last pass ended (0 after `final_pass`).
    pub dirty_left: u64,
    pub elapsed: Duration,
    /// `bytes_sent` per second of `elapsed`.
    pub throughput_bytes_per_sec: f64,
}

impl SendStats {
    fn finish(&mut self, elapsed: Duration) {
        self.elapsed += elapsed;
        let secs = self.elapsed.as_secs_f64();
        self.throughput_bytes_per_sec = if secs > 0.0 {
            self.bytes_sent as f64 / secs
        } else {
            0.0
        };
    }
}

/// Sleeps so that the data sent never runs ahead of `rate` bytes per second since `start`.
struct Throttle {
    rate: Option<u64>,
    start: Instant,
    bytes: u64,
}

impl Throttle {
    fn new(rate: Option<u64>) -> Self {
        Throttle {
            rate,
            start: Instant::now(),
            bytes: 0,
        }
    }

    fn account(&mut self, n: u64) {
        let Some(rate) = self.rate else { return };
        self.bytes += n;
        let due = Duration::from_secs_f64(self.bytes as f64 / rate as f64);
        let elapsed = self.start.elapsed();
        if due > elapsed {
            std::thread::sleep(due - elapsed);
        }
    }
}

struct Sender<'a, S: Read + Write + ?Sized> {
    file: &'a dyn BlockDevice,
    stream: &'a mut S,
    chunk_size: usize,
    throttle: Throttle,
    stats: SendStats,
    buf: Vec<u8>,
}

impl<S: Read + Write + ?Sized> Sender<'_, S> {
    /// Turns a failed write into the peer's own explanation when it left one: a receiver
    /// that refuses a frame sends `Error` and hangs up, and our next write then fails with a
    /// bare EPIPE that says nothing about why.
    fn fail(&mut self, err: WireError) -> MigrationError {
        if matches!(err, WireError::Io(_)) {
            if let Ok(Frame::Error { message }) = wire::read_frame(self.stream) {
                return MigrationError::Refused(message);
            }
        }
        MigrationError::Wire(err)
    }

    fn frame(&mut self, frame: &Frame) -> Result<(), MigrationError> {
        wire::write_frame(self.stream, frame).map_err(|e| self.fail(e))
    }

    /// Sends `len` bytes of the file at `offset`: allocated extents as chunks, holes as
    /// `Zero` ranges, so sparse images stay cheap to move and sparse on arrival.
    fn send_range(&mut self, offset: u64, len: u64) -> Result<(), MigrationError> {
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let ext = self.file.block_status(pos, end - pos)?;
            // A device that answers zero bytes for a non-empty query would loop forever;
            // treat the rest as data instead.
            let (n, kind) = if ext.len == 0 {
                (end - pos, ExtentKind::Data)
            } else {
                (ext.len.min(end - pos), ext.kind)
            };
            match kind {
                ExtentKind::Data => self.send_data(pos, n)?,
                ExtentKind::Zero | ExtentKind::Unallocated => {
                    self.frame(&Frame::Zero {
                        offset: pos,
                        len: n,
                    })?;
                    self.stats.zero_bytes += n;
                }
            }
            pos += n;
        }
        Ok(())
    }

    fn send_data(&mut self, offset: u64, len: u64) -> Result<(), MigrationError> {
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let n = (end - pos).min(self.chunk_size as u64) as usize;
            self.buf.resize(n, 0);
            self.file.read_at(&mut self.buf[..n], pos)?;
            self.throttle.account(n as u64);
            let res = wire::write_chunk(self.stream, pos, &self.buf[..n]);
            res.map_err(|e| self.fail(e))?;
            self.stats.bytes_sent += n as u64;
            self.stats.chunks += 1;
            pos += n as u64;
        }
        Ok(())
    }

    /// One sweep over the dirty bitmap. Bits are taken before the data is read, so a write
    /// racing with the read is either in what we read or dirty again for the next sweep.
    fn send_dirty(&mut self, tracker: &DirtyTracker) -> Result<(), MigrationError> {
        for (off, len) in tracker.bitmap().drain(self.chunk_size as u64) {
            let (foff, flen) = tracker.file_range(off, len);
            self.send_range(foff, flen)?;
        }
        Ok(())
    }

    fn pass_done(&mut self, pass: u32, dirty_left: u64) -> Result<(), MigrationError> {
        self.frame(&Frame::PassDone { pass, dirty_left })?;
        self.stream.flush().map_err(|e| self.fail(e.into()))?;
        self.stats.passes = pass;
        self.stats.dirty_left = dirty_left;
        Ok(())
    }
}

fn check_layout(file: &dyn BlockDevice, tracker: &DirtyTracker) -> Result<u32, MigrationError> {
    let end = tracker.payload_offset().checked_add(tracker.size());
    if end.is_none_or(|e| e > file.size()) {
        return Err(MigrationError::InvalidOptions(format!(
            "the tracked volume ({} bytes at offset {}) does not fit in the {}-byte image file",
            tracker.size(),
            tracker.payload_offset(),
            file.size()
        )));
    }
    u32::try_from(tracker.bitmap().granularity()).map_err(|_| {
        MigrationError::InvalidOptions("dirty granularity does not fit the protocol (u32)".into())
    })
}

/// Checks the peer's Hello against ours; the same rules on both sides, so both report the
/// same mismatch.
fn check_hello(ours: &Hello, theirs: &Hello) -> Result<(), MigrationError> {
    if theirs.version != ours.version {
        return Err(MigrationError::VersionMismatch {
            ours: ours.version,
            theirs: theirs.version,
        });
    }
    if theirs.disk_size_bytes != ours.disk_size_bytes {
        return Err(MigrationError::SizeMismatch {
            ours: ours.disk_size_bytes,
            theirs: theirs.disk_size_bytes,
        });
    }
    Ok(())
}

/// Runs the precopy phase: handshake, then pass 1 over every allocated range of `file` (the
/// image file *under* the encryption, so ciphertext and header are copied as they are), then
/// passes over `tracker`'s dirty set until at most `opts.converge_bytes` are dirty or
/// `opts.max_passes` passes were made. Turns tracking on (clearing the bitmap) itself, before
/// pass 1 reads anything. The guest keeps writing through `tracker` meanwhile; call
/// [`final_pass`] after stopping it.
pub fn send_precopy<S: Read + Write + ?Sized>(
    file: &dyn BlockDevice,
    tracker: &DirtyTracker,
    stream: &mut S,
    opts: &PrecopyOptions,
) -> Result<SendStats, MigrationError> {
    opts.validate()?;
    let granularity = check_layout(file, tracker)?;
    let started = Instant::now();
    let ours = Hello {
        version: PROTOCOL_VERSION,
        disk_size_bytes: file.size(),
        granularity,
        header_len: tracker.payload_offset(),
    };
    let mut s = Sender {
        file,
        stream,
        chunk_size: opts.chunk_size,
        throttle: Throttle::new(opts.max_bandwidth),
        stats: SendStats::default(),
        buf: Vec::new(),
    };
    s.frame(&Frame::Hello(ours))?;
    s.stream.flush().map_err(|e| s.fail(e.into()))?;
    match wire::read_frame(s.stream)? {
        Frame::Hello(theirs) => {
            if let Err(e) = check_hello(&ours, &theirs) {
                let _ = wire::write_frame(
                    s.stream,
                    &Frame::Error {
                        message: e.to_string(),
                    },
                );
                return Err(e);
            }
        }
        Frame::Error { message } => return Err(MigrationError::Refused(message)),
        other => {
            return Err(MigrationError::Protocol(format!(
                "expected Hello from the receiver, got {}",
                frame_name(&other)
            )))
        }
    }

    tracker.start_tracking();
    s.send_range(0, file.size())?;
    let mut pass = 1;
    loop {
        let dirty = tracker.bitmap().dirty_bytes();
        s.pass_done(pass, dirty)?;
        tracing::debug!(pass, dirty, sent = s.stats.bytes_sent, "precopy pass done");
        if dirty <= opts.converge_bytes || pass >= opts.max_passes {
            break;
        }
        pass += 1;
        s.send_dirty(tracker)?;
    }
    let mut stats = s.stats;
    stats.finish(started.elapsed());
    Ok(stats)
}

/// Switchover: with the guest stopped (nothing writes through `tracker` any more), sends
/// everything still dirty, then `Complete`, and waits until the receiver confirms that it
/// wrote and flushed everything. Returns totals including `precopy`. Tracking stays on, so
/// that if this fails the source can resume the guest and retry without a full copy.
pub fn final_pass<S: Read + Write + ?Sized>(
    file: &dyn BlockDevice,
    tracker: &DirtyTracker,
    stream: &mut S,
    opts: &PrecopyOptions,
    precopy: &SendStats,
) -> Result<SendStats, MigrationError> {
    opts.validate()?;
    check_layout(file, tracker)?;
    let started = Instant::now();
    let mut s = Sender {
        file,
        stream,
        chunk_size: opts.chunk_size,
        throttle: Throttle::new(opts.max_bandwidth),
        stats: precopy.clone(),
        buf: Vec::new(),
    };
    // One sweep suffices when the guest is really stopped; a few more tolerate writes that
    // were in flight at the stop, but a disk that stays dirty means the caller did not stop
    // the frontend, and completing would lose those writes.
    const MAX_SWEEPS: u32 = 8;
    let mut sweeps = 0;
    while tracker.bitmap().count() > 0 {
        if sweeps == MAX_SWEEPS {
            return Err(MigrationError::StillDirty {
                dirty_bytes: tracker.bitmap().dirty_bytes(),
                sweeps,
            });
        }
        s.send_dirty(tracker)?;
        sweeps += 1;
    }
    let pass = s.stats.passes + 1;
    s.pass_done(pass, 0)?;
    s.frame(&Frame::Complete)?;
    s.stream.flush().map_err(|e| s.fail(e.into()))?;
    match wire::read_frame(s.stream)? {
        Frame::Complete => {}
        Frame::Error { message } => return Err(MigrationError::Refused(message)),
        other => {
            return Err(MigrationError::Protocol(format!(
                "expected Complete from the receiver, got {}",
                frame_name(&other)
            )))
        }
    }
    let mut stats = s.stats;
    stats.finish(started.elapsed());
    Ok(stats)
}

/// What the receiver did.
#[derive(Debug)]
pub struct ReceiveStats {
    /// Chunk data bytes written.
    pub bytes_written: u64,
    pub chunks: u64,
    /// Bytes made holes (or zeroed) on `Zero` frames.
    pub zero_bytes: u64,
    /// The last pass the sender reported done.
    pub passes: u32,
    /// The sender's header length (LUKS data offset), from its Hello.
    pub header_len: u64,
    /// Which blocks (at the sender's granularity, file offsets) were written at least once;
    /// postcopy will use it to know what still has to be fetched.
    pub received: DirtyBitmap,
    pub elapsed: Duration,
}

/// The smallest granularity a sender may ask for: finer ones would let a peer make us
/// allocate a huge `received` bitmap (1 bit per byte of disk).
const MIN_GRANULARITY: u32 = 512;

/// Receives a migration into `file` (opened writable; the same size as the source's image
/// file). Every frame is validated before it has any effect: checksums by the parser, ranges
/// against the file size here, so a refused frame writes nothing. On any error the receiver
/// tells the sender why (best effort) and returns the error; on `Complete` it flushes the file,
/// confirms, and returns.
pub fn receive<S: Read + Write + ?Sized>(
    file: &RawFile,
    stream: &mut S,
) -> Result<ReceiveStats, MigrationError> {
    let res = receive_inner(file, stream);
    if let Err(e) = &res {
        // The sender is owed an explanation unless the stream itself is what failed, or the
        // sender is the one who aborted.
        let stream_broken = matches!(
            e,
            MigrationError::Wire(WireError::Io(_) | WireError::Closed) | MigrationError::Refused(_)
        );
        if !stream_broken {
            let _ = wire::write_frame(
                stream,
                &Frame::Error {
                    message: format!("receiver: {e}"),
                },
            );
            let _ = stream.flush();
        }
    }
    res
}

fn receive_inner<S: Read + Write + ?Sized>(
    file: &RawFile,
    stream: &mut S,
) -> Result<ReceiveStats, MigrationError> {
    if file.read_only() {
        return Err(MigrationError::InvalidOptions(
            "the destination image must be opened writable".into(),
        ));
    }
    let started = Instant::now();
    let size = file.size();
    let theirs = match wire::read_frame(stream)? {
        Frame::Hello(h) => h,
        Frame::Error { message } => return Err(MigrationError::Refused(message)),
        other => {
            return Err(MigrationError::Protocol(format!(
                "expected Hello, got {}",
                frame_name(&other)
            )))
        }
    };
    // Answer with our own Hello before judging theirs, so that the sender sees our version
    // and size and can report the same mismatch we do.
    let ours = Hello {
        version: PROTOCOL_VERSION,
        disk_size_bytes: size,
        granularity: theirs.granularity,
        header_len: theirs.header_len,
    };
    wire::write_frame(stream, &Frame::Hello(ours))?;
    stream.flush().map_err(WireError::from)?;
    check_hello(&ours, &theirs)?;
    if theirs.granularity < MIN_GRANULARITY || !theirs.granularity.is_power_of_two() {
        return Err(MigrationError::Protocol(format!(
            "granularity {} is not a power of two of at least {MIN_GRANULARITY}",
            theirs.granularity
        )));
    }
    if theirs.header_len > size {
        return Err(MigrationError::Protocol(format!(
            "header length {} exceeds the {size}-byte disk",
            theirs.header_len
        )));
    }
    let mut stats = ReceiveStats {
        bytes_written: 0,
        chunks: 0,
        zero_bytes: 0,
        passes: 0,
        header_len: theirs.header_len,
        received: DirtyBitmap::new(size, u64::from(theirs.granularity))?,
        elapsed: Duration::ZERO,
    };
    let in_disk = |offset: u64, len: u64| match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(MigrationError::OutOfRange {
            offset,
            len,
            disk_size: size,
        }),
    };
    loop {
        match wire::read_frame(stream)? {
            Frame::Chunk { offset, data, .. } => {
                in_disk(offset, data.len() as u64)?;
                file.write_at(&data, offset)?;
                stats.received.set_range(offset, data.len() as u64);
                stats.bytes_written += data.len() as u64;
                stats.chunks += 1;
            }
            Frame::Zero { offset, len } => {
                in_disk(offset, len)?;
                zero_range(file, offset, len)?;
                stats.received.set_range(offset, len);
                stats.zero_bytes += len;
            }
            Frame::PassDone { pass, dirty_left } => {
                if pass <= stats.passes {
                    return Err(MigrationError::Protocol(format!(
                        "pass {pass} reported after pass {}",
                        stats.passes
                    )));
                }
                tracing::debug!(pass, dirty_left, "receiver: pass done");
                stats.passes = pass;
            }
            Frame::Complete => {
                file.flush()?;
                wire::write_frame(stream, &Frame::Complete)?;
                stream.flush().map_err(WireError::from)?;
                stats.elapsed = started.elapsed();
                return Ok(stats);
            }
            Frame::Error { message } => return Err(MigrationError::Refused(message)),
            Frame::Hello(_) => {
                return Err(MigrationError::Protocol("Hello after the handshake".into()))
            }
        }
    }
}

/// Makes a range read as zeros: a hole where the filesystem can punch one (keeping the
/// destination as sparse as the source), written zeros where it cannot.
fn zero_range(file: &RawFile, offset: u64, len: u64) -> Result<(), MigrationError> {
    if file.punch_hole(offset, len).is_ok() {
        return Ok(());
    }
    const ZEROS: usize = 1 << 20;
    let zeros = vec![0u8; ZEROS.min(len as usize)];
    let mut pos = offset;
    let end = offset + len;
    while pos < end {
        let n = (end - pos).min(zeros.len() as u64) as usize;
        file.write_at(&zeros[..n], pos)?;
        pos += n as u64;
    }
    Ok(())
}

fn frame_name(f: &Frame) -> &'static str {
    match f {
        Frame::Hello(_) => "Hello",
        Frame::Chunk { .. } => "Chunk",
        Frame::Zero { .. } => "Zero",
        Frame::PassDone { .. } => "PassDone",
        Frame::Complete => "Complete",
        Frame::Error { .. } => "Error",
    }
}
