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
#[derive(Debug, Clone)]
pub struct UnlockOptions {
    /// Refuse argon2 keyslots that need more memory than this (KiB) instead of exhausting RAM.
    pub max_pbkdf_memory_kib: u64,
}

impl Default for UnlockOptions {
    fn default() -> Self {
        // cryptsetup's own ceiling for argon2 memory is 4 GiB.
        UnlockOptions {
            max_pbkdf_memory_kib: 4 * 1024 * 1024,
        }
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
