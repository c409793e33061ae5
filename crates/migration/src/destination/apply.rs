//! Applying what the source sends: every frame checked (range, alignment, phase) before it has
//! any effect; data written, in postcopy only into blocks not received yet.

use super::state::{Created, DShared, SharedWriter};
use crate::wire::{self, Frame, Hello, Role};
use crate::{MigrationError, Phase};
use cryptblk_block::Container;
use std::io::Read;
use std::sync::PoisonError;

/// Pieces in which arriving data is written in postcopy, so guest writes never wait long for
/// the ordering lock.
const APPLY_PIECE: u64 = 1 << 20;

pub(super) fn read_frames(
    shared: &DShared,
    reader: &mut dyn Read,
    writer: &SharedWriter,
    role: Role,
    generation: u64,
) -> Result<(), MigrationError> {
    let c = shared.created()?;
    loop {
        let frame = wire::read_frame_after_idle(reader)?;
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
            (_, frame @ (Frame::Missing { .. } | Frame::Postcopy)) if c.shared() => {
                return Err(MigrationError::Protocol(format!(
                    "{} in a shared-storage migration (it has no postcopy)",
                    frame.name()
                )))
            }
            (_, Frame::Missing { offset, len }) => {
                let mut s = shared.lock();
                if s.phase != Phase::Precopy {
                    return Err(MigrationError::Protocol(format!(
                        "Missing in phase {}",
                        s.phase
                    )));
                }
                check_range(&c.hello, offset, len)?;
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
            (Role::Bulk, Frame::Checkpoints(carried)) => receive_checkpoints(shared, c, carried)?,
            (_, Frame::Postcopy) => {
                if shared.lock().phase == Phase::Precopy {
                    // Before any guest I/O passes: the checkpoints record from the first.
                    shared.deliver_checkpoints(None);
                }
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
            (Role::Bulk, Frame::SharedImage { identity }) => {
                confirm_identity(shared, c, &identity, writer)?
            }
            (_, Frame::Complete) if c.shared() => {
                take_over(shared, c)?;
                let answered = {
                    let mut w = writer.lock().unwrap_or_else(PoisonError::into_inner);
                    wire::write_frame(&mut *w, &Frame::Complete)
                };
                if let Err(e) = answered {
                    // The source cannot learn that this side took over: let go of the lock so
                    // that it can take it back and serve on.
                    if let Some(storage) = c.file.shared_storage() {
                        let _ = storage.release();
                    }
                    return Err(e.into());
                }
                let mut s = shared.lock();
                shared.set_phase(&mut s, Phase::Completed);
                return Ok(());
            }
            (_, Frame::Complete) => {
                let missing = c.received.blocks() - c.received.count();
                if missing != 0 {
                    return Err(MigrationError::Protocol(format!(
                        "the source completed with {missing} blocks never sent"
                    )));
                }
                c.file.flush()?;
                if shared.lock().phase == Phase::Precopy {
                    shared.deliver_checkpoints(None);
                }
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

/// The source's checkpoints, at switchover: once, before the destination is live, on a
/// migration that said it carries them, covering no more than the disk.
fn receive_checkpoints(
    shared: &DShared,
    c: &Created,
    carried: cryptblk_volume::checkpoint::CarriedCheckpoints,
) -> Result<(), MigrationError> {
    {
        let mut s = shared.lock();
        if !c.carries_checkpoints() || s.checkpoints_received || s.phase != Phase::Precopy {
            return Err(MigrationError::Protocol(format!(
                "Checkpoints in phase {} (once, before the switchover, and only when the \
                 Hellos agreed on them)",
                s.phase
            )));
        }
        s.checkpoints_received = true;
    }
    if carried.covered > c.hello.disk_size_bytes {
        return Err(MigrationError::Protocol(format!(
            "the checkpoints cover {} bytes of a {}-byte disk",
            carried.covered, c.hello.disk_size_bytes
        )));
    }
    shared.deliver_checkpoints(Some(carried));
    Ok(())
}

/// Shared storage: the source names the image it serves; this side answers with its own
/// image's identity if it is the same one, and refuses otherwise.
fn confirm_identity(
    shared: &DShared,
    c: &Created,
    identity: &str,
    writer: &SharedWriter,
) -> Result<(), MigrationError> {
    let storage = c
        .file
        .shared_storage()
        .filter(|_| c.shared())
        .ok_or_else(|| MigrationError::Protocol("SharedImage without shared storage".into()))?;
    let ours = storage.identity()?;
    if ours != identity {
        return Err(MigrationError::DifferentImage(format!(
            "the destination's image {} is not the one the source serves (its identity is \
             {ours}, the source's {identity}): listen on the same image",
            c.file.name().display()
        )));
    }
    {
        let mut w = writer.lock().unwrap_or_else(PoisonError::into_inner);
        wire::write_frame(&mut *w, &Frame::SharedImage { identity: ours })?;
    }
    shared.lock().identity_confirmed = true;
    Ok(())
}

/// Shared storage, at the source's Complete (it released the image's lock): take the lock,
/// after which this side is the image's only writer.
fn take_over(shared: &DShared, c: &Created) -> Result<(), MigrationError> {
    if !shared.lock().identity_confirmed {
        return Err(MigrationError::Protocol(
            "Complete before the source named the shared image".into(),
        ));
    }
    let storage = c
        .file
        .shared_storage()
        .ok_or_else(|| MigrationError::Protocol("a hand-off without shared storage".into()))?;
    storage.acquire()?;
    Ok(())
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

fn check_range(hello: &Hello, offset: u64, len: u64) -> Result<(), MigrationError> {
    let size = hello.disk_size_bytes;
    let end = offset.checked_add(len).filter(|&e| e <= size);
    let g = u64::from(hello.granularity);
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
    if c.shared() {
        return Err(MigrationError::Protocol(
            "data in a shared-storage migration (nothing is copied)".into(),
        ));
    }
    check_range(&c.hello, offset, len)?;
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
                write_payload(
                    &*c.file,
                    &payload,
                    offset,
                    piece - offset,
                    piece_end - piece,
                )?;
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
                    write_payload(&*c.file, &payload, offset, run_off - offset, run_len)?;
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
    file: &dyn Container,
    payload: &Payload<'_>,
    base: u64,
    skip: u64,
    len: u64,
) -> Result<(), MigrationError> {
    let at = base + skip;
    match payload {
        Payload::Data(d) => file.write_at(&d[skip as usize..(skip + len) as usize], at)?,
        Payload::Zero(_) => file.zero_range(at, len)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Role, PROTOCOL_VERSION, SESSION_ID_LEN};

    /// A 1 MiB + 512-byte disk in 4 KiB blocks (the last one short).
    fn hello() -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            disk_size_bytes: (1 << 20) + 512,
            granularity: 4096,
            header_len: 0,
            role: Role::Bulk,
            flags: 0,
            session: [0; SESSION_ID_LEN],
        }
    }

    #[test]
    fn whole_blocks_and_the_short_last_block_are_in_range() {
        let h = hello();
        assert!(check_range(&h, 0, 4096).is_ok());
        assert!(check_range(&h, 8192, 64 << 10).is_ok());
        assert!(check_range(&h, 1 << 20, 512).is_ok());
        assert!(check_range(&h, 0, (1 << 20) + 512).is_ok());
    }

    #[test]
    fn ranges_past_the_end_or_off_the_blocks_are_refused() {
        let h = hello();
        for (offset, len) in [(1 << 20, 4096), (u64::MAX - 10, 100), ((2 << 20), 0)] {
            assert!(
                matches!(
                    check_range(&h, offset, len),
                    Err(MigrationError::OutOfRange { .. })
                ),
                "{len} bytes at {offset}"
            );
        }
        for (offset, len) in [(512, 4096), (0, 1000), (4096, 4097)] {
            let e = check_range(&h, offset, len).unwrap_err();
            assert!(e.to_string().contains("not aligned"), "{e}");
        }
    }
}
