//! Session setup: accepting connections, the Hello handshake (a new session on the first bulk
//! channel; urgent channels and resumes join it), refusals, and what happens when a channel
//! breaks.

use super::apply::read_frames;
use super::requests::resend_outstanding;
use super::state::{Created, DShared, SharedWriter};
use crate::channel::{Channel, Incoming};
use crate::wire::{
    self, Frame, Hello, Role, WireError, FLAG_ANNOUNCES_READY, FLAG_AWAITS_READY, FLAG_CHECKPOINTS,
    FLAG_CHECKPOINTS_ACCEPTED, FLAG_SHARED, PROTOCOL_VERSION,
};
use crate::{DirtyBitmap, MigrationError, Phase};
use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Smallest and largest block a source may track at: finer would let a peer make us allocate
/// a huge bitmap, coarser makes every on-demand fetch large.
const MIN_GRANULARITY: u32 = 512;

const MAX_GRANULARITY: u32 = 1 << 20;

/// Most blocks tracked (a 256 MiB bitmap pair at most).
const MAX_BLOCKS: u64 = 1 << 31;

pub(super) fn accept_loop(shared: Arc<DShared>) {
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
        // Set up: the connection now carries the migration; a frame that has begun must
        // arrive within the frame timeout, the wait between frames is not bounded.
        Ok(Frame::Hello(h)) => match ch.set_timeouts(Some(shared.listener.frame_timeout())) {
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
    // Checkpoints come with a copy, into a new image (shared storage has none: rbd).
    ours.flags &= !FLAG_CHECKPOINTS_ACCEPTED;
    if theirs.role == Role::Bulk
        && theirs.flags & FLAG_CHECKPOINTS != 0
        && theirs.flags & FLAG_SHARED == 0
        && !shared.store.is_shared()
    {
        ours.flags |= FLAG_CHECKPOINTS_ACCEPTED;
    }
    ours.flags &= !FLAG_ANNOUNCES_READY;
    if theirs.role == Role::Bulk && theirs.flags & FLAG_AWAITS_READY != 0 && shared.announces_ready
    {
        ours.flags |= FLAG_ANNOUNCES_READY;
    }
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
    let name = shared.store.name().display();
    match (h.flags & FLAG_SHARED != 0, shared.store.is_shared()) {
        (true, false) => {
            return Err(format!(
                "the source hands over shared storage, but this destination creates a new \
                 image {name}: listen on the image the source serves"
            ))
        }
        (false, true) => {
            return Err(format!(
                "this destination takes over the existing image {name}, but the source copies \
                 its disk: start the migration with --shared (or listen on a new image)"
            ))
        }
        _ => {}
    }
    let file = shared.store.create(h.disk_size_bytes).map_err(|e| {
        if shared.store.is_shared() {
            format!("cannot open the shared image: {e}")
        } else {
            format!("cannot create the destination image: {e}")
        }
    })?;
    let g = u64::from(h.granularity);
    let bitmaps = DirtyBitmap::new(h.disk_size_bytes, g)
        .and_then(|r| Ok((r, DirtyBitmap::new(h.disk_size_bytes, g)?)));
    let (received, requested) = match bitmaps {
        Ok(b) => b,
        Err(e) => {
            drop(file);
            shared.store.remove();
            return Err(e.to_string());
        }
    };
    if shared.store.is_shared() {
        // Every block is here already: the source writes to the same image.
        received.set_all();
    }
    let _ = shared.created.set(Created {
        file,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(disk_size_bytes: u64, granularity: u32, header_len: u64) -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            disk_size_bytes,
            granularity,
            header_len,
            role: Role::Bulk,
            flags: 0,
            session: [7; crate::wire::SESSION_ID_LEN],
        }
    }

    #[test]
    fn a_plain_luks_hello_is_accepted() {
        assert_eq!(validate_hello(&hello(64 << 20, 4096, 16 << 20)), Ok(()));
        // A raw disk: no header, and a short last block.
        assert_eq!(validate_hello(&hello((1 << 20) + 512, 4096, 0)), Ok(()));
    }

    #[test]
    fn hostile_hellos_are_refused_by_what_is_wrong() {
        let refused = |h: Hello, needle: &str| {
            let e = validate_hello(&h).unwrap_err();
            assert!(e.contains(needle), "{e:?} does not mention {needle:?}");
        };
        refused(hello(0, 4096, 0), "empty");
        refused(hello(1 << 20, 3000, 0), "granularity 3000");
        refused(hello(1 << 20, 256, 0), "granularity 256");
        refused(hello(1 << 30, 2 << 20, 0), "granularity 2097152");
        refused(hello(1 << 20, 4096, 100), "header length 100");
        refused(hello(1 << 20, 4096, 2 << 20), "header length");
        // 2^31 blocks of 512 bytes is the limit: one byte more needs one block too many.
        refused(hello((1 << 40) + 1, 512, 0), "too large a bitmap");
        assert_eq!(validate_hello(&hello(1 << 40, 512, 0)), Ok(()));
    }
}
