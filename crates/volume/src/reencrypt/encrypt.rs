//! Encrypting a served raw volume in place: cryptsetup's `reencrypt --encrypt
//! --reduce-device-size R` (mode encrypt, backward, resilience datashift) on the image grown
//! by `R`, so that the guest's disk keeps its `N` bytes and the result is one ordinary LUKS2
//! image (QEMU, librbd, cryptsetup and a migration take it as they take any other; a detached
//! header would be a second file every one of them must be told about).
//!
//! - Start: the new keyslot's key derivation runs first, while the guest runs freely. Then
//!   the image grows by `R`, the first `S = R/2` bytes of the volume are fenced off (requests
//!   to them wait, once, for the copy and two syncs), copied to the image's end, and the
//!   header takes their place; from then on the segment map serves them from the copy.
//! - Hotzones run from the end of the volume down, as cryptsetup's do: each is read as
//!   plaintext, flagged in the header, encrypted `S` bytes higher and committed; the map then
//!   serves it as ciphertext. They are at most `MAX_HOTZONE` bytes (requests touching one
//!   wait for it), except the first `S` bytes of the volume, rewritten from the copy in one
//!   hotzone of `S` (cryptsetup resumes no smaller one there).
//! - Finish: the copy is overwritten with random bytes, the header keeps a fixed-size segment
//!   of `N` bytes (cryptsetup writes "dynamic", which would give the disk `S` more bytes at
//!   the next attach) and the image is cut to the header plus `N`.
//!
//! A crash leaves an image cryptsetup and cryptblk both resume: the header says what is
//! where after every commit, and the data path serves exactly that (`SegmentMap::follow`).
use super::error::{chain, step, Context, OnlineError};
use super::run::{Run, MAX_HOTZONE};
use super::{Hotzone, OnlineMode, Outcome, RunStart, Supervisor};
use crate::{data_cipher, LuksFacts, SegmentCiphers};
use cryptblk_crypto::CipherSpec;
use cryptblk_luks::luks2::reencrypt::{encrypt_prepare, KeyRole, Reencryption, SegmentExtent};
use cryptblk_luks::HeaderIo;
use std::sync::RwLockWriteGuard;
use std::time::Instant;

