//! Parameters callers pass in: how to unlock, how to format, how costly a new keyslot's KDF is.
use crate::kdf::Argon2Variant;
use crate::HashAlg;
use cryptblk_crypto::CipherSpec;

/// LUKS on-disk version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LuksVersion {
    V1,
    V2,
}

/// Limits applied while unlocking untrusted images.
///
/// A hostile header can name any KDF cost the format can store (e.g. 2^32-1 PBKDF2
/// iterations), turning one unlock attempt into hours of CPU time. Keyslots (and volume-key
/// digests) above these limits are refused before the KDF runs, with
/// [`LuksError::PbkdfCostLimit`](crate::LuksError::PbkdfCostLimit).
#[derive(Debug, Clone)]
pub struct UnlockOptions {
    /// Refuse argon2 keyslots that need more memory than this (KiB) instead of exhausting RAM.
    pub max_pbkdf_memory_kib: u64,
    /// Refuse PBKDF2 keyslots and volume-key digests with more iterations than this.
    pub max_pbkdf2_iterations: u32,
    /// Refuse argon2 keyslots whose time cost times memory cost (KiB) is above this: the
    /// memory argon2 fills over all its passes, which is what its run time follows. A cap on
    /// the time cost alone would not bound the run time (4 GiB x 10,000 passes takes hours)
    /// and would refuse legitimate small-memory keyslots, whose benchmark raises the time cost
    /// into the tens of thousands.
    pub max_argon2_work_kib: u64,
}

/// Default [`UnlockOptions::max_pbkdf2_iterations`]: 50 million. cryptsetup's benchmark for a
/// 2 s `--iter-time` gives about 5 million on this project's AMD EPYC Zen 4 (2.6 million
/// HMAC-SHA256 iterations per second per output block) and sets no cap of its own; 50 million
/// leaves ten times that headroom yet bounds one keyslot to about 20 s here for a
/// one-block derivation and 75 s for the worst LUKS1 case (SHA-1, 512-bit key: 4 blocks).
pub const DEFAULT_MAX_PBKDF2_ITERATIONS: u32 = 50_000_000;

/// Default [`UnlockOptions::max_argon2_work_kib`]: 128 GiB filled (e.g. 4 GiB x 32 passes or
/// 1 GiB x 128 passes). cryptsetup's default keyslot (1 GiB, 2 s) fills about 4 to 16 GiB on
/// current CPUs; at the 1 to 2 GiB/s argon2 fills on a few cores, the cap bounds one keyslot
/// to one or two minutes.
pub const DEFAULT_MAX_ARGON2_WORK_KIB: u64 = 128 * 1024 * 1024;

impl Default for UnlockOptions {
    fn default() -> Self {
        // cryptsetup's own ceiling for argon2 memory is 4 GiB.
        UnlockOptions {
            max_pbkdf_memory_kib: 4 * 1024 * 1024,
            max_pbkdf2_iterations: DEFAULT_MAX_PBKDF2_ITERATIONS,
            max_argon2_work_kib: DEFAULT_MAX_ARGON2_WORK_KIB,
        }
    }
}

impl UnlockOptions {
    /// Refuse a PBKDF2 cost above the limit; `place` names it ("keyslot 3", "volume-key digest").
    pub(crate) fn check_pbkdf2(&self, place: &str, iterations: u32) -> crate::Result<()> {
        if iterations > self.max_pbkdf2_iterations {
            return Err(crate::LuksError::PbkdfCostLimit {
                place: place.to_string(),
                what: "PBKDF2 iterations",
                value: iterations.into(),
                limit: self.max_pbkdf2_iterations.into(),
                option: "--max-pbkdf-iterations",
            });
        }
        Ok(())
    }

    /// Refuse an argon2 cost (time x memory) above the limit.
    pub(crate) fn check_argon2(
        &self,
        place: &str,
        time: u32,
        memory_kib: u32,
    ) -> crate::Result<()> {
        let work = u64::from(time) * u64::from(memory_kib);
        if work > self.max_argon2_work_kib {
            return Err(crate::LuksError::PbkdfCostLimit {
                place: place.to_string(),
                what: "argon2 work (time cost x memory KiB)",
                value: work,
                limit: self.max_argon2_work_kib,
                option: "--max-argon2-work",
            });
        }
        Ok(())
    }
}

