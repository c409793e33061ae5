//! `reencrypt-start`, `reencrypt-status`, `reencrypt-pause`: replacing a served LUKS2 disk's
//! volume key while it serves (cryptsetup's LUKS2 reencryption, forward, in place), or
//! encrypting a served raw disk in place (`encrypt`: cryptsetup's `reencrypt --encrypt`,
//! backward, with a data shift, on the image grown by the header area so that the disk keeps
//! its size). The work is the volume's (`Volume::reencrypt_online`), on a thread of its own
//! (`driver`); the data path follows it through the volume's segment map.
//!
//! One reencryption at a time per disk, and never alongside a migration or a keyslot change:
//! each refuses the other as busy (`activity`). A disk attached in mid-reencryption (a daemon
//! restarted, or cryptsetup stopped part-way) serves its segments at once and continues on
//! `reencrypt-start`.
mod driver;

pub(crate) use crate::reencrypt_job::{Mode, ReencryptJob};

use crate::disk::AttachedDisk;
use crate::error::{Context, Error, Result};
use crate::key_source::read_key_source;
use crate::registry::Daemon;
use cryptblk_control::api::{ReencryptPhase, ReencryptStartParams, ReencryptStatus};
use cryptblk_control::PassedFds;
use std::sync::atomic::Ordering;
use std::sync::PoisonError;

/// Bytes per second a reencryption rewrites unless told otherwise: a fraction of what a
/// disk or an SSD does, so the guest keeps most of the device.
pub const DEFAULT_MAX_BANDWIDTH: u64 = 64 << 20;

impl Daemon {
    /// Starts (or continues) the reencryption of an attached LUKS2 disk, or the encryption
    /// of a raw one. Returns once the keys are unlocked and the rewriting has begun; a wrong
    /// passphrase or an image this cannot handle is an error here, with the image untouched.
    pub fn reencrypt_start(
        &self,
        p: &ReencryptStartParams,
        fds: &mut PassedFds,
    ) -> Result<ReencryptStatus> {
        let name = p.name.as_str();
        let source = crate::keys::required_source(p.key_params(), "key")?;
        let disk = self.attached(name)?;
        let mode = run_mode(&disk, p)?;
        if disk.read_only() {
            return Err(Error::usage(format!(
                "disk \"{name}\" is read-only: re-encrypting writes every sector"
            )));
        }
        if self.incoming_in_progress(name) {
            return Err(Error::busy(format!(
                "disk \"{name}\" is being migrated in: re-encrypt it once the migration has completed"
            )));
        }
        let ticket = disk.activity.begin_reencryption(name)?;
        let passphrase = read_key_source(source, "key", fds, self.master_key.as_ref())?;
        // The rewriting bypasses the write-intent log and changes every ciphertext byte:
        // each checkpoint counts the whole image changed.
        disk.image.tracker.intent_log().record_all().map_err(|e| {
            Error::caused("recording the reencryption in the disk's checkpoints", e)
        })?;
        let job = disk.reencryption.clone();
        job.pause.store(false, Ordering::Release);
        let max_bandwidth = p.max_bandwidth.unwrap_or(DEFAULT_MAX_BANDWIDTH);
        let run = driver::Run {
            name: name.to_string(),
            mode,
            disk: disk.clone(),
            passphrase,
            params: p.clone(),
            max_bandwidth,
            pool: self.pool.clone(),
            unlock: self.unlock.clone(),
            job: job.clone(),
            key_cache: self.key_cache.clone(),
        };
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
        let thread = std::thread::Builder::new()
            .name(format!("reencrypt-{name}"))
            .spawn(move || {
                // The ticket ends with the run: migrations and keyslot changes are refused
                // until then.
                let _ticket = ticket;
                run.run(ready_tx);
            })
            .map_err(|e| Error::caused("starting the reencryption thread", e))?;
        let previous = job
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(thread);
        if let Some(previous) = previous {
            // A run that has ended (its ticket is gone, or this start would have been busy).
            let _ = previous.join();
        }
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(job.status(name)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::new(
                cryptblk_control::api::ErrorKind::Other,
                "the reencryption thread ended before it started",
            )),
        }
    }

    pub fn reencrypt_status(&self, name: &str) -> Result<ReencryptStatus> {
        Ok(self.attached(name)?.reencryption.status(name))
    }

    /// Asks the reencryption to stop once the hotzone it is rewriting is committed.
    pub fn reencrypt_pause(&self, name: &str) -> Result<ReencryptStatus> {
        let disk = self.attached(name)?;
        let job = &disk.reencryption;
        job.pause.store(true, Ordering::Release);
        job.update(|p| {
            if p.phase == ReencryptPhase::Running {
                p.phase = ReencryptPhase::Pausing;
            }
        });
        Ok(job.status(name))
    }
}

/// Whether `reencrypt-start` replaces a LUKS2 disk's key or encrypts a raw disk (or continues
/// the one its header has under way), refusing the ones that ask for the other.
fn run_mode(disk: &AttachedDisk, p: &ReencryptStartParams) -> Result<Mode> {
    let name = disk.name();
    if disk.image.luks().is_none() {
        if !p.encrypt {
            return Err(Error::conflict(format!(
                "disk \"{name}\" is raw, not LUKS: there is no volume key to replace; to encrypt it in place, add encrypt (ctl reencrypt-start --encrypt)"
            )));
        }
        return Ok(Mode::Encrypt);
    }
    let (header, _) = cryptblk_luks::LuksImage::read(disk.image.container.header_io())
        .with_context(|| format!("reading the LUKS header of disk \"{name}\""))?;
    let encrypting = match &header {
        cryptblk_luks::LuksImage::V2(h) => h
            .reencrypt_state()
            .context("reading the reencryption state")?
            .is_some_and(|s| s.mode == cryptblk_luks::luks2::reencrypt::ReencryptMode::Encrypt),
        cryptblk_luks::LuksImage::V1(_) => false,
    };
    if encrypting {
        return Ok(Mode::Encrypt);
    }
    if p.encrypt {
        return Err(Error::conflict(format!(
            "disk \"{name}\" is LUKS already: leave out encrypt to give it a new volume key"
        )));
    }
    Ok(Mode::Reencrypt)
}
