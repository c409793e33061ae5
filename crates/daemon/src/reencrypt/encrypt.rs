//! Encrypting a served raw disk in place: cryptsetup's `reencrypt --encrypt
//! --reduce-device-size R` (mode encrypt, backward, resilience datashift) on the image grown
//! by `R`, so that the guest's disk keeps its `N` bytes and the result is one ordinary LUKS2
//! image (QEMU, librbd, cryptsetup and a migration take it as they take any other; a detached
//! header would be a second file every one of them must be told about).
//!
//! - Start: the new keyslot's key derivation runs first, while the guest runs freely. Then
//!   the image grows by `R`, the first `S = R/2` bytes of the disk are fenced off (requests
//!   to them wait, once, for the copy and two syncs), copied to the image's end, and the
//!   header takes their place; from then on the segment map serves them from the copy.
//! - Hotzones run from the end of the disk down, as cryptsetup's do: each is read as
//!   plaintext, flagged in the header, encrypted `S` bytes higher and committed; the map then
//!   serves it as ciphertext. They are at most `MAX_HOTZONE` bytes (requests touching one
//!   wait for it), except the first `S` bytes of the disk, rewritten from the copy in one
//!   hotzone of `S` (cryptsetup resumes no smaller one there).
//! - Finish: the copy is overwritten with random bytes, the header keeps a fixed-size segment
//!   of `N` bytes (cryptsetup writes "dynamic", which would give the disk `S` more bytes at
//!   the next attach) and the image is cut to the header plus `N`.
//!
//! A crash leaves an image cryptsetup and cryptblk both resume: the header says what is
//! where after every commit, and the data path serves exactly that (`SegmentMap::follow`).
use super::driver::{Run, MAX_HOTZONE};
use super::new_cipher::chosen_cipher;
use super::Mode;
use crate::error::{chain, Context, Error, Result};
use crossbeam_channel::Sender;
use cryptblk_control::api::{Hotzone, ReencryptPhase};
use cryptblk_crypto::CipherSpec;
use cryptblk_luks::luks2::reencrypt::{
    encrypt_prepare, EncryptParams, KeyRole, Reencryption, SegmentExtent,
};
use cryptblk_luks::{FormatOptions, HashAlg, HeaderIo, LuksVersion};
use cryptblk_volume::LuksFacts;
use cryptblk_volume::{data_cipher, SegmentCiphers};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// cryptsetup's recommended `--reduce-device-size`: a 16 MiB header area, luksFormat's
/// default data offset, with room for every keyslot.
pub const DEFAULT_REDUCE: u64 = 32 << 20;
/// cryptsetup's encryption sector for `--encrypt` unless told otherwise, and what a raw
/// disk's guest was told its logical block is.
const DEFAULT_SECTOR: u32 = 512;

impl Run {
    /// Encrypts the disk to the end (true) or a pause (false).
    pub(super) fn encrypt(&self, ready: &mut Option<Sender<Result<()>>>) -> Result<bool> {
        let io = self.file.header_io();
        let image = self.file.name().display().to_string();
        if self.disk.image.luks().is_none() {
            self.start_encryption(io, &image)?;
        }
        let mut r = self.reopen(io)?;
        r.keep_volume_size().context("keeping the disk's size")?;
        let ciphers = SegmentCiphers {
            old: r
                .cipher_of(KeyRole::Old)
                .map(|c| data_cipher(self.file.as_ref(), c)),
            new: r
                .cipher_of(KeyRole::New)
                .map(|c| data_cipher(self.file.as_ref(), c)),
            pool: self.pool.clone(),
        };
        let new = r
            .cipher_of(KeyRole::New)
            .ok_or_else(|| Error::conflict(format!("{image}: the encryption has no new key")))?;
        {
            let rewrite = self.segments.hotzone_write();
            if r.is_interrupted() {
                // A step of this daemon failed inside its hotzone (a restart recovers it when
                // the disk is attached): put it right before the map follows the header.
                r.recover()
                    .with_context(|| format!("recovering the interrupted hotzone of {image}"))?;
            }
            self.segments
                .follow(
                    &rewrite,
                    &r.extents().context("reading the segments")?,
                    &ciphers,
                    true,
                )
                .context("serving the encryption's segments")?;
        }
        let spec = encryption_spec(&r)?;
        self.disk
            .image
            .set_luks(LuksFacts::new(&spec, new.engine_name()));
        self.record_session_keys(&r);
        let total = r.device_size().context("reading the volume size")?;
        let done = r.done_bytes().context("reading the boundary")?;
        let cipher_name = format!(
            "{} ({} bits, {}-byte sectors)",
            spec.to_luks2_string(),
            spec.key_bytes() * 8,
            new.sector_size()
        );
        self.job.update(|p| {
            p.phase = ReencryptPhase::Running;
            p.mode = Some(Mode::Encrypt);
            p.done = done;
            p.total = total;
            p.run_start = Some((done, Instant::now()));
            p.resilience = Some(r.state().resilience.name().to_string());
            p.cipher = Some(cipher_name);
            p.max_bandwidth = self.max_bandwidth;
            p.last_error = None;
        });
        if let Some(tx) = ready.take() {
            let _ = tx.send(Ok(()));
        }
        if !self.encrypt_hotzones(io, &mut r, &ciphers, &image)? {
            return Ok(false);
        }
        self.finish_encryption(&mut r, &ciphers, &image)?;
        Ok(true)
    }

