//! Exit statuses are part of the command-line contract (documented in `--help`): scripts tell
//! a wrong passphrase from a damaged image without parsing messages. They come from the
//! failure's kind (the same kinds the daemon answers with on its control socket), never from
//! its text.
use cryptblk_backup::ErrorKind as BackupKind;
use cryptblk_control::api::ErrorKind;
use cryptblk_control::ClientError;

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

/// The exit status of a failure of this kind.
pub fn status(kind: ErrorKind) -> i32 {
    match kind {
        ErrorKind::InvalidParams | ErrorKind::Usage => USAGE,
        ErrorKind::WrongPassphrase => WRONG_PASSPHRASE,
        ErrorKind::Unsupported => UNSUPPORTED,
        ErrorKind::Damaged => DAMAGED,
        ErrorKind::Io => IO,
        // A busy disk (a VM connected, a migration under way) is "in use" to a script.
        ErrorKind::InUse | ErrorKind::Busy => IN_USE,
        ErrorKind::ResourceLimit => RESOURCE_LIMIT,
        _ => OTHER,
    }
}

/// The exit status for an error, from the most specific typed cause in its chain.
pub fn code_for(err: &anyhow::Error) -> i32 {
    for cause in err.chain() {
        if cause.is::<UsageError>() {
            return USAGE;
        }
        if let Some(ClientError::Rpc(e)) = cause.downcast_ref::<ClientError>() {
            return status(ErrorKind::from_code(e.code));
        }
        if let Some(e) = cause.downcast_ref::<cryptblk_backup::Error>() {
            return match e.kind() {
                BackupKind::Usage => USAGE,
                BackupKind::Damaged => DAMAGED,
                BackupKind::Unsupported => UNSUPPORTED,
                BackupKind::Io => IO,
                BackupKind::Other => OTHER,
            };
        }
        if let Some(kind) = cryptblk_daemon::error::own_kind(cause) {
            return status(kind);
        }
    }
    OTHER
}

/// "context: cause: cause" on one line, each cause said once.
pub fn one_line(err: &anyhow::Error) -> String {
    cryptblk_daemon::chain(err.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_the_documented_status() {
        let statuses: Vec<i32> = ErrorKind::ALL.iter().map(|k| status(*k)).collect();
        // invalid params, usage, passphrase, unsupported, damaged, io, in use, limit, other,
        // no such disk, conflict, busy
        assert_eq!(statuses, [1, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 6]);
        // The daemon's answers map through the same kinds.
        for kind in ErrorKind::ALL {
            let remote = cryptblk_control::RpcError {
                code: kind.code(),
                message: "m".into(),
                data: None,
            };
            let err = anyhow::Error::from(ClientError::Rpc(remote)).context("disk-add");
            assert_eq!(code_for(&err), status(kind), "{kind:?}");
        }
    }
}
