//! A shared-storage migration's sender: no data moves, only the right to write. At the
//! switchover it releases the image's lock to the destination, and when the hand-off breaks
//! after that, whoever holds the lock is the writer.

use super::{Sender, Stop, TAKE_BACK_WAIT};
use crate::wire::{self, Frame};
use crate::Phase;
use std::time::{Duration, Instant};

impl Sender {
    /// Shared storage: waits for the switchover, then hands the image's lock over.
    pub(super) fn hand_off(&mut self) {
        let outcome = loop {
            match self.check() {
                Ok(Some(_)) => break self.release_to_destination(),
                Ok(None) => self.idle(Duration::from_secs(1)),
                Err(stop) => break Err((stop, false)),
            }
        };
        match outcome {
            Ok(()) => self.finish(Phase::Completed, None),
            Err((Stop::Cancelled, _)) => {
                let _ = wire::write_frame(
                    &mut self.ch.bulk,
                    &Frame::Error {
                        message: "migration cancelled on the source".into(),
                    },
                );
                self.abandon(Phase::Cancelled, None);
            }
            Err((Stop::Broken(e), false)) => {
                tracing::warn!("shared-storage migration failed before the hand-off: {e}");
                self.abandon(Phase::Failed, Some(e));
            }
            Err((Stop::Broken(e), true)) => self.take_back(e),
        }
    }

    /// The switchover of a shared-storage migration (the disk is fenced): flush, release the
    /// lock, Complete, and the destination's Complete once it holds the lock. `Err((_, true))`:
    /// the lock was released, so the destination may have it.
    fn release_to_destination(&mut self) -> Result<(), (Stop, bool)> {
        let storage = self.shared.shared_storage();
        storage.release().map_err(|e| {
            (
                Stop::Broken(format!("releasing the image's lock: {e}")),
                false,
            )
        })?;
        self.shared.lock().lock_released = true;
        self.frame_bulk(&Frame::Complete)
            .and_then(|()| self.wait_peer_complete(false))
            .map_err(|e| (e, true))?;
        let mut s = self.shared.lock();
        s.downtime = s.fenced_at.map(|t| t.elapsed());
        Ok(())
    }

    /// The hand-off broke after the lock was released: whoever takes the lock is the writer.
    /// If this side gets it back the destination never will, so the source carries on;
    /// otherwise the destination has the disk and the source stays fenced.
    fn take_back(&mut self, why: String) {
        self.ch.close();
        let storage = self.shared.shared_storage();
        // A destination that took the lock but could not answer gives it back: wait a moment
        // for that before concluding the destination serves.
        let deadline = Instant::now() + TAKE_BACK_WAIT;
        let taken = loop {
            match storage.acquire() {
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200))
                }
                other => break other,
            }
        };
        match taken {
            Ok(()) => {
                tracing::warn!("hand-off failed ({why}); the source took the lock back");
                self.shared.lock().lock_released = false;
                self.abandon(
                    Phase::Failed,
                    Some(format!(
                        "{why}; the source took the image's lock back and serves on"
                    )),
                );
            }
            Err(e) => {
                tracing::warn!("hand-off broke ({why}) and the lock is gone ({e})");
                self.finish(
                    Phase::Failed,
                    Some(format!(
                        "{why}; the image's lock could not be taken back ({e}), so the \
                         destination may be serving the disk: this side stays fenced"
                    )),
                );
            }
        }
    }
}
