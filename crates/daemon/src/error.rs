//! The daemon's error: a kind (what a client can act on, the protocol's error code), the
//! context (which disk, which step) and the cause. `Display` is the context only; the causes
//! are printed once, by [`chain`], where the error leaves the program (the RPC answer, the
//! command line, a log line).
use cryptblk_block::{BlockError, BlockErrorKind};
use cryptblk_control::api::ErrorKind;
use cryptblk_crypto::CryptoError;
use cryptblk_luks::LuksError;
use cryptblk_volume::{OnlineError, OnlineErrorKind, PrepareError, VolumeError};
use std::error::Error as StdError;
use std::fmt;

type Source = Box<dyn StdError + Send + Sync + 'static>;

#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    context: String,
    source: Option<Source>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A failure of the daemon's own, without an underlying cause.
    pub fn new(kind: ErrorKind, context: impl Into<String>) -> Error {
        Error {
            kind,
            context: context.into(),
            source: None,
        }
    }

    /// `cause` while doing `context`; the kind is the most specific one the cause's chain
    /// names (see [`kind_of`]). A daemon `Error` as the cause keeps its kind.
    pub fn caused(context: impl Into<String>, cause: impl Into<Source>) -> Error {
        let source = cause.into();
        Error {
            kind: kind_of(source.as_ref()),
            context: context.into(),
            source: Some(source),
        }
    }

    pub fn no_such_disk(name: &str) -> Error {
        Error::new(ErrorKind::NoSuchDisk, format!("no disk named \"{name}\""))
    }

    pub fn conflict(context: impl Into<String>) -> Error {
        Error::new(ErrorKind::Conflict, context)
    }

    pub fn busy(context: impl Into<String>) -> Error {
        Error::new(ErrorKind::Busy, context)
    }

    pub fn usage(context: impl Into<String>) -> Error {
        Error::new(ErrorKind::Usage, context)
    }

    pub fn invalid_params(context: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidParams, context)
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// This error as the cause of a wider step, keeping its kind.
    pub fn context(self, context: impl Into<String>) -> Error {
        Error {
            kind: self.kind,
            context: context.into(),
            source: Some(Box::new(self)),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.context)
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn StdError + 'static))
    }
}

/// Adds context to a failed step.
pub trait Context<T> {
    fn context(self, context: impl Into<String>) -> Result<T>;
    fn with_context<S: Into<String>>(self, context: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: Into<Source>> Context<T> for std::result::Result<T, E> {
    fn context(self, context: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::caused(context, e))
    }

    fn with_context<S: Into<String>>(self, context: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| Error::caused(context(), e))
    }
}

/// A volume's online reencryption error as the daemon answers it: the kind its variant
/// names, or its cause's; the message as the volume words it.
impl From<OnlineError> for Error {
    fn from(e: OnlineError) -> Error {
        let kind = match e.kind() {
            OnlineErrorKind::Usage => ErrorKind::Usage,
            OnlineErrorKind::Conflict => ErrorKind::Conflict,
            OnlineErrorKind::BadOption | OnlineErrorKind::Cause => {
                return match e {
                    OnlineError::Prepare(e) => e.into(),
                    OnlineError::Step { context, source } => Error::caused(context, source),
                    other => Error::new(ErrorKind::Other, other.to_string()),
                }
            }
        };
        Error::new(kind, e.to_string())
    }
}

/// Options of a new reencryption refused (`invalid-params`), or a LUKS1 header that could not
/// become LUKS2 (its cause decides).
impl From<PrepareError> for Error {
    fn from(e: PrepareError) -> Error {
        let context = e.to_string();
        match e {
            PrepareError::KeySize { .. } | PrepareError::SectorSize { .. } => {
                Error::invalid_params(context)
            }
            PrepareError::Luks1Convert { source, .. } => Error::caused(
                format!("{context} (offline: `cryptblk convert-header --type luks2`)"),
                source,
            ),
            PrepareError::UnknownCipher { source, .. } | PrepareError::Cipher { source, .. } => {
                Error::caused(context, source)
            }
            PrepareError::CurrentCipher(source) | PrepareError::Luks1Unlock { source, .. } => {
                Error::caused(context, source)
            }
        }
    }
}

/// A configuration that cannot be served; the message names the setting. Checking a disk's
/// configuration (`config`) and its socket's owner and mode (`socket_access`) both find these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidConfig(pub String);

