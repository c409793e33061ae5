//! Why an online reencryption or encryption stopped or was refused. A refusal before the
//! first write leaves the image as it was; a step that failed later leaves the header saying
//! what is where, and the segment map serving exactly that.
use super::prepare::PrepareError;
use std::error::Error as StdError;

type Source = Box<dyn StdError + Send + Sync + 'static>;

#[derive(Debug, thiserror::Error)]
pub enum OnlineError {
    /// The options of a new run, or the LUKS1 header's conversion.
    #[error(transparent)]
    Prepare(#[from] PrepareError),
    #[error("{image}: the header no longer shows the reencryption this disk serves; detach and attach it again")]
    HeaderLost { image: String },
    #[error("{image}: the header's boundary ({header}) is not the one this disk serves ({served}); detach and attach it again")]
    BoundaryMoved {
        image: String,
        header: u64,
        served: u64,
    },
    #[error("{image}: the header is no longer LUKS2")]
    NotLuks2 { image: String },
    #[error("{image}: the encryption has no new key")]
    NoNewKey { image: String },
    #[error("{image}: the new header shows no encryption")]
    NoEncryption { image: String },
    /// An encryption's start found a header where the plaintext should be (a start that
    /// failed after writing it).
    #[error("{image} has a LUKS header already: detach the disk and attach it with its passphrase, then continue with reencrypt-start")]
    LuksAlready { image: String },
    #[error("reduce-device-size {reduce}: use a multiple of {} bytes (the data moves up by half of it, in whole {granularity}-byte blocks); cryptsetup recommends 32M", 2 * granularity)]
    ShiftGranularity { reduce: u64, granularity: u64 },
    #[error("disk \"{name}\" has {size} bytes, not a whole number of {sector}-byte encryption sectors: give a sector-size that divides it")]
    PartialSector {
        name: String,
        size: u64,
        sector: u64,
    },
    #[error("{image}: {size} bytes are too many to encrypt")]
    TooLarge { image: String, size: u64 },
    /// A step failed (reading or writing the header, fencing a hotzone, rewriting it, ...):
    /// `context` says which, the cause why.
    #[error("{context}")]
    Step {
        context: String,
        #[source]
        source: Source,
    },
}

/// What a caller can do about an [`OnlineError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnlineErrorKind {
    /// An option's value is wrong.
    BadOption,
    /// The request does not fit this disk (its size, the data shift's blocks).
    Usage,
    /// The image's state is not what the request or the served map expects.
    Conflict,
    /// The cause decides (a wrong passphrase, a damaged header, an I/O error, ...).
    Cause,
}

impl OnlineError {
    pub fn kind(&self) -> OnlineErrorKind {
        match self {
            OnlineError::Prepare(e) if e.is_bad_option() => OnlineErrorKind::BadOption,
            OnlineError::Prepare(_) | OnlineError::Step { .. } => OnlineErrorKind::Cause,
            OnlineError::ShiftGranularity { .. }
            | OnlineError::PartialSector { .. }
            | OnlineError::TooLarge { .. } => OnlineErrorKind::Usage,
            OnlineError::HeaderLost { .. }
            | OnlineError::BoundaryMoved { .. }
            | OnlineError::NotLuks2 { .. }
            | OnlineError::NoNewKey { .. }
            | OnlineError::NoEncryption { .. }
            | OnlineError::LuksAlready { .. } => OnlineErrorKind::Conflict,
        }
    }
}

/// Names the step that failed: `result.context("reading the segments")?`.
pub(crate) trait Context<T> {
    fn context(self, context: impl Into<String>) -> Result<T, OnlineError>;
    fn with_context<S: Into<String>>(self, context: impl FnOnce() -> S) -> Result<T, OnlineError>;
}

impl<T, E: Into<Source>> Context<T> for Result<T, E> {
    fn context(self, context: impl Into<String>) -> Result<T, OnlineError> {
        self.map_err(|e| step(context, e))
    }

    fn with_context<S: Into<String>>(self, context: impl FnOnce() -> S) -> Result<T, OnlineError> {
        self.map_err(|e| step(context(), e))
    }
}

/// `cause` while doing `context`.
pub(crate) fn step(context: impl Into<String>, cause: impl Into<Source>) -> OnlineError {
    OnlineError::Step {
        context: context.into(),
        source: cause.into(),
    }
}

/// `err` and its causes on one line, for a log line (`context: cause: cause`); a cause whose
/// text the line shows already (an error that renders its own cause) is not repeated.
pub(crate) fn chain(err: &(dyn StdError + 'static)) -> String {
    let mut out = err.to_string();
    let mut cause = err.source();
    while let Some(e) = cause {
        let text = e.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = e.source();
    }
    out
}