impl Run<'_> {
    /// Encrypts the volume to the end or a pause.
    pub(super) fn encrypt<S: Supervisor>(&self, supervisor: &S) -> Result<Outcome, S::Error> {
        let io = self.file().header_io();
        let image = &self.image;
        if self.volume.luks().is_none() {
            self.start_encryption(io, supervisor)?;
        }
        let mut r = self.reopen(io)?;
        r.keep_volume_size().context("keeping the disk's size")?;
        let ciphers = SegmentCiphers {
            old: r
                .cipher_of(KeyRole::Old)
                .map(|c| data_cipher(self.file().as_ref(), c)),
            new: r
                .cipher_of(KeyRole::New)
                .map(|c| data_cipher(self.file().as_ref(), c)),
            pool: self.options.pool.clone(),
        };
        let new = r
            .cipher_of(KeyRole::New)
            .ok_or_else(|| OnlineError::NoNewKey {
                image: image.clone(),
            })?;
        {
            let rewrite = self.segments().hotzone_write();
            if r.is_interrupted() {
                // A step of this run failed inside its hotzone (a restart recovers it when
                // the volume is opened): put it right before the map follows the header.
                r.recover()
                    .with_context(|| format!("recovering the interrupted hotzone of {image}"))?;
            }
            self.segments()
                .follow(
                    &rewrite,
                    &r.extents().context("reading the segments")?,
                    &ciphers,
                    true,
                )
                .context("serving the encryption's segments")?;
        }
        let spec = self.encryption_spec(&r)?;
        self.volume
            .set_luks(LuksFacts::new(&spec, new.engine_name()));
        self.record_session_keys(&r, supervisor);
        let total = r.device_size().context("reading the volume size")?;
        let done = r.done_bytes().context("reading the boundary")?;
        supervisor.started(RunStart {
            mode: OnlineMode::Encrypt,
            done,
            total,
            resilience: r.state().resilience.name().to_string(),
            cipher: format!(
                "{} ({} bits, {}-byte sectors)",
                spec.to_luks2_string(),
                spec.key_bytes() * 8,
                new.sector_size()
            ),
        });
        if self.encrypt_hotzones(io, &mut r, &ciphers, supervisor)? == Outcome::Paused {
            return Ok(Outcome::Paused);
        }
        self.finish_encryption(&mut r, &ciphers, supervisor)?;
        Ok(Outcome::Finished)
    }

    /// Writes the LUKS2 header over the first `S` bytes of the volume once they are copied to
    /// the end of the image, grown by `R` for them (the volume keeps its size).
    fn start_encryption<S: Supervisor>(
        &self,
        io: &dyn HeaderIo,
        supervisor: &S,
    ) -> Result<(), S::Error> {
        let image = &self.image;
        // A header already there (a start that failed after writing it) must never be taken
        // for plaintext and copied over the moved part.
        let mut magic = [0u8; 6];
        io.read_exact_at(&mut magic, 0)
            .with_context(|| format!("reading the start of {image}"))?;
        if magic == *b"LUKS\xba\xbe" {
            return Err(OnlineError::LuksAlready {
                image: image.clone(),
            }
            .into());
        }
        let size = self.segments().size();
        let params = supervisor.encryption_params()?;
        // The data moves up by half the reduction, which a migration's dirty blocks must
        // divide (they map volume offsets to file offsets whole).
        let granularity = self.volume.tracker.granularity();
        if !(params.reduce / 2).is_multiple_of(granularity) {
            return Err(OnlineError::ShiftGranularity {
                reduce: params.reduce,
                granularity,
            }
            .into());
        }
        let sector = u64::from(params.format.sector_size);
        if !size.is_multiple_of(sector) {
            return Err(OnlineError::PartialSector {
                name: self.name().to_string(),
                size,
                sector,
            }
            .into());
        }
        let grown = size
            .checked_add(params.reduce)
            .ok_or_else(|| OnlineError::TooLarge {
                image: image.clone(),
                size,
            })?;
        // The new keyslot's key derivation (seconds of argon2) before anything is fenced.
        let prepared = encrypt_prepare(grown, self.options.passphrase, &params)
            .with_context(|| format!("preparing the encryption of {image}"))?;
        let file = self.file();
        let old_len = file.size();
        file.set_len(grown).with_context(|| {
            format!(
                "growing {image} by {} bytes for the LUKS2 header",
                params.reduce
            )
        })?;
        let shrink_back = |why: &OnlineError| {
            if let Err(e) = file.set_len(old_len) {
                tracing::error!(disk = %self.name(), "{image} stays {} bytes longer after the failed start ({}): {}", params.reduce, chain(why), e);
            }
        };
        let shift = params.reduce / 2;
        if let Err(e) = self.segments().fence(0, shift) {
            let e = step(format!("fencing off the first {shift} bytes"), e);
            shrink_back(&e);
            return Err(e.into());
        }
        let rewrite = self.segments().hotzone_write();
        let hdr = match prepared.apply(io) {
            Ok(hdr) => hdr,
            Err(e) => {
                // The plaintext is where it was (`apply` puts it back when the header was
                // partly written), so the volume serves on as raw.
                let e = step(format!("writing the LUKS2 header of {image}"), e);
                if let Err(again) = self.segments().fence(0, 0) {
                    tracing::warn!(disk = %self.name(), "lifting the fence: {again}");
                }
                drop(rewrite);
                shrink_back(&e);
                return Err(e.into());
            }
        };
        // The image is LUKS2 from here on, whatever happens next.
        self.volume
            .set_luks(LuksFacts::new(&params.format.cipher, "none"));
        let extents = hdr
            .reencrypt_extents(grown)
            .context("reading the segments of the new header")?
            .ok_or_else(|| OnlineError::NoEncryption {
                image: image.clone(),
            })?;
        let plain = SegmentCiphers {
            old: None,
            new: None,
            pool: self.options.pool.clone(),
        };
        self.segments()
            .follow(&rewrite, &extents, &plain, true)
            .context("serving the moved part of the disk")?;
        drop(rewrite);
        tracing::info!(disk = %self.name(), header = shift, "encryption started: the disk's image is LUKS2 now, attach it with this passphrase");
        Ok(())
    }

    /// Encrypts hotzones until the end or a pause.
    fn encrypt_hotzones<S: Supervisor>(
        &self,
        io: &dyn HeaderIo,
        r: &mut Reencryption<'_>,
        ciphers: &SegmentCiphers,
        supervisor: &S,
    ) -> Result<Outcome, OnlineError> {
        let max_len = self.hotzone_len(MAX_HOTZONE, r.alignment());
        let started = Instant::now();
        let mut rewritten = 0u64;
        loop {
            if self.pause_requested() {
                r.checkpoint().context("committing the boundary")?;
                return Ok(Outcome::Paused);
            }
            let Some(hot) = r
                .next_hotzone(max_len)
                .context("finding the next hotzone")?
            else {
                return Ok(Outcome::Finished);
            };
            let (offset, len) = (hot.start, hot.end - hot.start);
            supervisor.hotzone(Hotzone { offset, len });
            self.segments().fence(offset, offset + len).map_err(|e| {
                step(
                    format!("fencing off the hotzone of {len} bytes at {offset}"),
                    e,
                )
            })?;
            let rewrite = self.segments().hotzone_write();
            let rep = match r.step(max_len) {
                Ok(rep) => rep,
                Err(e) => {
                    let e = step(
                        format!("encrypting the hotzone of {len} bytes at {offset}"),
                        e,
                    );
                    // The flagged hotzone's plaintext is intact: encrypt it again (as a
                    // restart would) before any request may touch it again.
                    if let Err(again) = self.recover_encryption(io, ciphers, &rewrite) {
                        tracing::error!(disk = %self.name(), "the interrupted hotzone could not be recovered ({}): requests on the synchronous path stay blocked until the daemon restarts", chain(&again));
                        // Never serve a hotzone the header and the map disagree on.
                        std::mem::forget(rewrite);
                    }
                    return Err(e);
                }
            };
            self.segments()
                .follow(
                    &rewrite,
                    &r.extents().context("reading the segments")?,
                    ciphers,
                    true,
                )
                .with_context(|| format!("serving {} after the hotzone at {offset}", self.image))?;
            drop(rewrite);
            rewritten += len;
            supervisor.advanced(rep.done);
            self.throttle(started, rewritten);
        }
    }

    /// Recovers a hotzone a failed step left flagged, from what the header says, and serves
    /// what it says then.
    fn recover_encryption(
        &self,
        io: &dyn HeaderIo,
        ciphers: &SegmentCiphers,
        rewrite: &RwLockWriteGuard<'_, ()>,
    ) -> Result<(), OnlineError> {
        let mut r = self.reopen(io)?;
        r.keep_volume_size().context("keeping the disk's size")?;
        r.recover().context("recovering the hotzone")?;
        self.segments()
            .follow(
                rewrite,
                &r.extents().context("reading the segments")?,
                ciphers,
                true,
            )
            .context("serving the recovered segments")?;
        Ok(())
    }

    /// Ends the encryption: the moved copy wiped, the header's single segment fixed at the
    /// volume's size, the image cut to header plus volume; the volume is an ordinary LUKS2
    /// one, whose migration copies its payload from behind the header.
    fn finish_encryption<S: Supervisor>(
        &self,
        r: &mut Reencryption<'_>,
        ciphers: &SegmentCiphers,
        supervisor: &S,
    ) -> Result<(), OnlineError> {
        let extents: Vec<SegmentExtent> = r.extents().context("reading the segments")?;
        let data_offset = extents
            .first()
            .map(|e| e.device_offset - e.logical_start)
            .unwrap_or_default();
        r.finish()
            .with_context(|| format!("finishing the encryption of {}", self.image))?;
        self.record_final_key(r, supervisor);
        {
            let rewrite = self.segments().hotzone_write();
            self.segments()
                .follow(&rewrite, &extents, ciphers, false)
                .context("serving the encrypted disk")?;
        }
        self.volume
            .tracker
            .set_payload_offset(data_offset)
            .map_err(|e| step("moving the migration's payload offset", e))?;
        Ok(())
    }

    /// The cipher the encryption writes, as its header names it.
    fn encryption_spec(&self, r: &Reencryption<'_>) -> Result<CipherSpec, OnlineError> {
        let key = r.new_key().ok_or_else(|| OnlineError::NoNewKey {
            image: self.image.clone(),
        })?;
        r.header()
            .final_cipher_spec(key.len())
            .context("reading the new cipher")
    }
}