    /// Writes the LUKS2 header over the first `S` bytes of the disk once they are copied to
    /// the end of the image, grown by `R` for them (the disk keeps its size).
    fn start_encryption(&self, io: &dyn HeaderIo, image: &str) -> Result<()> {
        // A header already there (a start that failed after writing it) must never be taken
        // for plaintext and copied over the moved part.
        let mut magic = [0u8; 6];
        io.read_exact_at(&mut magic, 0)
            .with_context(|| format!("reading the start of {image}"))?;
        if magic == *b"LUKS\xba\xbe" {
            return Err(Error::conflict(format!(
                "{image} has a LUKS header already: detach the disk and attach it with its passphrase, then continue with reencrypt-start"
            )));
        }
        let size = self.segments.size();
        let params = self.encrypt_params()?;
        // The data moves up by half the reduction, which a migration's dirty blocks must
        // divide (they map volume offsets to file offsets whole).
        let granularity = self.disk.image.tracker.granularity();
        if !(params.reduce / 2).is_multiple_of(granularity) {
            return Err(Error::usage(format!(
                "reduce-device-size {}: use a multiple of {} bytes (the data moves up by half of it, in whole {granularity}-byte blocks); cryptsetup recommends 32M",
                params.reduce,
                2 * granularity
            )));
        }
        let sector = u64::from(params.format.sector_size);
        if !size.is_multiple_of(sector) {
            return Err(Error::usage(format!(
                "disk \"{}\" has {size} bytes, not a whole number of {sector}-byte encryption sectors: give a sector-size that divides it",
                self.name
            )));
        }
        let grown = size.checked_add(params.reduce).ok_or_else(|| {
            Error::usage(format!("{image}: {size} bytes are too many to encrypt"))
        })?;
        // The new keyslot's key derivation (seconds of argon2) before anything is fenced.
        let prepared = encrypt_prepare(grown, &self.passphrase, &params)
            .with_context(|| format!("preparing the encryption of {image}"))?;
        let old_len = self.file.size();
        self.file.set_len(grown).with_context(|| {
            format!(
                "growing {image} by {} bytes for the LUKS2 header",
                params.reduce
            )
        })?;
        let shrink_back = |why: &Error| {
            if let Err(e) = self.file.set_len(old_len) {
                tracing::error!(disk = %self.name, "{image} stays {} bytes longer after the failed start ({}): {}", params.reduce, chain(why), e);
            }
        };
        let shift = params.reduce / 2;
        if let Err(e) = self.segments.fence(0, shift) {
            let e = Error::caused(format!("fencing off the first {shift} bytes"), e);
            shrink_back(&e);
            return Err(e);
        }
        let rewrite = self.segments.hotzone_write();
        let hdr = match prepared.apply(io) {
            Ok(hdr) => hdr,
            Err(e) => {
                // The plaintext is where it was (`apply` puts it back when the header was
                // partly written), so the disk serves on as raw.
                let e = Error::caused(format!("writing the LUKS2 header of {image}"), e);
                if let Err(again) = self.segments.fence(0, 0) {
                    tracing::warn!(disk = %self.name, "lifting the fence: {again}");
                }
                drop(rewrite);
                shrink_back(&e);
                return Err(e);
            }
        };
        // The image is LUKS2 from here on, whatever happens next.
        self.disk
            .image
            .set_luks(LuksFacts::new(&params.format.cipher, "none"));
        let extents = hdr
            .reencrypt_extents(grown)
            .context("reading the segments of the new header")?
            .ok_or_else(|| {
                Error::conflict(format!("{image}: the new header shows no encryption"))
            })?;
        let plain = SegmentCiphers {
            old: None,
            new: None,
            pool: self.pool.clone(),
        };
        self.segments
            .follow(&rewrite, &extents, &plain, true)
            .context("serving the moved part of the disk")?;
        drop(rewrite);
        tracing::info!(disk = %self.name, header = shift, "encryption started: the disk's image is LUKS2 now, attach it with this passphrase");
        Ok(())
    }

