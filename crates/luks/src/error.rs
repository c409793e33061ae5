use thiserror::Error;

/// Everything that can go wrong reading, unlocking or writing a LUKS header.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LuksError {
    #[error("not a LUKS image: {0}")]
    NotLuks(String),
    #[error("no keyslot matches this passphrase (check the key file; trailing newlines count)")]
    WrongPassphrase,
    #[error("the image has no active keyslot, so no passphrase can open it (only a header backup can restore access)")]
    NoKeyslots,
    #[error("unsupported {what} '{name}' ({hint})")]
    Unsupported {
        what: &'static str,
        name: String,
        hint: String,
    },
    #[error("damaged LUKS header: {0}")]
    Corrupt(String),
    #[error("truncated image: {0}")]
    Truncated(String),
    #[error("keyslot {slot}: argon2 needs {needed_kib} KiB of memory, above the limit of {limit_kib} KiB (raise it with --max-pbkdf-memory if this machine has the RAM)")]
    PbkdfMemoryLimit {
        slot: usize,
        needed_kib: u64,
        limit_kib: u64,
    },
    /// A KDF cost so high that unlocking would run for a very long time (a hostile or broken
    /// header); refused before the KDF runs.
    #[error("{place}: {what} {value} is above the limit of {limit}, so unlocking could take hours (raise it with {option} if you trust this image)")]
    PbkdfCostLimit {
        place: String,
        what: &'static str,
        value: u64,
        limit: u64,
        option: &'static str,
    },
    /// The volume keys at hand (a predecessor daemon's, the key cache's) are not the ones the
    /// header's digest describes now: the volume was re-encrypted or re-formatted since.
    #[error("the known volume key does not match the header's digest {0} (the volume's key changed since it was recorded); unlock it with its passphrase")]
    KnownKeyStale(&'static str),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("keyslot {0} is not usable: {1}")]
    Keyslot(usize, String),
    #[error(transparent)]
    Crypto(#[from] cryptblk_crypto::CryptoError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, LuksError>;
