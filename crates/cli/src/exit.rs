//! Exit statuses are part of the command-line contract (documented in `--help`): scripts tell
//! a wrong passphrase from a damaged image without parsing messages.
use cryptblk_block::{BlockError, BlockErrorKind};
use cryptblk_crypto::CryptoError;
use cryptblk_luks::LuksError;

pub const SUCCESS: i32 = 0;
pub const USAGE: i32 = 1;
pub const WRONG_PASSPHRASE: i32 = 2;
pub const UNSUPPORTED: i32 = 3;
pub const DAMAGED: i32 = 4;
pub const IO: i32 = 5;
pub const IN_USE: i32 = 6;
pub const RESOURCE_LIMIT: i32 = 7;
pub const OTHER: i32 = 8;

/// The table printed at the end of `--help`.
pub const HELP: &str = "\
Exit status:
  0  success
  1  usage error (bad arguments or options)
  2  wrong passphrase or key (no keyslot matches)
  3  unsupported cipher, mode, hash, image format or feature
  4  damaged, truncated or inconsistent image or header
  5  I/O error (the message names the path)
  6  image is in use (locked by another process)
  7  resource limit (argon2 memory above --max-pbkdf-memory, KDF cost above
     --max-pbkdf-iterations or --max-argon2-work)
  8  any other failure (e.g. verification mismatch, interrupted)";

/// A usage problem found after argument parsing (e.g. incompatible options).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The exit status for an error, from the most specific typed cause in its chain.
pub fn code_for(err: &anyhow::Error) -> i32 {
    for cause in err.chain() {
        if cause.downcast_ref::<UsageError>().is_some() {
            return USAGE;
        }
        if let Some(remote) = cause.downcast_ref::<crate::cmd::ctl::RemoteError>() {
            // The daemon's application codes are -32000 minus the CLI's exit status.
            return match remote.code {
                -32602..=-32600 => USAGE,
                c @ -32008..=-32001 => i32::try_from(-32000 - c).unwrap_or(OTHER),
                -32012 => IN_USE,
                _ => OTHER,
            };
        }
        if let Some(e) = cause.downcast_ref::<LuksError>() {
            return match e {
                LuksError::WrongPassphrase | LuksError::NoKeyslots => WRONG_PASSPHRASE,
                LuksError::Unsupported { .. }
                | LuksError::Crypto(CryptoError::Unsupported { .. }) => UNSUPPORTED,
                LuksError::NotLuks(_)
                | LuksError::Corrupt(_)
                | LuksError::Truncated(_)
                | LuksError::Keyslot(..) => DAMAGED,
                LuksError::PbkdfMemoryLimit { .. } | LuksError::PbkdfCostLimit { .. } => {
                    RESOURCE_LIMIT
                }
                LuksError::InvalidArgument(_) => USAGE,
                LuksError::Io(_) => IO,
                _ => OTHER,
            };
        }
        if let Some(e) = cause.downcast_ref::<BlockError>() {
            match e.kind() {
                BlockErrorKind::Unsupported => return UNSUPPORTED,
                BlockErrorKind::Corrupt => return DAMAGED,
                BlockErrorKind::Locked => return IN_USE,
                BlockErrorKind::Io => return IO,
                // The cause (e.g. a LuksError) may be more specific: keep walking.
                _ => continue,
            }
        }
        if let Some(CryptoError::Unsupported { .. } | CryptoError::InvalidKeySize { .. }) =
            cause.downcast_ref::<CryptoError>()
        {
            return UNSUPPORTED;
        }
        if cause.downcast_ref::<std::io::Error>().is_some() {
            return IO;
        }
    }
    OTHER
}

/// "context: cause: cause" on one line, skipping causes whose text the previous one already
/// contains (typed errors often render their source themselves).
pub fn one_line(err: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if text.is_empty() || out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}
