//! The reencryption thread: runs the volume's online reencryption or encryption
//! (`Volume::reencrypt_online`) and is its supervisor: the parameters of a new run from
//! `reencrypt-start`'s, the job's status as the run goes, the key cache, and whether the start
//! got going (the RPC's answer).
use super::{Mode, ReencryptJob};
use crate::disk::AttachedDisk;
use crate::error::{chain, Error, Result};
use crate::key_file::Passphrase;
use crossbeam_channel::Sender;
use cryptblk_control::api::{Hotzone, ReencryptPhase, ReencryptStartParams, Resilience};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::luks2::reencrypt::{EncryptParams, InitParams, ResilienceChoice};
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{HashAlg, LuksVersion, UnlockOptions};
use cryptblk_volume::{NewLayout, OnlineOptions, Outcome, RunStart, Supervisor, VolumeKeys};
use std::cell::Cell;
use std::sync::Arc;
use std::time::Instant;

pub(super) struct Run {
    pub name: String,
    pub mode: Mode,
    /// The disk whose volume the run rewrites.
    pub disk: Arc<AttachedDisk>,
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
        let options = OnlineOptions {
            name: &self.name,
            passphrase: &self.passphrase,
            unlock: &self.unlock,
            pool: self.pool.clone(),
            max_bandwidth: self.max_bandwidth,
            pause: &self.job.pause,
        };
        let supervisor = RunSupervisor {
            run: &self,
            ready: Cell::new(Some(ready)),
        };
        let outcome = self
            .disk
            .image
            .reencrypt_online(self.mode, &options, &supervisor);
        let name = &self.name;
        match outcome {
            Err(e) if supervisor.is_waiting() => supervisor.answer(Err(e)),
            Ok(Outcome::Finished) => {
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
            Ok(Outcome::Paused) => {
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

    /// The new layout `reencrypt-start` asks for.
    fn layout(&self) -> NewLayout<'_> {
        let p = &self.params;
        NewLayout {
            cipher: p.cipher.as_deref(),
            key_bits: p.key_size.map(|bits| bits as usize),
            sector_size: p.sector_size,
        }
    }
}

/// The daemon's side of a run: the job's status, the key cache, and the start's answer.
struct RunSupervisor<'a> {
    run: &'a Run,
    /// Until the run got going: where `reencrypt-start` waits for its answer.
    ready: Cell<Option<Sender<Result<()>>>>,
}

impl RunSupervisor<'_> {
    fn is_waiting(&self) -> bool {
        let ready = self.ready.take();
        let waiting = ready.is_some();
        self.ready.set(ready);
        waiting
    }

    fn answer(&self, answer: Result<()>) {
        if let Some(tx) = self.ready.take() {
            let _ = tx.send(answer);
        }
    }
}

impl Supervisor for RunSupervisor<'_> {
    type Error = Error;

    fn reencryption_params(&self, header: &Luks2Header) -> Result<InitParams> {
        let p = &self.run.params;
        let layout = self.run.layout().for_reencryption(header)?;
        let resilience = match p.resilience.unwrap_or(Resilience::Checksum) {
            Resilience::Checksum => ResilienceChoice::Checksum(HashAlg::Sha256),
            Resilience::Journal => ResilienceChoice::Journal,
            Resilience::None => ResilienceChoice::None,
        };
        let pbkdf = crate::keys::pbkdf_options(p.pbkdf, p.iter_time, LuksVersion::V2)?;
        Ok(layout.init_params(resilience, pbkdf, None))
    }

    fn encryption_params(&self) -> Result<EncryptParams> {
        let p = &self.run.params;
        if p.resilience.is_some() {
            return Err(Error::invalid_params(
                "an encryption in place is protected by its data shift (resilience datashift): leave out resilience",
            ));
        }
        let layout = self.run.layout().for_encryption()?;
        let pbkdf = crate::keys::pbkdf_options(p.pbkdf, p.iter_time, LuksVersion::V2)?;
        let reduce = p
            .reduce_device_size
            .unwrap_or(cryptblk_volume::DEFAULT_REDUCE);
        Ok(layout.encrypt_params(HashAlg::Sha256, pbkdf, reduce))
    }

    fn started(&self, run: RunStart) {
        let max_bandwidth = self.run.max_bandwidth;
        self.run.job.update(|p| {
            p.phase = ReencryptPhase::Running;
            p.mode = Some(run.mode);
            p.done = run.done;
            p.total = run.total;
            p.run_start = Some((run.done, Instant::now()));
            p.resilience = Some(run.resilience);
            p.cipher = Some(run.cipher);
            p.max_bandwidth = max_bandwidth;
            p.last_error = None;
        });
        self.answer(Ok(()));
    }

    fn hotzone(&self, zone: cryptblk_volume::Hotzone) {
        self.run.job.update(|p| {
            p.hotzone = Some(Hotzone {
                offset: zone.offset,
                len: zone.len,
            })
        });
    }

    fn advanced(&self, done: u64) {
        self.run.job.update(|p| {
            p.done = done;
            p.hotzone = None;
        });
    }

    fn keys_changed(&self, keys: &VolumeKeys) {
        crate::image::remember(self.run.key_cache.as_deref(), keys);
    }
}
