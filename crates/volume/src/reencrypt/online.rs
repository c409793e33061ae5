//! A served LUKS2 volume's key replaced while it serves: the reencryption started in the
//! header (or the one there picked up), then for each hotzone the part fenced off from the
//! asynchronous path, rewritten under the hotzone lock with `Reencryption::step`
//! (cryptsetup's commit order, crash-safe per the resilience mode), the boundary moved in the
//! map, and a sleep as long as the bandwidth limit asks.
use super::error::{chain, step, Context, OnlineError};
use super::prepare::convert_luks1_first;
use super::run::{Run, MAX_HOTZONE};
use super::{Hotzone, OnlineMode, Outcome, RunStart, Supervisor};
use cryptblk_luks::luks2::reencrypt::{Reencryption, Resilience};
use cryptblk_luks::{HeaderIo, LuksImage};
use std::time::Instant;

impl Run<'_> {
    /// A new volume key: to the end or a pause.
    pub(super) fn rotate<S: Supervisor>(&self, supervisor: &S) -> Result<Outcome, S::Error> {
        let io = self.file().header_io();
        let (mut r, start) = self.open(io, supervisor)?;
        if self.rewrite(io, &mut r, start, supervisor)? == Outcome::Paused {
            return Ok(Outcome::Paused);
        }
        if let Err(e) = self.segments().finish() {
            tracing::warn!(disk = %self.name(), "the old volume key stays in memory until the requests still in flight complete: {e}");
        }
        Ok(Outcome::Finished)
    }

    /// Starts the reencryption in the header unless one is there (a LUKS1 header becomes
    /// LUKS2 first), unlocks both keys, and puts the new segment in the volume's map.
    fn open<'f, S: Supervisor>(
        &self,
        io: &'f dyn HeaderIo,
        supervisor: &S,
    ) -> Result<(Reencryption<'f>, RunStart), S::Error> {
        let image = &self.image;
        let (header, _) =
            LuksImage::read(io).with_context(|| format!("reading the LUKS header of {image}"))?;
        let mut hdr = match header {
            LuksImage::V2(hdr) => hdr,
            LuksImage::V1(v1) => {
                // The run's ticket (the caller's) keeps keyslot changes, resizes and
                // migrations away while the header changes.
                let (hdr, placement) = convert_luks1_first(
                    io,
                    &v1,
                    self.options.passphrase,
                    self.options.unlock,
                    image,
                )
                .map_err(OnlineError::from)?;
                tracing::info!(disk = %self.name(), ?placement, "converted the LUKS1 header to LUKS2 before re-encrypting");
                hdr
            }
        };
        if hdr
            .reencrypt_state()
            .context("reading the reencryption state")?
            .is_none()
        {
            if self.segments().is_split() {
                return Err(OnlineError::HeaderLost {
                    image: image.clone(),
                }
                .into());
            }
            let params = supervisor.reencryption_params(&hdr)?;
            hdr.reencrypt_init(io, self.options.passphrase, self.options.unlock, &params)
                .with_context(|| format!("starting the reencryption of {image}"))?;
            tracing::info!(disk = %self.name(), "reencryption initialised in the header");
        }
        let mut r = self
            .unlock_reencryption(io, hdr)
            .with_context(|| format!("opening the reencryption of {image}"))?;
        self.record_session_keys(&r, supervisor);
        let online = r
            .online_segments()
            .or_else(|_| {
                // A hotzone left by a failed step of this run (a restart recovers at open).
                let _rewrite = self.segments().hotzone_write();
                r.recover()?;
                r.online_segments()
            })
            .with_context(|| image.clone())?;
        let segments = self.segments();
        if segments.is_split() {
            if segments.committed() != online.done {
                return Err(OnlineError::BoundaryMoved {
                    image: image.clone(),
                    header: online.done,
                    served: segments.committed(),
                }
                .into());
            }
        } else {
            let cipher = crate::data_cipher(self.file().as_ref(), online.new.clone());
            segments
                .split(cipher, online.done)
                .context("serving the new segment")?;
        }
        let start = RunStart {
            mode: OnlineMode::Reencrypt,
            done: online.done,
            total: online.size,
            resilience: r.state().resilience.name().to_string(),
            cipher: online.new_cipher_name.clone(),
        };
        Ok((r, start))
    }

    /// Rewrites hotzones until the end or a pause.
    fn rewrite<S: Supervisor>(
        &self,
        io: &dyn HeaderIo,
        r: &mut Reencryption<'_>,
        start: RunStart,
        supervisor: &S,
    ) -> Result<Outcome, S::Error> {
        let hotzone = self.hotzone_len(MAX_HOTZONE.min(r.max_hotzone()), r.alignment());
        let total = r.device_size().context("reading the volume size")?;
        let started = Instant::now();
        let mut rewritten = 0u64;
        supervisor.started(start);
        loop {
            if self.pause_requested() {
                r.checkpoint().context("committing the boundary")?;
                return Ok(Outcome::Paused);
            }
            let done = r.done_bytes().context("reading the boundary")?;
            if done >= total {
                r.finish().context("finishing the reencryption")?;
                self.record_final_key(r, supervisor);
                return Ok(Outcome::Finished);
            }
            let len = hotzone.min(total - done);
            supervisor.hotzone(Hotzone { offset: done, len });
            // Bounded (DRAIN_TIMEOUT): a request the device never answers fails this step
            // instead of stalling the run; the volume keeps serving, a later run waits anew.
            self.segments().announce(done + len).map_err(|e| {
                step(
                    format!("fencing off the hotzone of {len} bytes at {done}"),
                    e,
                )
            })?;
            let rewrite = self.segments().hotzone_write();
            let stepped = r.step(len).and_then(|rep| {
                if r.state().resilience == Resilience::None {
                    // Online, the boundary is committed after every hotzone: a crash
                    // loses at most the hotzone being rewritten (as cryptsetup's `none`).
                    r.checkpoint()?;
                }
                Ok(rep)
            });
            let rep = match stepped {
                Ok(rep) => rep,
                Err(e) => {
                    let e = step(format!("rewriting the hotzone of {len} bytes at {done}"), e);
                    // Part of the hotzone may hold new ciphertext: put it right (as a restart
                    // would) before any request may touch it again.
                    match self.recover(io) {
                        Ok(at) => {
                            if let Err(again) = self.segments().advance(&rewrite, at) {
                                tracing::warn!(disk = %self.name(), "after the recovery: {again}");
                            }
                        }
                        Err(again) => {
                            tracing::error!(disk = %self.name(), "the interrupted hotzone could not be recovered ({}): requests on the synchronous path stay blocked until the daemon restarts", chain(&again));
                            // Never serve a half-rewritten hotzone with the wrong key.
                            std::mem::forget(rewrite);
                        }
                    }
                    return Err(e.into());
                }
            };
            let advanced = self.segments().advance(&rewrite, rep.done);
            drop(rewrite);
            rewritten += rep.done - done;
            supervisor.advanced(rep.done);
            advanced.map_err(|e| step("moving the boundary for the queues", e))?;
            self.throttle(started, rewritten);
        }
    }

    /// Recovers an interrupted hotzone from what the header says; returns the boundary.
    fn recover(&self, io: &dyn HeaderIo) -> Result<u64, OnlineError> {
        let mut r = self.reopen(io)?;
        r.recover().context("recovering the hotzone")?;
        r.done_bytes().context("reading the boundary")
    }
}
