//! Connecting: each channel is connected and greeted with Hello (the destination answers with
//! its own, or with an Error saying why it refuses); a resume also reads the destination's
//! list of what it still lacks, which becomes the new dirty set.

use super::reader::spawn_reader;
use super::state::{Channels, Shared};
use crate::channel::{self, Channel, MigrationAddress};
use crate::wire::{
    self, Frame, Hello, Role, WireError, FLAG_ANNOUNCES_READY, FLAG_AWAITS_READY, FLAG_CHECKPOINTS,
    FLAG_CHECKPOINTS_ACCEPTED, PROTOCOL_VERSION, SESSION_ID_LEN,
};
use crate::MigrationError;
use rustls::ClientConfig;
use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) fn random_session() -> [u8; SESSION_ID_LEN] {
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

/// Connects one channel and exchanges Hellos; returns the channel's halves and the flags of
/// the destination's Hello.
/// With `identity` (shared storage), also says which image this side serves and checks that
/// the destination serves the same one.
fn open_channel(
    to: &MigrationAddress,
    hello: Hello,
    identity: Option<&str>,
    tls: Option<&Arc<ClientConfig>>,
    peer_name: Option<&str>,
    timeout: Duration,
) -> Result<(Channel, u8), MigrationError> {
    let connect_error = |e: std::io::Error| MigrationError::Connect {
        to: to.to_string(),
        reason: if crate::wire::is_timeout(&e) {
            format!(
                "no answer within {} ms (the connect timeout)",
                timeout.as_millis()
            )
        } else {
            e.to_string()
        },
    };
    let mut ch = channel::connect(to, tls, peer_name, timeout).map_err(connect_error)?;
    let answer = wire::write_frame(&mut ch.writer, &Frame::Hello(hello))
        .and_then(|()| wire::read_frame(&mut ch.reader));
    let answer = match (answer, identity) {
        (Ok(Frame::Hello(h)), Some(identity)) => {
            if let Err(e) = check_answer(&hello, Frame::Hello(h)) {
                ch.closer.close();
                return Err(e);
            }
            let frame = Frame::SharedImage {
                identity: identity.to_owned(),
            };
            wire::write_frame(&mut ch.writer, &frame)
                .and_then(|()| wire::read_frame(&mut ch.reader))
                .map(|answer| match answer {
                    // The Hello was checked already; this answer says the image is the same.
                    Frame::SharedImage { identity: theirs } if theirs == identity => {
                        Frame::Hello(h)
                    }
                    Frame::SharedImage { identity: theirs } => Frame::Error {
                        message: format!(
                            "the destination serves another image ({theirs}; this side \
                             serves {identity})"
                        ),
                    },
                    other => other,
                })
        }
        (answer, _) => answer,
    };
    let answer = match answer {
        Err(WireError::Io(e)) if crate::wire::is_timeout(&e) => {
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
    let flags = match &answer {
        Frame::Hello(theirs) => theirs.flags,
        _ => 0,
    };
    check_answer(&hello, answer)?;
    Ok((ch, flags))
}

/// Whether the destination's answer to our `hello` lets the migration go on: its own Hello,
/// speaking our version about a disk of our size.
fn check_answer(hello: &Hello, answer: Frame) -> Result<(), MigrationError> {
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
            Ok(())
        }
        Frame::Error { message } => Err(MigrationError::Refused(message)),
        other => Err(MigrationError::Protocol(format!(
            "expected Hello from the destination, got {}",
            other.name()
        ))),
    }
}

/// Opens the bulk channel (as `role`) and, with preempt, the urgent one; starts their reader
/// threads. For `Role::Resume`, also reads the destination's list of missing ranges and makes
/// it the new dirty set.
pub(super) fn connect_all(
    shared: &Arc<Shared>,
    to: &MigrationAddress,
    role: Role,
    generation: u64,
) -> Result<Channels, MigrationError> {
    let tls = shared.opts.tls.as_ref();
    let timeout = shared.opts.connect_timeout;
    let identity = shared.hand_off.as_ref().map(|h| h.identity.as_str());
    let peer_name = shared.opts.peer_name.as_deref();
    let hello = shared.hello(role);
    let (mut bulk, flags) = open_channel(to, hello, identity, tls, peer_name, timeout)?;
    if role == Role::Bulk {
        let mut s = shared.lock();
        s.checkpoints_accepted =
            hello.flags & FLAG_CHECKPOINTS != 0 && flags & FLAG_CHECKPOINTS_ACCEPTED != 0;
        // A destination from before `Ready` never says it: switch over when asked, as then.
        s.awaits_ready = hello.flags & FLAG_AWAITS_READY != 0 && flags & FLAG_ANNOUNCES_READY != 0;
    }
    if role == Role::Resume {
        let missing = read_missing(shared, &mut bulk.reader);
        if let Err(e) = missing {
            bulk.closer.close();
            return Err(e);
        }
    }
    let mut closers = vec![bulk.closer.clone()];
    let urgent = if shared.opts.preempt {
        match open_channel(
            to,
            shared.hello(Role::Urgent),
            None,
            tls,
            peer_name,
            timeout,
        ) {
            Ok((ch, _)) => Some(ch),
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
    let ranges = read_missing_ranges(reader, shared.tracker.payload_offset(), shared.file.size())?;
    // The source is fenced, so its bitmap only changes here: exactly what the destination
    // lacks is what remains to send.
    bitmap.clear_all();
    for (off, len) in ranges {
        bitmap.set_range(off, len);
    }
    Ok(())
}

/// Reads the destination's Missing frames up to MissingEnd: payload ranges (offsets from the
/// start of the payload, which begins `payload` bytes into the `size`-byte image file).
fn read_missing_ranges(
    reader: &mut dyn Read,
    payload: u64,
    size: u64,
) -> Result<Vec<(u64, u64)>, MigrationError> {
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
            Frame::MissingEnd => return Ok(ranges),
            Frame::Error { message } => return Err(MigrationError::Refused(message)),
            other => {
                return Err(MigrationError::Protocol(format!(
                    "expected Missing or MissingEnd, got {}",
                    other.name()
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(disk_size_bytes: u64) -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            disk_size_bytes,
            granularity: 4096,
            header_len: 1 << 20,
            role: Role::Bulk,
            flags: 0,
            session: [3; SESSION_ID_LEN],
        }
    }

    #[test]
    fn the_destinations_hello_must_match_version_and_size() {
        let ours = hello(64 << 20);
        check_answer(&ours, Frame::Hello(hello(64 << 20))).unwrap();
        let other_version = Hello {
            version: PROTOCOL_VERSION + 1,
            ..hello(64 << 20)
        };
        assert!(matches!(
            check_answer(&ours, Frame::Hello(other_version)),
            Err(MigrationError::VersionMismatch { theirs, .. }) if theirs == PROTOCOL_VERSION + 1
        ));
        assert!(matches!(
            check_answer(&ours, Frame::Hello(hello(32 << 20))),
            Err(MigrationError::SizeMismatch {
                ours: 67108864,
                theirs: 33554432
            })
        ));
        let refusal = Frame::Error {
            message: "busy".into(),
        };
        assert!(matches!(
            check_answer(&ours, refusal),
            Err(MigrationError::Refused(m)) if m == "busy"
        ));
        assert!(matches!(
            check_answer(&ours, Frame::Complete),
            Err(MigrationError::Protocol(_))
        ));
    }

    fn stream(frames: &[Frame]) -> std::io::Cursor<Vec<u8>> {
        let mut bytes = Vec::new();
        for f in frames {
            f.encode_into(&mut bytes);
        }
        std::io::Cursor::new(bytes)
    }

    #[test]
    fn missing_ranges_become_payload_offsets() {
        let payload = 1 << 20;
        let mut r = stream(&[
            Frame::Missing {
                offset: payload,
                len: 4096,
            },
            Frame::Missing {
                offset: payload + (1 << 20),
                len: 8192,
            },
            Frame::MissingEnd,
        ]);
        let ranges = read_missing_ranges(&mut r, payload, 4 << 20).unwrap();
        assert_eq!(ranges, vec![(0, 4096), (1 << 20, 8192)]);
        // Nothing missing at all.
        let mut r = stream(&[Frame::MissingEnd]);
        assert!(read_missing_ranges(&mut r, payload, 4 << 20)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn missing_ranges_outside_the_payload_or_out_of_order_are_refused() {
        let payload = 1 << 20;
        let size = 4 << 20;
        for (offset, len) in [(0, 4096), (size - 4096, 8192), (size, 4096)] {
            let mut r = stream(&[Frame::Missing { offset, len }, Frame::MissingEnd]);
            assert!(
                matches!(
                    read_missing_ranges(&mut r, payload, size),
                    Err(MigrationError::OutOfRange { .. })
                ),
                "{len} bytes at {offset}"
            );
        }
        let mut r = stream(&[Frame::Complete]);
        assert!(matches!(
            read_missing_ranges(&mut r, payload, size),
            Err(MigrationError::Protocol(_))
        ));
        // The stream ends before MissingEnd.
        let mut r = stream(&[Frame::Missing {
            offset: payload,
            len: 4096,
        }]);
        assert!(read_missing_ranges(&mut r, payload, size).is_err());
    }
}
