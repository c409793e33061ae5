//! The passphrase a request gives (`PREFIX-file`, `PREFIX-fd` or `PREFIX-secret`, see
//! `cryptblk_control::api::key_source`), read from where it is: a key file, a passed
//! descriptor, or a secret decrypted with the daemon's master key.
use crate::error::{Error, Result};
use crate::key_file::{read_key_fd, read_key_file, Passphrase};
use crate::secret::{decrypt_secret, MasterKey};
use cryptblk_control::api::KeySource;
use cryptblk_control::PassedFds;

/// Reads the passphrase of `source`, given by the params `PREFIX-*` (`prefix`: `key` or
/// `new-key`): a key file, a descriptor passed with the request (taken from `fds`, read and
/// closed), or a secret decrypted with the daemon's `master_key`.
pub fn read_key_source(
    source: KeySource<'_>,
    prefix: &str,
    fds: &mut PassedFds,
    master_key: Option<&MasterKey>,
) -> Result<Passphrase> {
    match source {
        KeySource::File(path) => read_key_file(path),
        KeySource::Fd(index) => {
            let param = format!("{prefix}-fd");
            let fd = fds
                .take(index, &param)
                .map_err(|e| Error::invalid_params(e.message))?;
            read_key_fd(fd, &format!("{param} {index}"))
        }
        KeySource::Secret { ciphertext, iv } => decrypt_secret(master_key, ciphertext, iv, prefix),
    }
}

/// What unlocking with the passphrase of `source` is called in an error: the param it came in.
pub fn unlocking_with(source: KeySource<'_>, prefix: &str) -> String {
    match source {
        KeySource::File(_) => format!("unlocking with {prefix}-file"),
        KeySource::Fd(_) => format!("unlocking with {prefix}-fd"),
        // CBC cannot tell a wrong IV: it garbles the passphrase's first block.
        KeySource::Secret { .. } => {
            format!("unlocking with {prefix}-secret (decrypted; is {prefix}-secret-iv right?)")
        }
    }
}