    /// Encrypts hotzones until the end (true) or a pause (false).
    fn encrypt_hotzones(
        &self,
        io: &dyn HeaderIo,
        r: &mut Reencryption<'_>,
        ciphers: &SegmentCiphers,
        image: &str,
    ) -> Result<bool> {
        let mut max_len = MAX_HOTZONE;
        if self.max_bandwidth > 0 {
            // A few hotzones a second, so the limit is smooth.
            max_len = max_len.min(self.max_bandwidth / 4);
        }
        let max_len = (max_len - max_len % r.alignment()).max(r.alignment());
        let started = Instant::now();
        let mut rewritten = 0u64;
        loop {
            if self.job.pause.load(Ordering::Acquire) {
                r.checkpoint().context("committing the boundary")?;
                return Ok(false);
            }
            let Some(hot) = r
                .next_hotzone(max_len)
                .context("finding the next hotzone")?
            else {
                return Ok(true);
            };
            let (offset, len) = (hot.start, hot.end - hot.start);
            self.job
                .update(|p| p.hotzone = Some(Hotzone { offset, len }));
            self.segments.fence(offset, offset + len).map_err(|e| {
                Error::caused(
                    format!("fencing off the hotzone of {len} bytes at {offset}"),
                    e,
                )
            })?;
            let rewrite = self.segments.hotzone_write();
            let rep = match r.step(max_len) {
                Ok(rep) => rep,
                Err(e) => {
                    let e = Error::caused(
                        format!("encrypting the hotzone of {len} bytes at {offset}"),
                        e,
                    );
                    // The flagged hotzone's plaintext is intact: encrypt it again (as a
                    // restart would) before any request may touch it again.
                    match self.recover_encryption(io, ciphers, &rewrite) {
                        Ok(()) => {}
                        Err(again) => {
                            tracing::error!(disk = %self.name, "the interrupted hotzone could not be recovered ({}): requests on the synchronous path stay blocked until the daemon restarts", chain(&again));
                            // Never serve a hotzone the header and the map disagree on.
                            std::mem::forget(rewrite);
                        }
                    }
                    return Err(e);
                }
            };
            self.segments
                .follow(
                    &rewrite,
                    &r.extents().context("reading the segments")?,
                    ciphers,
                    true,
                )
                .with_context(|| format!("serving {image} after the hotzone at {offset}"))?;
            drop(rewrite);
            rewritten += len;
            self.job.update(|p| {
                p.done = rep.done;
                p.hotzone = None;
            });
            self.throttle(started, rewritten);
        }
    }

    /// Recovers a hotzone a failed step left flagged, from what the header says, and serves
    /// what it says then.
    fn recover_encryption(
        &self,
        io: &dyn HeaderIo,
        ciphers: &SegmentCiphers,
        rewrite: &std::sync::RwLockWriteGuard<'_, ()>,
    ) -> Result<()> {
        let mut r = self.reopen(io)?;
        r.keep_volume_size().context("keeping the disk's size")?;
        r.recover().context("recovering the hotzone")?;
        self.segments
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
    /// disk's size, the image cut to header plus disk; the disk is an ordinary LUKS2 one,
    /// whose migration copies its payload from behind the header.
    fn finish_encryption(
        &self,
        r: &mut Reencryption<'_>,
        ciphers: &SegmentCiphers,
        image: &str,
    ) -> Result<()> {
        let extents: Vec<SegmentExtent> = r.extents().context("reading the segments")?;
        let data_offset = extents
            .first()
            .map(|e| e.device_offset - e.logical_start)
            .unwrap_or_default();
        r.finish()
            .with_context(|| format!("finishing the encryption of {image}"))?;
        self.record_final_key(r);
        {
            let rewrite = self.segments.hotzone_write();
            self.segments
                .follow(&rewrite, &extents, ciphers, false)
                .context("serving the encrypted disk")?;
        }
        self.disk
            .image
            .tracker
            .set_payload_offset(data_offset)
            .map_err(|e| Error::caused("moving the migration's payload offset", e))?;
        Ok(())
    }

    /// The new header's format and the data shift, from `reencrypt-start`'s params.
    fn encrypt_params(&self) -> Result<EncryptParams> {
        let p = &self.params;
        if p.resilience.is_some() {
            return Err(Error::invalid_params(
                "an encryption in place is protected by its data shift (resilience datashift): leave out resilience",
            ));
        }
        let cipher = chosen_cipher(p.cipher.as_deref(), p.key_size, None)?;
        let sector = p.sector_size.unwrap_or(DEFAULT_SECTOR);
        if !(512..=4096).contains(&sector) || !sector.is_power_of_two() {
            return Err(Error::invalid_params(format!(
                "sector-size {sector}: use a power of two from 512 to 4096"
            )));
        }
        let mut format = FormatOptions::luks2(cipher, sector);
        format.hash = HashAlg::Sha256;
        format.pbkdf = crate::keys::pbkdf_options(p.pbkdf, p.iter_time, LuksVersion::V2)?;
        Ok(EncryptParams {
            format,
            reduce: p.reduce_device_size.unwrap_or(DEFAULT_REDUCE),
        })
    }
}

/// The cipher the encryption writes, as its header names it.
fn encryption_spec(r: &Reencryption<'_>) -> Result<CipherSpec> {
    let key = r
        .new_key()
        .ok_or_else(|| Error::conflict("the encryption has no new key"))?;
    r.header()
        .final_cipher_spec(key.len())
        .context("reading the new cipher")
}
