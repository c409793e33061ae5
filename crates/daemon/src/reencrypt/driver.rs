//! The reencryption thread: starts the reencryption in the header (or picks up the one there),
//! then for each hotzone fences it off from the asynchronous path, rewrites it under the
//! hotzone lock with `Reencryption::step` (cryptsetup's commit order, crash-safe per the
//! resilience mode), moves the boundary, and sleeps as long as the bandwidth limit asks.
use super::{Mode, Progress, ReencryptJob};
use crate::disk::AttachedDisk;
use crate::error::{chain, Context, Error, Result};
use crate::key_file::Passphrase;
use crossbeam_channel::Sender;
use cryptblk_block::Container;
use cryptblk_control::api::{Hotzone, ReencryptPhase, ReencryptStartParams, Resilience};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::luks1::Luks1Header;
use cryptblk_luks::luks2::from_luks1::convert_luks1;
use cryptblk_luks::luks2::reencrypt::{
    InitParams, Reencryption, Resilience as LuksResilience, ResilienceChoice,
};
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{HashAlg, LuksImage, LuksVersion, UnlockOptions};
use cryptblk_volume::SegmentMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest hotzone: what requests touching it may wait for while it is rewritten.
pub(super) const MAX_HOTZONE: u64 = 4 << 20;
/// Longest sleep between two looks at the pause flag.
const PAUSE_POLL: Duration = Duration::from_millis(50);

pub(super) struct Run {
    pub name: String,
    pub mode: Mode,
    /// The disk: an encryption makes its record LUKS once the header is written.
    pub disk: Arc<AttachedDisk>,
    pub file: Arc<dyn Container>,
    pub segments: Arc<SegmentMap>,
    pub passphrase: Passphrase,
    pub params: ReencryptStartParams,
    pub max_bandwidth: u64,
    pub pool: Arc<CryptoPool>,
    pub unlock: UnlockOptions,
    pub job: Arc<ReencryptJob>,
    /// Where the volume keys go when they change (`--key-cache`).
    pub key_cache: Option<Arc<crate::key_cache::KeyCache>>,
}

impl Run {
    /// Runs to the end, a pause or an error; `ready` hears whether it got going (an error
    /// before that is its answer, and the status stays as it was).
    pub(super) fn run(self, ready: Sender<Result<()>>) {
        let mut ready = Some(ready);
        let outcome = match self.mode {
            Mode::Reencrypt => self.rotate(&mut ready),
            Mode::Encrypt => self.encrypt(&mut ready),
        };
        let name = &self.name;
        match outcome {
            Err(e) if ready.is_some() => {
                if let Some(tx) = ready.take() {
                    let _ = tx.send(Err(e));
                }
            }
            Ok(true) => {
                self.job.update(|p| {
                    p.phase = ReencryptPhase::Finished;
                    p.hotzone = None;
                });
                match self.mode {
                    Mode::Reencrypt => {
                        tracing::info!(disk = %name, "reencryption finished: the old volume key is gone")
                    }
                    Mode::Encrypt => {
                        tracing::info!(disk = %name, "encryption finished: the disk is LUKS2")
                    }
                }
            }
            Ok(false) => {
                self.job.update(|p| {
                    p.phase = ReencryptPhase::Paused;
                    p.hotzone = None;
                });
                tracing::info!(disk = %name, done = self.job.bytes_done(), "reencryption paused");
            }
            Err(e) => {
                let message = chain(&e);
                tracing::error!(disk = %name, "reencryption stopped: {message}");
                self.job.update(|p| {
                    p.phase = ReencryptPhase::Paused;
                    p.hotzone = None;
                    p.last_error = Some(message);
                });
            }
        }
    }

    /// A new volume key: to the end (true) or a pause (false).
    fn rotate(&self, ready: &mut Option<Sender<Result<()>>>) -> Result<bool> {
        let io = self.file.header_io();
        let mut r = self.open(io)?;
        if !self.rewrite(io, &mut r, ready)? {
            return Ok(false);
        }
        if let Err(e) = self.segments.finish() {
            tracing::warn!(disk = %self.name, "the old volume key stays in memory until the requests still in flight complete: {e}");
        }
        Ok(true)
    }

