use thiserror::Error;

/// Errors from cipher construction and sector transforms.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CryptoError {
    /// A cipher, mode, IV generator or hash that cryptblk does not implement.
    #[error("unsupported {what} '{name}': cryptblk supports aes with xts-plain, xts-plain64, cbc-plain, cbc-plain64 and cbc-essiv:<sha1|sha256|sha512>")]
    Unsupported { what: &'static str, name: String },
    /// Key length that does not fit the cipher and mode.
    #[error("invalid key size {bits} bits for {spec} (expected {expected})")]
    InvalidKeySize {
        bits: usize,
        spec: String,
        expected: &'static str,
    },
    /// Buffer not a whole number of sectors, or a bad sector size.
    #[error("invalid sector run: {0}")]
    InvalidLength(String),
    /// The crypto library itself reported a failure.
    #[error("crypto engine {engine} failed: {message}")]
    Engine {
        engine: &'static str,
        message: String,
    },
    /// The OS random number generator could not produce bytes (keys, salts, AF stripes).
    #[error("the random number generator failed: {0}")]
    Rng(String),
    /// A pool worker died while processing this request.
    #[error("crypto worker failed: {0}")]
    Worker(String),
}