/// The kind of a failure, from the first error in its chain that decides one: a daemon
/// `Error` has its own; a LUKS, block or crypto error says whether the passphrase was wrong,
/// the image damaged or unsupported, locked, or an I/O error.
pub fn kind_of(err: &(dyn StdError + 'static)) -> ErrorKind {
    let mut cause = Some(err);
    while let Some(e) = cause {
        if let Some(kind) = own_kind(e) {
            return kind;
        }
        cause = e.source();
    }
    ErrorKind::Other
}

/// The kind `e` itself decides, if any (a `BlockError` of a generic kind leaves it to its
/// cause, which may be a more specific `LuksError`).
pub fn own_kind(e: &(dyn StdError + 'static)) -> Option<ErrorKind> {
    if let Some(e) = e.downcast_ref::<Error>() {
        return Some(e.kind);
    }
    if let Some(e) = e.downcast_ref::<LuksError>() {
        return Some(match e {
            LuksError::WrongPassphrase | LuksError::NoKeyslots => ErrorKind::WrongPassphrase,
            LuksError::Unsupported { .. } | LuksError::Crypto(CryptoError::Unsupported { .. }) => {
                ErrorKind::Unsupported
            }
            LuksError::NotLuks(_)
            | LuksError::Corrupt(_)
            | LuksError::Truncated(_)
            | LuksError::Keyslot(..) => ErrorKind::Damaged,
            LuksError::PbkdfMemoryLimit { .. } | LuksError::PbkdfCostLimit { .. } => {
                ErrorKind::ResourceLimit
            }
            LuksError::InvalidArgument(_) => ErrorKind::Usage,
            LuksError::Io(_) => ErrorKind::Io,
            _ => ErrorKind::Other,
        });
    }
    if let Some(e) = e.downcast_ref::<BlockError>() {
        return match e.kind() {
            BlockErrorKind::Unsupported => Some(ErrorKind::Unsupported),
            BlockErrorKind::Corrupt => Some(ErrorKind::Damaged),
            BlockErrorKind::Locked => Some(ErrorKind::InUse),
            BlockErrorKind::Io => Some(ErrorKind::Io),
            _ => None,
        };
    }
    if let Some(cryptblk_nbd::Error::PlainTcp { .. }) = e.downcast_ref::<cryptblk_nbd::Error>() {
        return Some(ErrorKind::Usage);
    }
    if let Some(CryptoError::Unsupported { .. } | CryptoError::InvalidKeySize { .. }) =
        e.downcast_ref::<CryptoError>()
    {
        return Some(ErrorKind::Unsupported);
    }
    if e.downcast_ref::<std::io::Error>().is_some() {
        return Some(ErrorKind::Io);
    }
    None
}

/// How many of `e`'s causes its own `Display` already shows. Errors following this crate's
/// rule show none (their context only); these lower-layer errors still render their direct
/// cause (a `#[from]` or `{source}` in their message), so [`chain`] leaves it out.
fn rendered_causes(e: &(dyn StdError + 'static)) -> usize {
    let renders = e.is::<BlockError>()
        || e.is::<VolumeError>()
        || matches!(e.downcast_ref::<LuksError>(), Some(LuksError::Io(_)))
        || matches!(
            e.downcast_ref::<cryptblk_migration::MigrationError>(),
            Some(
                cryptblk_migration::MigrationError::Block(_)
                    | cryptblk_migration::MigrationError::Wire(_)
            )
        )
        || matches!(
            e.downcast_ref::<cryptblk_migration::wire::WireError>(),
            Some(cryptblk_migration::wire::WireError::Io(_))
        )
        || matches!(
            e.downcast_ref::<cryptblk_nbd::Error>(),
            Some(
                cryptblk_nbd::Error::Bind { .. }
                    | cryptblk_nbd::Error::Tls(_)
                    | cryptblk_nbd::Error::Io(_)
            )
        )
        || matches!(
            e.downcast_ref::<cryptblk_vhost_user_blk::Error>(),
            Some(
                cryptblk_vhost_user_blk::Error::Listen { .. }
                    | cryptblk_vhost_user_blk::Error::Io(_)
            )
        );
    usize::from(renders && e.source().is_some())
}

/// `err` and its causes on one line, `context: cause: cause`, each said once. This is where
/// a chain is printed: the RPC answer, the command line's error line, a log line.
pub fn chain(err: &(dyn StdError + 'static)) -> String {
    let mut out = String::new();
    let mut shown_by_earlier = 0;
    let mut cause = Some(err);
    while let Some(e) = cause {
        if shown_by_earlier > 0 {
            // Its text is inside the previous message, and so is what it renders itself.
            shown_by_earlier -= 1;
        } else {
            let text = e.to_string();
            if !text.is_empty() {
                if !out.is_empty() {
                    out.push_str(": ");
                }
                out.push_str(&text);
            }
        }
        shown_by_earlier += rendered_causes(e);
        cause = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_the_context_and_the_chain_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        let e = Error::caused("reading key file /k", io).context("disk \"a\"");
        assert_eq!(e.to_string(), "disk \"a\"");
        assert_eq!(chain(&e), "disk \"a\": reading key file /k: No such file");
        assert_eq!(e.kind(), ErrorKind::Io);
    }

    #[test]
    fn kinds_come_from_typed_causes() {
        let wrong = Error::caused("unlocking", LuksError::WrongPassphrase);
        assert_eq!(wrong.kind(), ErrorKind::WrongPassphrase);
        let locked = BlockError::new(BlockErrorKind::Locked, "in use");
        assert_eq!(Error::caused("opening", locked).kind(), ErrorKind::InUse);
        // A generic block error defers to its cause.
        let inner = BlockError::new(BlockErrorKind::Crypto, "x").with_source(LuksError::NoKeyslots);
        assert_eq!(kind_of(&inner), ErrorKind::WrongPassphrase);
        assert_eq!(Error::busy("b").context("c").kind(), ErrorKind::Busy);
        assert_eq!(kind_of(&std::fmt::Error), ErrorKind::Other);
    }

    #[test]
    fn causes_a_lower_layer_renders_itself_are_not_repeated() {
        let os = || std::io::Error::new(std::io::ErrorKind::PermissionDenied, "Permission denied");
        // A BlockError shows its OS error; a LuksError::Io shows its own too.
        let block = BlockError::io("read", os());
        let e = Error::caused("opening the image", block);
        assert_eq!(
            chain(&e),
            "opening the image: I/O error during read: Permission denied"
        );
        let luks = LuksError::Io(os());
        let e = Error::caused("reading the header", luks);
        assert_eq!(
            chain(&e),
            "reading the header: I/O error: Permission denied"
        );
        // A context-only error in between keeps its cause on the line.
        let inner = Error::caused("reading key file /k", os());
        let e = Error::caused(
            "disk \"a\"",
            BlockError::new(BlockErrorKind::Io, "x").with_source(inner),
        );
        let line = chain(&e);
        assert_eq!(line.matches("Permission denied").count(), 1, "{line}");
    }
}
