//! Which key opens a LUKS disk, in order: the passphrase given (asked on a terminal, or the
//! disk's key file), then the header's clevis tokens in id order, each recovering its
//! keyslot's passphrase from its tang server (`cryptblk_clevis`). A key source that fails is
//! logged (never the key) and the next one tried; when none opens the disk, the error names
//! every source and why it failed, each token by its id and its server's URL.
use crate::error::{Context, Error, Result};
use crate::key_file::Passphrase;
use cryptblk_block::Container;
use cryptblk_clevis::{TokenError, DEFAULT_TANG_TIMEOUT};
use cryptblk_control::api::ErrorKind;
use cryptblk_luks::{LuksError, LuksImage};
use cryptblk_volume::{LuksVolume, VolumeError, VolumeOptions};
use std::sync::Arc;

/// Opens the LUKS volume on `container` with the first key source that works. `given` is
/// the passphrase the caller has (terminal or key file), if any.
pub(crate) fn open_luks(
    container: Arc<dyn Container>,
    given: Option<Passphrase>,
    opts: &VolumeOptions,
) -> Result<LuksVolume> {
    let image = container.name().display().to_string();
    let mut failures = Failures::default();
    let mut given_failed = None;
    if let Some(passphrase) = given {
        match try_open(&container, &passphrase, opts)? {
            Ok(volume) => return Ok(volume),
            Err(wrong) => {
                failures.push(
                    ErrorKind::WrongPassphrase,
                    format!("the passphrase given: {}", LuksError::WrongPassphrase),
                );
                given_failed = Some(wrong);
            }
        }
    }
    let (header, _) = LuksImage::read(container.header_io())
        .with_context(|| format!("reading the LUKS header of {image}"))?;
    let tokens = cryptblk_clevis::clevis_tokens(&header);
    if tokens.is_empty() {
        return Err(match given_failed {
            // Nothing else to try: the wrong passphrase's own error, as before tokens.
            Some(wrong) => Error::caused("opening the LUKS volume", wrong),
            None => Error::usage(format!(
                "{image} is LUKS and its header has no clevis token: give a key-file"
            )),
        });
    }
    for (id, token) in tokens {
        let token = match token {
            Ok(token) => token,
            Err(e) => {
                tracing::warn!(image = %image, token = %id, "clevis token not usable: {e}");
                failures.push(token_kind(&e), format!("clevis token {id}: {e}"));
                continue;
            }
        };
        let url = token.url().to_owned();
        let passphrase = match cryptblk_clevis::recover_passphrase(&token, DEFAULT_TANG_TIMEOUT) {
            Ok(passphrase) => passphrase,
            Err(e) => {
                tracing::warn!(image = %image, token = %id, url = %url, "clevis token: {e}");
                failures.push(token_kind(&e), format!("clevis token {id}: {e}"));
                continue;
            }
        };
        match try_open(&container, &passphrase, opts)? {
            Ok(volume) => {
                tracing::info!(image = %image, token = %id, url = %url, "unlocked through clevis token (tang)");
                return Ok(volume);
            }
            Err(_) => failures.push(
                ErrorKind::WrongPassphrase,
                format!(
                    "clevis token {id} (tang {url}): the recovered passphrase opens no keyslot (was the keyslot changed after `clevis luks bind`?)"
                ),
            ),
        }
    }
    Err(failures.into_error())
}

/// The volume, or the error saying no keyslot takes `passphrase`; other failures (I/O, a
/// damaged header, a limit) end the search.
fn try_open(
    container: &Arc<dyn Container>,
    passphrase: &[u8],
    opts: &VolumeOptions,
) -> Result<Result<LuksVolume, VolumeError>> {
    match cryptblk_volume::open_luks_volume_on(container.clone(), passphrase, opts) {
        Ok(volume) => Ok(Ok(volume)),
        Err(e) if e.is_wrong_passphrase() => Ok(Err(e)),
        Err(e) => Err(Error::caused("opening the LUKS volume", e)),
    }
}

/// What a token's failure means to a client: a server that cannot be reached is an I/O
/// error, a server key that no longer fits is a wrong key.
fn token_kind(e: &TokenError) -> ErrorKind {
    match e {
        TokenError::Unreachable { .. } | TokenError::Refused { .. } => ErrorKind::Io,
        TokenError::WrongServerKey { .. } | TokenError::ServerKeyGone { .. } => {
            ErrorKind::WrongPassphrase
        }
        TokenError::Malformed(_) => ErrorKind::Damaged,
        _ => ErrorKind::Unsupported,
    }
}

/// Why each key source failed, in the order tried.
#[derive(Default)]
struct Failures(Vec<(ErrorKind, String)>);

impl Failures {
    fn push(&mut self, kind: ErrorKind, why: String) {
        self.0.push((kind, why));
    }

    /// One error naming every failure; its kind is the first source's (the one the
    /// operator chose first).
    fn into_error(self) -> Error {
        let kind = self.0.first().map_or(ErrorKind::WrongPassphrase, |f| f.0);
        let reasons: Vec<String> = self.0.into_iter().map(|f| f.1).collect();
        Error::new(
            kind,
            format!("no key opened the LUKS volume: {}", reasons.join("; ")),
        )
    }
}
