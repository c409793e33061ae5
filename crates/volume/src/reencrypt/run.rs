//! One online run's context and the steps a reencryption and an encryption share: opening
//! the header's reencryption with the run's passphrase, recording the volume keys as they
//! change, and keeping to the bandwidth limit.
use super::error::{Context, OnlineError};
use super::{OnlineOptions, Supervisor};
use crate::{SegmentMap, Volume, VolumeKeys};
use cryptblk_block::Container;
use cryptblk_luks::luks2::reencrypt::Reencryption;
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{HeaderIo, KnownKey, LuksImage};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest hotzone: what requests touching it may wait for while it is rewritten.
pub(super) const MAX_HOTZONE: u64 = 4 << 20;
/// Longest sleep between two looks at the pause flag.
const PAUSE_POLL: Duration = Duration::from_millis(50);

pub(super) struct Run<'a> {
    pub(super) volume: &'a Volume,
    pub(super) options: &'a OnlineOptions<'a>,
    /// The image's name, in messages.
    pub(super) image: String,
}

impl<'a> Run<'a> {
    pub(super) fn new(volume: &'a Volume, options: &'a OnlineOptions<'a>) -> Run<'a> {
        Run {
            volume,
            options,
            image: volume.container.name().display().to_string(),
        }
    }

    pub(super) fn name(&self) -> &str {
        self.options.name
    }

    pub(super) fn file(&self) -> &Arc<dyn Container> {
        &self.volume.container
    }

    pub(super) fn segments(&self) -> &Arc<SegmentMap> {
        self.volume.segments()
    }

    pub(super) fn pause_requested(&self) -> bool {
        self.options.pause.load(Ordering::Acquire)
    }

    /// The largest hotzone under `max` for the bandwidth limit: a few a second, so that the
    /// limit is smooth, and a whole number of `alignment`s.
    pub(super) fn hotzone_len(&self, max: u64, alignment: u64) -> u64 {
        let mut len = max;
        if self.options.max_bandwidth > 0 {
            len = len.min(self.options.max_bandwidth / 4);
        }
        (len - len % alignment).max(alignment)
    }

    /// The reencryption the image's LUKS2 header has under way, unlocked anew with the run's
    /// passphrase (after a failed step, or once an encryption has written its header).
    pub(super) fn reopen<'f>(&self, io: &'f dyn HeaderIo) -> Result<Reencryption<'f>, OnlineError> {
        let image = &self.image;
        let (header, _) =
            LuksImage::read(io).with_context(|| format!("reading the LUKS header of {image}"))?;
        let LuksImage::V2(hdr) = header else {
            return Err(OnlineError::NotLuks2 {
                image: image.clone(),
            });
        };
        self.unlock_reencryption(io, hdr)
            .with_context(|| format!("opening the reencryption of {image}"))
    }

    /// Both keys of `hdr`'s reencryption, unlocked with the run's passphrase and checked
    /// against the reencryption digest.
    pub(super) fn unlock_reencryption<'f>(
        &self,
        io: &'f dyn HeaderIo,
        hdr: Luks2Header,
    ) -> cryptblk_luks::Result<Reencryption<'f>> {
        Reencryption::open(
            io,
            hdr,
            self.options.passphrase,
            self.options.unlock,
            None,
            self.options.pool.clone(),
        )
    }

    /// The volume's keys are now the run's (both while it runs), for a successor daemon and
    /// the caller's key cache.
    pub(super) fn record_session_keys<S: Supervisor>(&self, r: &Reencryption<'_>, supervisor: &S) {
        match r.known_keys() {
            Ok(keys) => self.record_keys(r, keys, supervisor),
            Err(e) => {
                tracing::warn!(disk = %self.name(), "the volume keys are not recorded for a restart: {e}")
            }
        }
    }

    /// After the finish: the new key alone, with the digest the header now names.
    pub(super) fn record_final_key<S: Supervisor>(&self, r: &Reencryption<'_>, supervisor: &S) {
        let (Some(key), Ok(digest)) = (r.new_key(), r.header().volume_key_fingerprint()) else {
            tracing::warn!(disk = %self.name(), "the new volume key is not recorded for a restart");
            return;
        };
        let key = KnownKey {
            key: cryptblk_crypto::SecretKey::from_slice(key.as_bytes()),
            digest,
        };
        self.record_keys(r, vec![key], supervisor);
    }

    fn record_keys<S: Supervisor>(
        &self,
        r: &Reencryption<'_>,
        keys: Vec<KnownKey>,
        supervisor: &S,
    ) {
        let keys = VolumeKeys {
            uuid: r.header().uuid().to_string(),
            keys,
        };
        supervisor.keys_changed(&keys);
        self.volume.set_volume_keys(keys);
    }

    /// Sleeps until `rewritten` bytes since `started` are within the bandwidth limit (or a
    /// pause is asked for).
    pub(super) fn throttle(&self, started: Instant, rewritten: u64) {
        let max_bandwidth = self.options.max_bandwidth;
        if max_bandwidth == 0 {
            return;
        }
        let due = Duration::from_secs_f64(rewritten as f64 / max_bandwidth as f64);
        while started.elapsed() < due && !self.pause_requested() {
            std::thread::sleep((due - started.elapsed()).min(PAUSE_POLL));
        }
    }
}
