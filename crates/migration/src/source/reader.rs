//! A reader thread per channel: queues the destination's urgent requests for the sender (or the
//! urgent answerer), notes its Complete, and marks the channels broken on anything else.

use super::state::{Shared, State};
use crate::wire::{self, Frame, WireError};
use std::io::Read;
use std::sync::Arc;

/// Most urgent requests queued at once (a destination has at most one per waiting read).
const MAX_QUEUED_URGENT: usize = 1 << 16;

/// What the reader thread does after a frame.
#[derive(Debug, PartialEq)]
enum After {
    /// Read the next frame.
    Read,
    /// Stop reading: these channels are superseded, or already marked broken.
    Exit,
    /// Stop reading and mark the channels broken for this reason.
    Fail(String),
}

/// Takes one frame the destination sent on a channel of `generation`.
fn heard(s: &mut State, generation: u64, frame: Frame) -> After {
    match frame {
        Frame::Request { offset, len } => {
            if s.generation != generation {
                return After::Exit;
            }
            // Bounded by what the destination can have outstanding; a peer that floods is cut
            // off.
            if s.urgent.len() >= MAX_QUEUED_URGENT {
                if s.broken.is_none() {
                    s.broken = Some("the destination flooded urgent requests".into());
                }
                return After::Exit;
            }
            s.urgent.push_back((offset, len));
            After::Read
        }
        Frame::Complete => {
            if s.generation == generation {
                s.peer_complete = true;
            }
            After::Read
        }
        // Only a destination that said it would, and only once it serves the disk.
        Frame::Ready if s.awaits_ready => {
            s.peer_ready = true;
            After::Read
        }
        Frame::Error { message } => After::Fail(format!("the destination aborted: {message}")),
        other => After::Fail(format!("unexpected {} from the destination", other.name())),
    }
}

pub(super) fn spawn_reader(
    shared: Arc<Shared>,
    mut reader: Box<dyn Read + Send>,
    generation: u64,
    what: &'static str,
) {
    let _ = std::thread::Builder::new()
        .name(format!("migrate-rx-{what}"))
        .spawn(move || {
            let err = loop {
                let after = match wire::read_frame(&mut reader) {
                    Ok(frame) => {
                        let after = heard(&mut shared.lock(), generation, frame);
                        shared.cond.notify_all();
                        after
                    }
                    Err(WireError::Closed) => {
                        After::Fail("the destination closed the connection".into())
                    }
                    Err(e) => After::Fail(format!("{what} channel: {e}")),
                };
                match after {
                    After::Read => {}
                    After::Exit => return,
                    After::Fail(e) => break e,
                }
            };
            let mut s = shared.lock();
            if s.generation == generation && s.broken.is_none() {
                s.broken = Some(err);
                shared.cond.notify_all();
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_queue_in_order_for_the_current_channels_only() {
        let mut s = State::new();
        s.generation = 2;
        let request = |offset| Frame::Request { offset, len: 4096 };
        assert_eq!(heard(&mut s, 2, request(8192)), After::Read);
        assert_eq!(heard(&mut s, 2, request(4096)), After::Read);
        assert_eq!(
            Vec::from(s.urgent.clone()),
            vec![(8192, 4096), (4096, 4096)]
        );
        // A reader of channels a recover replaced stops without a word.
        assert_eq!(heard(&mut s, 1, request(0)), After::Exit);
        assert_eq!(s.urgent.len(), 2);
        assert!(s.broken.is_none());
    }

    #[test]
    fn a_flood_of_requests_breaks_the_channels() {
        let mut s = State::new();
        s.urgent
            .extend((0..MAX_QUEUED_URGENT as u64).map(|i| (i * 4096, 4096)));
        let flood = Frame::Request {
            offset: 0,
            len: 4096,
        };
        assert_eq!(heard(&mut s, 0, flood), After::Exit);
        assert_eq!(s.urgent.len(), MAX_QUEUED_URGENT);
        assert!(s.broken.as_deref().unwrap().contains("flooded"));
    }

    #[test]
    fn complete_counts_only_from_the_current_channels() {
        let mut s = State::new();
        s.generation = 1;
        assert_eq!(heard(&mut s, 0, Frame::Complete), After::Read);
        assert!(!s.peer_complete);
        assert_eq!(heard(&mut s, 1, Frame::Complete), After::Read);
        assert!(s.peer_complete);
    }

    #[test]
    fn errors_and_unexpected_frames_break_the_channels_with_a_reason() {
        let mut s = State::new();
        let abort = Frame::Error {
            message: "disk full".into(),
        };
        assert_eq!(
            heard(&mut s, 0, abort),
            After::Fail("the destination aborted: disk full".into())
        );
        assert_eq!(
            heard(&mut s, 0, Frame::Postcopy),
            After::Fail("unexpected Postcopy from the destination".into())
        );
    }

    #[test]
    fn ready_counts_only_from_a_destination_that_announced_it() {
        let mut s = State::new();
        assert_eq!(
            heard(&mut s, 0, Frame::Ready),
            After::Fail("unexpected Ready from the destination".into())
        );
        assert!(!s.peer_ready);
        s.awaits_ready = true;
        assert_eq!(heard(&mut s, 0, Frame::Ready), After::Read);
        assert!(s.peer_ready);
    }
}
