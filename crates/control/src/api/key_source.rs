//! Where a passphrase param comes from. Every method that takes a passphrase takes it in one
//! of three ways, under one naming pattern (`PREFIX` is `key`, or `new-key` for `key-add`'s
//! second one):
//! - `PREFIX-file`: a file the daemon reads;
//! - `PREFIX-fd`: the index of a descriptor passed with the request (SCM_RIGHTS);
//! - `PREFIX-secret` with `PREFIX-secret-iv`: the passphrase encrypted with the daemon's master
//!   key (`serve --master-key-file`), as QEMU's `secret` objects with `keyid` and `iv` take it:
//!   base64 of the AES-256-CBC ciphertext (PKCS#7 padding) and base64 of its 16-byte IV.
//!
//! Exactly one of them per passphrase: two is an invalid-params error.
use crate::RpcError;
use std::path::Path;

/// Where a passphrase comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource<'a> {
    /// A file the daemon reads.
    File(&'a Path),
    /// A descriptor passed with the request (its index among them).
    Fd(u32),
    /// Encrypted with the daemon's master key: base64 ciphertext and base64 IV.
    Secret { ciphertext: &'a str, iv: &'a str },
}

/// The params of one passphrase as a request gives them (any may be absent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyParams<'a> {
    pub file: Option<&'a Path>,
    pub fd: Option<u32>,
    pub secret: Option<&'a str>,
    pub secret_iv: Option<&'a str>,
}

/// The one source of the passphrase `given` by the params `PREFIX-file`, `PREFIX-fd` and
/// `PREFIX-secret` (with `PREFIX-secret-iv`): two of them is an invalid-params error, and so is
/// a secret without its IV or an IV without its secret; none is `None`, or an error when
/// `required`.
pub fn key_source<'a>(
    given: KeyParams<'a>,
    prefix: &str,
    required: bool,
) -> Result<Option<KeySource<'a>>, RpcError> {
    let secret = match (given.secret, given.secret_iv) {
        (Some(ciphertext), Some(iv)) => Some(KeySource::Secret { ciphertext, iv }),
        (Some(_), None) => {
            return Err(RpcError::invalid_params(format!(
                "{prefix}-secret needs {prefix}-secret-iv: the base64 16-byte IV the passphrase \
                 was encrypted with"
            )))
        }
        (None, Some(_)) => {
            return Err(RpcError::invalid_params(format!(
                "{prefix}-secret-iv is given without {prefix}-secret: give both, or neither"
            )))
        }
        (None, None) => None,
    };
    let sources = [
        given.file.map(|path| (KeySource::File(path), "file")),
        given.fd.map(|index| (KeySource::Fd(index), "fd")),
        secret.map(|s| (s, "secret")),
    ];
    let mut present = sources.into_iter().flatten();
    match (present.next(), present.next()) {
        (Some((_, a)), Some((_, b))) => Err(RpcError::invalid_params(format!(
            "{prefix}-{a} and {prefix}-{b} both give the passphrase: give one of them"
        ))),
        (Some((source, _)), None) => Ok(Some(source)),
        (None, _) if required => Err(RpcError::invalid_params(format!(
            "missing the passphrase: give {prefix}-file (a file the daemon reads), {prefix}-fd \
             (a descriptor passed with the request) or {prefix}-secret with {prefix}-secret-iv \
             (encrypted with the daemon's master key)"
        ))),
        (None, _) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(file: bool, fd: bool, secret: bool, iv: bool) -> KeyParams<'static> {
        KeyParams {
            file: file.then(|| Path::new("/k")),
            fd: fd.then_some(0),
            secret: secret.then_some("c2VjcmV0"),
            secret_iv: iv.then_some("aXY="),
        }
    }

    #[test]
    fn exactly_one_source_per_passphrase() {
        let one = key_source(params(false, false, true, true), "key", true).unwrap();
        assert_eq!(
            one,
            Some(KeySource::Secret {
                ciphertext: "c2VjcmV0",
                iv: "aXY="
            })
        );
        assert_eq!(
            key_source(params(false, true, false, false), "key", true).unwrap(),
            Some(KeySource::Fd(0))
        );
        assert_eq!(
            key_source(params(false, false, false, false), "key", false),
            Ok(None)
        );
        let both = key_source(params(true, false, true, true), "new-key", false).unwrap_err();
        assert_eq!(both.code, crate::INVALID_PARAMS);
        assert!(
            both.message
                .contains("new-key-file and new-key-secret both"),
            "{}",
            both.message
        );
        let both = key_source(params(true, true, false, false), "key", false).unwrap_err();
        assert!(
            both.message.contains("key-file and key-fd both"),
            "{}",
            both.message
        );
        let no_iv = key_source(params(false, false, true, false), "key", false).unwrap_err();
        assert!(
            no_iv.message.contains("key-secret needs key-secret-iv"),
            "{}",
            no_iv.message
        );
        let no_secret = key_source(params(false, false, false, true), "key", false).unwrap_err();
        assert!(
            no_secret
                .message
                .contains("key-secret-iv is given without key-secret"),
            "{}",
            no_secret.message
        );
        let none = key_source(params(false, false, false, false), "key", true).unwrap_err();
        assert!(
            none.message.contains("key-secret with key-secret-iv"),
            "{}",
            none.message
        );
    }
}