/// Which KDF a new keyslot uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PbkdfKind {
    Pbkdf2,
    Argon2(Argon2Variant),
}

/// Cost settings for a new keyslot, resolved to a concrete `Kdf` by benchmarking (like
/// cryptsetup's `--iter-time`) unless `force_iterations` pins the cost.
#[derive(Debug, Clone)]
pub struct PbkdfOptions {
    pub kind: PbkdfKind,
    /// Hash for PBKDF2 (and for the AF splitter / digest).
    pub hash: HashAlg,
    /// Target unlock time in milliseconds (cryptsetup default 2000).
    pub iter_time_ms: u32,
    /// argon2 memory cost in KiB (cryptsetup default 1 GiB, capped at half the RAM).
    pub memory_kib: u32,
    /// argon2 lanes/threads (cryptsetup default min(4, cpus)).
    pub parallel: u32,
    /// PBKDF2 iterations or argon2 time cost, skipping the benchmark.
    pub force_iterations: Option<u32>,
}

impl Default for PbkdfOptions {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        PbkdfOptions {
            kind: PbkdfKind::Argon2(Argon2Variant::Argon2id),
            hash: HashAlg::Sha256,
            iter_time_ms: 2000,
            memory_kib: 1024 * 1024,
            parallel: cpus.clamp(1, 4),
            force_iterations: None,
        }
    }
}

impl PbkdfOptions {
    /// cryptsetup's argon2 memory cost for new keyslots: 1 GiB, but never more than half of
    /// the machine's RAM.
    pub fn default_argon2_memory_kib() -> u32 {
        let half_ram_kib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .map(|kib| kib / 2)
            .unwrap_or(u64::MAX);
        half_ram_kib.min(1024 * 1024) as u32
    }

    /// PBKDF2 with a pinned iteration count and no benchmark, like cryptsetup's
    /// `--pbkdf pbkdf2 --pbkdf-force-iterations N`: a fixed, machine-independent cost.
    pub fn pbkdf2_iterations(hash: HashAlg, iterations: u32) -> Self {
        PbkdfOptions {
            kind: PbkdfKind::Pbkdf2,
            hash,
            force_iterations: Some(iterations),
            ..PbkdfOptions::default()
        }
    }
}

/// Everything needed to create a new LUKS header.
#[derive(Debug, Clone)]
pub struct FormatOptions {
    pub version: LuksVersion,
    pub cipher: CipherSpec,
    /// Hash for the AF splitter and the volume-key digest (and PBKDF2 keyslots).
    pub hash: HashAlg,
    pub pbkdf: PbkdfOptions,
    /// Encryption sector size (LUKS2: 512 or 4096; LUKS1 is always 512).
    pub sector_size: u32,
    /// LUKS2 label.
    pub label: Option<String>,
    /// Fixed UUID (tests); a random one otherwise.
    pub uuid: Option<String>,
}

impl FormatOptions {
    /// A LUKS2 header for `cipher` with `sector_size`-byte sectors and cryptsetup's defaults
    /// otherwise: SHA-256, an argon2id keyslot, no label, a random UUID.
    pub fn luks2(cipher: CipherSpec, sector_size: u32) -> Self {
        FormatOptions {
            version: LuksVersion::V2,
            cipher,
            hash: HashAlg::Sha256,
            pbkdf: PbkdfOptions::default(),
            sector_size,
            label: None,
            uuid: None,
        }
    }

    /// The UUID to write: the one asked for (validated, normalised to lower-case hyphenated
    /// form), or a fresh random one.
    pub fn resolve_uuid(&self) -> crate::Result<String> {
        match &self.uuid {
            Some(u) => Ok(uuid::Uuid::parse_str(u)
                .map_err(|e| crate::LuksError::InvalidArgument(format!("UUID '{u}': {e}")))?
                .hyphenated()
                .to_string()),
            None => Ok(uuid::Uuid::new_v4().hyphenated().to_string()),
        }
    }
}
