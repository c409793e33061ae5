//! What can go wrong recovering a passphrase from a clevis token. Every message names what to
//! check; none carries key material.
use thiserror::Error;

/// Why one token gave no passphrase.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The token or its JWE is not what `clevis luks bind` writes (untrusted header JSON).
    #[error("malformed clevis token: {0}")]
    Malformed(String),
    /// A well-formed token cryptblk cannot use (another pin, algorithm or curve).
    #[error("unsupported clevis token: {0}")]
    Unsupported(String),
    /// The tang URL is not one cryptblk can reach (only plain `http://` is spoken).
    #[error("tang URL {url}: {reason}")]
    BadUrl { url: String, reason: String },
    /// The tang server could not be reached or did not answer in time.
    #[error(
        "tang server {url} unreachable: {reason} (is tangd running and reachable from this host?)"
    )]
    Unreachable { url: String, reason: String },
    /// The tang server answered, but not with a recovery.
    #[error("tang server {url} refused the recovery: {reason}")]
    Refused { url: String, reason: String },
    /// The tang server does not hold the key the token was bound to (its keys were replaced).
    #[error("tang server {url} has no key \"{kid}\" (its keys were replaced since `clevis luks bind`; restore them or rebind the disk to the new keys)")]
    ServerKeyGone { url: String, kid: String },
    /// The recovered key does not decrypt the token: the server no longer holds the key the
    /// token was bound to (rotated or replaced keys), or the token was altered.
    #[error("tang server {url} answered, but its key does not decrypt the token (were the server's keys rotated or replaced? rebind with `clevis luks regen`)")]
    WrongServerKey { url: String },
}

impl TokenError {
    /// True when the server could not be reached at all (down, refused, timed out).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, TokenError::Unreachable { .. })
    }
}

pub type Result<T, E = TokenError> = std::result::Result<T, E>;