    /// Starts the reencryption in the header unless one is there, unlocks both keys, and puts
    /// the new segment in the volume's map.
    fn open<'f>(&self, io: &'f dyn cryptblk_luks::HeaderIo) -> Result<Reencryption<'f>> {
        let image = self.file.name().display().to_string();
        let (header, _) =
            LuksImage::read(io).with_context(|| format!("reading the LUKS header of {image}"))?;
        let mut hdr = match header {
            LuksImage::V2(hdr) => hdr,
            LuksImage::V1(v1) => self.convert_luks1(io, &v1, &image)?,
        };
        if hdr
            .reencrypt_state()
            .context("reading the reencryption state")?
            .is_none()
        {
            if self.segments.is_split() {
                return Err(Error::conflict(format!(
                    "{image}: the header no longer shows the reencryption this disk serves; detach and attach it again"
                )));
            }
            let params = self.init_params(&hdr)?;
            hdr.reencrypt_init(io, &self.passphrase, &self.unlock, &params)
                .with_context(|| format!("starting the reencryption of {image}"))?;
            tracing::info!(disk = %self.name, "reencryption initialised in the header");
        }
        let mut r = self
            .unlock_reencryption(io, hdr)
            .with_context(|| format!("opening the reencryption of {image}"))?;
        self.record_session_keys(&r);
        let online = r
            .online_segments()
            .or_else(|_| {
                // A hotzone left by a failed step of this daemon (a restart recovers at attach).
                let _rewrite = self.segments.hotzone_write();
                r.recover()?;
                r.online_segments()
            })
            .with_context(|| image.clone())?;
        if self.segments.is_split() {
            if self.segments.committed() != online.done {
                return Err(Error::conflict(format!(
                    "{image}: the header's boundary ({}) is not the one this disk serves ({}); detach and attach it again",
                    online.done,
                    self.segments.committed()
                )));
            }
        } else {
            let cipher = cryptblk_volume::data_cipher(self.file.as_ref(), online.new.clone());
            self.segments
                .split(cipher, online.done)
                .context("serving the new segment")?;
        }
        let resilience = r.state().resilience.name().to_string();
        let cipher = Some(online.new_cipher_name.clone());
        self.job.update(|p: &mut Progress| {
            p.phase = ReencryptPhase::Running;
            p.mode = Some(Mode::Reencrypt);
            p.done = online.done;
            p.total = online.size;
            p.run_start = Some((online.done, Instant::now()));
            p.resilience = Some(resilience);
            p.cipher = cipher;
            p.max_bandwidth = self.max_bandwidth;
            p.last_error = None;
        });
        Ok(r)
    }

    /// A LUKS1 disk's header becomes LUKS2 first, as `cryptblk convert-header` does it: the
    /// same volume key, data offset and 512-byte sectors, so the requests being served see no
    /// change. The reencryption ticket this run holds already keeps keyslot changes, resizes
    /// and migrations away (the header-change exclusion). The passphrase is checked first, so
    /// a wrong one leaves the image LUKS1.
    fn convert_luks1(
        &self,
        io: &dyn cryptblk_luks::HeaderIo,
        v1: &Luks1Header,
        image: &str,
    ) -> Result<Luks2Header> {
        v1.unlock(io, &self.passphrase, &self.unlock)
            .with_context(|| format!("unlocking the LUKS1 header of {image}"))?;
        let (hdr, placement) = convert_luks1(io, v1).with_context(|| {
            format!("converting the LUKS1 header of {image} to LUKS2 (offline: `cryptblk convert-header --type luks2`)")
        })?;
        tracing::info!(disk = %self.name, ?placement, "converted the LUKS1 header to LUKS2 before re-encrypting");
        Ok(hdr)
    }

    fn init_params(&self, hdr: &Luks2Header) -> Result<InitParams> {
        let p = &self.params;
        let current = hdr.cipher_spec().context("reading the current cipher")?;
        let cipher =
            super::new_cipher::chosen_cipher(p.cipher.as_deref(), p.key_size, Some(&current))?;
        if let Some(s) = p.sector_size {
            if !(512..=4096).contains(&s) || !s.is_power_of_two() {
                return Err(Error::invalid_params(format!(
                    "sector-size {s}: use a power of two from 512 to 4096"
                )));
            }
        }
        let resilience = match p.resilience.unwrap_or(Resilience::Checksum) {
            Resilience::Checksum => ResilienceChoice::Checksum(HashAlg::Sha256),
            Resilience::Journal => ResilienceChoice::Journal,
            Resilience::None => ResilienceChoice::None,
        };
        Ok(InitParams {
            cipher: Some(cipher),
            sector_size: p.sector_size,
            resilience,
            pbkdf: crate::keys::pbkdf_options(p.pbkdf, p.iter_time, LuksVersion::V2)?,
            keyslot: None,
        })
    }

    /// Rewrites hotzones until the end (true) or a pause (false).
    fn rewrite(
        &self,
        io: &dyn cryptblk_luks::HeaderIo,
        r: &mut Reencryption<'_>,
        ready: &mut Option<Sender<Result<()>>>,
    ) -> Result<bool> {
        let align = r.alignment();
        let mut hotzone = MAX_HOTZONE.min(r.max_hotzone());
        if self.max_bandwidth > 0 {
            // A few hotzones a second, so the limit is smooth.
            hotzone = hotzone.min(self.max_bandwidth / 4);
        }
        let hotzone = (hotzone - hotzone % align).max(align);
        let total = r.device_size().context("reading the volume size")?;
        let started = Instant::now();
        let mut rewritten = 0u64;
        if let Some(tx) = ready.take() {
            let _ = tx.send(Ok(()));
        }
        loop {
            if self.job.pause.load(Ordering::Acquire) {
                r.checkpoint().context("committing the boundary")?;
                return Ok(false);
            }
            let done = r.done_bytes().context("reading the boundary")?;
            if done >= total {
                r.finish().context("finishing the reencryption")?;
                self.record_final_key(r);
                return Ok(true);
            }
            let len = hotzone.min(total - done);
            self.job
                .update(|p| p.hotzone = Some(Hotzone { offset: done, len }));
            // Bounded (DRAIN_TIMEOUT): a request the device never answers fails this step
            // instead of stalling the run; the disk keeps serving, a later start waits anew.
            self.segments.announce(done + len).map_err(|e| {
                Error::caused(
                    format!("fencing off the hotzone of {len} bytes at {done}"),
                    e,
                )
            })?;
            let rewrite = self.segments.hotzone_write();
            let step = r.step(len).and_then(|rep| {
                if r.state().resilience == LuksResilience::None {
                    // Online, the boundary is committed after every hotzone: a crash
                    // loses at most the hotzone being rewritten (as cryptsetup's `none`).
                    r.checkpoint()?;
                }
                Ok(rep)
            });
            let rep = match step {
                Ok(rep) => rep,
                Err(e) => {
                    let e =
                        Error::caused(format!("rewriting the hotzone of {len} bytes at {done}"), e);
                    // Part of the hotzone may hold new ciphertext: put it right (as a restart
                    // would) before any request may touch it again.
                    match self.recover(io) {
                        Ok(at) => {
                            if let Err(again) = self.segments.advance(&rewrite, at) {
                                tracing::warn!(disk = %self.name, "after the recovery: {again}");
                            }
                        }
                        Err(again) => {
                            tracing::error!(disk = %self.name, "the interrupted hotzone could not be recovered ({}): requests on the synchronous path stay blocked until the daemon restarts", chain(&again));
                            // Never serve a half-rewritten hotzone with the wrong key.
                            std::mem::forget(rewrite);
                        }
                    }
                    return Err(e);
                }
            };
            let advanced = self.segments.advance(&rewrite, rep.done);
            drop(rewrite);
            rewritten += rep.done - done;
            self.job.update(|p| {
                p.done = rep.done;
                p.hotzone = None;
            });
            advanced.map_err(|e| Error::caused("moving the boundary for the queues", e))?;
            self.throttle(started, rewritten);
        }
    }

    /// Recovers an interrupted hotzone from what the header says; returns the boundary.
    fn recover(&self, io: &dyn cryptblk_luks::HeaderIo) -> Result<u64> {
        let mut r = self.reopen(io)?;
        r.recover().context("recovering the hotzone")?;
        r.done_bytes().context("reading the boundary")
    }

    /// The reencryption the image's LUKS2 header has under way, unlocked anew with the run's
    /// passphrase (after a failed step, or once an encryption has written its header).
    pub(super) fn reopen<'f>(
        &self,
        io: &'f dyn cryptblk_luks::HeaderIo,
    ) -> Result<Reencryption<'f>> {
        let image = self.file.name().display().to_string();
        let (header, _) =
            LuksImage::read(io).with_context(|| format!("reading the LUKS header of {image}"))?;
        let LuksImage::V2(hdr) = header else {
            return Err(Error::conflict(format!(
                "{image}: the header is no longer LUKS2"
            )));
        };
        self.unlock_reencryption(io, hdr)
            .with_context(|| format!("opening the reencryption of {image}"))
    }

    /// Both keys of `hdr`'s reencryption, unlocked with the run's passphrase and checked
    /// against the reencryption digest.
    fn unlock_reencryption<'f>(
        &self,
        io: &'f dyn cryptblk_luks::HeaderIo,
        hdr: Luks2Header,
    ) -> cryptblk_luks::Result<Reencryption<'f>> {
        Reencryption::open(
            io,
            hdr,
            &self.passphrase,
            &self.unlock,
            None,
            self.pool.clone(),
        )
    }

    /// The disk's volume keys are now the session's (both while it runs), for a successor
    /// daemon and the key cache.
    pub(super) fn record_session_keys(&self, r: &Reencryption<'_>) {
        match r.known_keys() {
            Ok(keys) => self.record_keys(r, keys),
            Err(e) => {
                tracing::warn!(disk = %self.name, "the volume keys are not recorded for a restart: {e}")
            }
        }
    }

    /// After the finish: the new key alone, with the digest the header now names.
    pub(super) fn record_final_key(&self, r: &Reencryption<'_>) {
        let (Some(key), Ok(digest)) = (r.new_key(), r.header().volume_key_fingerprint()) else {
            tracing::warn!(disk = %self.name, "the new volume key is not recorded for a restart");
            return;
        };
        let key = cryptblk_luks::KnownKey {
            key: cryptblk_crypto::SecretKey::from_slice(key.as_bytes()),
            digest,
        };
        self.record_keys(r, vec![key]);
    }

    fn record_keys(&self, r: &Reencryption<'_>, keys: Vec<cryptblk_luks::KnownKey>) {
        let keys = cryptblk_volume::VolumeKeys {
            uuid: r.header().uuid().to_string(),
            keys,
        };
        crate::image::remember(self.key_cache.as_deref(), &keys);
        self.disk.image.set_volume_keys(keys);
    }

    /// Sleeps until `rewritten` bytes since `started` are within the bandwidth limit (or a
    /// pause is asked for).
    pub(super) fn throttle(&self, started: Instant, rewritten: u64) {
        if self.max_bandwidth == 0 {
            return;
        }
        let due = Duration::from_secs_f64(rewritten as f64 / self.max_bandwidth as f64);
        while started.elapsed() < due && !self.job.pause.load(Ordering::Acquire) {
            std::thread::sleep((due - started.elapsed()).min(PAUSE_POLL));
        }
    }
}
