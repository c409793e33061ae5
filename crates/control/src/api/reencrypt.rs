//! The online reencryption's params and answers: `reencrypt-start`, `reencrypt-status`,
//! `reencrypt-pause`.
use super::methods::Pbkdf;
use super::passphrase_params::params_with_passphrases;
use serde::{Deserialize, Serialize};

/// How a hotzone interrupted by a crash is put right (cryptsetup's `--resilience`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resilience {
    Checksum,
    Journal,
    None,
}

params_with_passphrases! {
    /// `reencrypt-start`: the passphrase from `key_file`, `key_fd` or `key_secret` (exactly one); the rest
    /// applies to a reencryption that is not under way yet (a paused one continues as begun).
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "kebab-case")]
    pub struct ReencryptStartParams {
        pub name: String,
        passphrase key_params(key_file, key_fd, key_secret, key_secret_iv);
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub resilience: Option<Resilience>,
        /// The new cipher as LUKS2 names it (default: the current one).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub cipher: Option<String>,
        /// Bits of the new key.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub key_size: Option<u32>,
        /// Bytes of the new encryption sector.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub sector_size: Option<u32>,
        /// Bytes per second the reencryption may read and write (0: no limit).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub max_bandwidth: Option<u64>,
        /// Key derivation of the new volume key's keyslot.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub pbkdf: Option<Pbkdf>,
        /// Milliseconds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub iter_time: Option<u32>,
        /// The disk is raw: encrypt it in place as LUKS2, keeping its size (the passphrase
        /// protects its first keyslot).
        #[serde(default)]
        pub encrypt: bool,
        /// With `encrypt`: bytes for the header and the data shift (cryptsetup's
        /// `--reduce-device-size`); the image grows by them while the encryption runs.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub reduce_device_size: Option<u64>,
    }
}

/// Where an online reencryption is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReencryptPhase {
    /// None has been started on this disk.
    Idle,
    Running,
    /// `reencrypt-pause` asked; stops once the current hotzone is committed.
    Pausing,
    /// Stopped part-way (paused, stopped by an error, or found so when the disk was
    /// attached); `reencrypt-start` continues.
    Paused,
    Finished,
}

/// The hotzone being rewritten: volume bytes `[offset, offset + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hotzone {
    pub offset: u64,
    pub len: u64,
}

/// `reencrypt-status` (and the answer of `reencrypt-start` and `reencrypt-pause`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ReencryptStatus {
    pub name: String,
    pub phase: ReencryptPhase,
    /// What the run does: `reencrypt` (a new volume key) or `encrypt` (a raw disk in
    /// place); absent before one starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Volume bytes in the new layout (for an encryption: encrypted, counted from the
    /// volume's end, which it works down from).
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Bytes per second over this run.
    pub rate: u64,
    /// Seconds left at that rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resilience: Option<String>,
    /// The new cipher and its key size in bits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cipher: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotzone: Option<Hotzone>,
    /// Bytes per second the run may use (0: no limit).
    pub max_bandwidth: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}
