//! The sender thread, which owns the writing half of every channel: the header, precopy sweeps
//! of what is dirty (holes as Zero frames, data as chunks sent in checksummed slices), the
//! switchover, postcopy (urgent requests first), and pausing for a recover.

mod hand_off;

use super::pacing::{link_sent, wait_link, Link};
use super::read_ahead::ReadAhead;
use super::state::{Channels, Shared};
use super::stop::Stop;
use super::urgent::{answer_urgent, spawn_urgent_answerer};
use crate::wire::{self, Frame};
use crate::{DirtyBitmap, Phase};
use cryptblk_block::ExtentKind;
use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

struct Sender {
    shared: Arc<Shared>,
    ch: Channels,
    link: Arc<Mutex<Link>>,
    /// Reads the image for bulk chunks (opened on the first chunk).
    read_ahead: Option<ReadAhead>,
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

/// How long a source whose hand-off broke keeps trying to take the image's lock back.
const TAKE_BACK_WAIT: Duration = Duration::from_secs(5);

/// Bytes of the image read at once for the bulk stream (at least one slice).
const READ_PIECE: usize = 256 << 10;

pub(super) fn run_sender(shared: Arc<Shared>, ch: Channels) {
    let link = Arc::new(Mutex::new(Link::new(shared.opts.max_bandwidth)));
    let mut ch = ch;
    if let Some(w) = ch.urgent.take() {
        spawn_urgent_answerer(shared.clone(), link.clone(), w, 0);
    }
    let mut s = Sender {
        link,
        shared,
        ch,
        read_ahead: None,
        urgent_buf: Vec::new(),
        cursor: 0,
        sweep_sent: false,
        data_until: 0,
        switching: false,
    };
    if s.shared.hand_off.is_some() {
        s.hand_off();
        return;
    }
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

    /// Checks what other threads asked for; `Err` to stop. A switchover deferred until the
    /// destination serves the disk starts here (the disk is fenced) once it does.
    fn check(&self) -> Result<Option<bool>, Stop> {
        let mut s = self.shared.lock();
        if s.cancel {
            return Err(Stop::Cancelled);
        }
        if let Some(e) = &s.broken {
            return Err(Stop::Broken(e.clone()));
        }
        if s.peer_ready {
            if let Some(postcopy) = s.deferred_switchover.take() {
                drop(s);
                tracing::info!("the destination serves the disk: switching over as asked");
                return match self.shared.fence_for_switchover(postcopy) {
                    Ok(()) => Ok(Some(postcopy)),
                    // Cancelled while fencing: say so.
                    Err(_) => self.check(),
                };
            }
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
        let deferred_due = s.peer_ready && s.deferred_switchover.is_some();
        if s.urgent.is_empty()
            && s.switchover.is_none()
            && !deferred_due
            && !s.cancel
            && s.broken.is_none()
        {
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
        self.send_checkpoints()?;
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

    /// Carries the disk's checkpoints to a destination that takes them, first thing at the
    /// switchover: the disk is fenced, so they hold every write the source will ever record.
    /// Checkpoints that cannot be had are not sent (the destination then has none); the
    /// migration goes on, the source's store stays as it is.
    fn send_checkpoints(&mut self) -> Result<(), Stop> {
        let Some(source) = self.shared.opts.checkpoints.clone() else {
            return Ok(());
        };
        if !self.shared.lock().checkpoints_accepted {
            return Ok(());
        }
        match (source.0)() {
            Ok(carried) => self.frame_bulk(&Frame::Checkpoints(carried)),
            Err(e) => {
                tracing::warn!("the disk's checkpoints are not carried: {e}");
                Ok(())
            }
        }
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
        let mut read_ahead = match self.read_ahead.take() {
            Some(r) => r,
            None => ReadAhead::open(
                &self.shared.file,
                READ_PIECE.max(self.shared.opts.slice_size),
            )
            .map_err(|e| Stop::Broken(format!("reading the image: {e}")))?,
        };
        self.shared.lock().bulk_in_chunk = true;
        let res = self.send_chunk_data(&mut read_ahead, offset, len, urgent_between_slices);
        // A chunk broken off (or failed) may leave the next piece's read in flight.
        read_ahead.settle();
        self.read_ahead = Some(read_ahead);
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
        let sent = res?;
        let mut s = self.shared.lock();
        s.bytes_sent += sent;
        s.chunks += 1;
        Ok(())
    }

    /// Whether a switchover waits for the bulk stream (and this is not the switchover's own
    /// sending), a deferred one too once the destination is ready.
    fn switchover_waiting(&self) -> bool {
        let s = self.shared.lock();
        !self.switching
            && (s.switchover.is_some() || (s.peer_ready && s.deferred_switchover.is_some()))
    }

    /// Reads one bulk chunk in pieces (the next piece read while this one is sent) and sends
    /// it as one frame per slice (each with its own checksum). With `urgent_between_slices`,
    /// urgent requests are answered between slices, so a large chunk never holds one up for
    /// more than a slice. A switchover asked for meanwhile breaks the chunk off: what was not
    /// sent is marked dirty again, so the switchover waits for one slice, not for a chunk at
    /// the bandwidth cap. Returns the bytes sent.
    fn send_chunk_data(
        &mut self,
        read_ahead: &mut ReadAhead,
        offset: u64,
        len: u64,
        urgent_between_slices: bool,
    ) -> Result<u64, Stop> {
        let read_failed = |e: cryptblk_block::BlockError| Stop::Broken(e.to_string());
        let slice = self.shared.opts.slice_size;
        let payload = self.shared.tracker.payload_offset();
        let piece = read_ahead.piece_size() as u64;
        let mut which = 0;
        read_ahead
            .start(which, offset, piece.min(len) as usize)
            .map_err(read_failed)?;
        let mut pos = 0u64;
        while pos < len {
            let piece_end = (pos + piece).min(len);
            // The piece at `pos` is in buffer `which`; start reading the next one into the
            // other buffer before sending this one.
            read_ahead.finish().map_err(read_failed)?;
            if piece_end < len {
                let next = (piece.min(len - piece_end)) as usize;
                read_ahead
                    .start(which ^ 1, offset + piece_end, next)
                    .map_err(read_failed)?;
            }
            let mut at_in_piece = 0u64;
            while pos < piece_end {
                if urgent_between_slices {
                    self.serve_urgent()?;
                }
                let at = offset + pos;
                if at >= payload && self.switchover_waiting() {
                    self.bitmap().set_range(at - payload, len - pos);
                    return Ok(pos);
                }
                let end = (pos + slice as u64).min(piece_end);
                self.wait_link();
                let bytes = read_ahead.buffer(which).map_err(read_failed)?;
                let s = at_in_piece as usize;
                wire::write_chunk(&mut self.ch.bulk, at, &bytes[s..s + (end - pos) as usize])?;
                link_sent(&self.link, (end - pos) as usize + wire::CHUNK_OVERHEAD);
                at_in_piece += end - pos;
                pos = end;
            }
            which ^= 1;
        }
        Ok(len)
    }
}
