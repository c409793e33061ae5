//! The one error type of this crate: a small matchable kind plus the context a person needs to
//! act on it (which image, which offset, which operation).

use std::fmt;
use std::path::{Path, PathBuf};

/// What went wrong, coarse enough to match on (retry, report, refuse).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BlockErrorKind {
    /// The request reaches beyond the end of the device.
    OutOfRange,
    /// A write or flush-with-intent-to-modify on a read-only device.
    ReadOnly,
    /// Offset or length not acceptable for this device.
    Unaligned,
    /// The image's metadata is inconsistent or points outside the file.
    Corrupt,
    /// A valid image using a feature cryptblk does not implement.
    Unsupported,
    /// The operating system reported an I/O failure.
    Io,
    /// Sector encryption or decryption failed.
    Crypto,
    /// Another process holds a conflicting lock on the image.
    Locked,
}

impl BlockErrorKind {
    fn describe(self) -> &'static str {
        match self {
            BlockErrorKind::OutOfRange => "out of range",
            BlockErrorKind::ReadOnly => "read-only",
            BlockErrorKind::Unaligned => "unaligned",
            BlockErrorKind::Corrupt => "corrupt image",
            BlockErrorKind::Unsupported => "unsupported",
            BlockErrorKind::Io => "I/O error",
            BlockErrorKind::Crypto => "crypto error",
            BlockErrorKind::Locked => "locked",
        }
    }
}

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An error from a block device, with the path, offset and operation it concerns.
///
/// `Display` is a single line that includes the underlying cause (e.g. the OS error), because
/// that is what users see; `source()` still exposes the cause for programs that inspect it.
#[derive(Debug, thiserror::Error)]
#[error("{}", self.render())]
pub struct BlockError {
    kind: BlockErrorKind,
    message: String,
    path: Option<PathBuf>,
    offset: Option<u64>,
    op: Option<&'static str>,
    #[source]
    source: Option<Source>,
}

impl BlockError {
    pub fn new(kind: BlockErrorKind, message: impl Into<String>) -> Self {
        BlockError {
            kind,
            message: message.into(),
            path: None,
            offset: None,
            op: None,
            source: None,
        }
    }

    /// An OS error during `op`.
    pub fn io(op: &'static str, err: std::io::Error) -> Self {
        // The OS error itself is the message; repeating "read failed" would add nothing.
        BlockError::new(BlockErrorKind::Io, "")
            .with_op(op)
            .with_source(err)
    }

    pub fn corrupt(message: impl Into<String>) -> Self {
        BlockError::new(BlockErrorKind::Corrupt, message)
    }

    pub fn unsupported(message: impl Into<String>) -> Self {
        BlockError::new(BlockErrorKind::Unsupported, message)
    }

    /// A request of `len` bytes at `offset` that does not fit a device of `size` bytes.
    pub fn out_of_range(op: &'static str, offset: u64, len: u64, size: u64) -> Self {
        BlockError::new(
            BlockErrorKind::OutOfRange,
            format!("{len} bytes at offset {offset} extend beyond the device size of {size} bytes"),
        )
        .with_op(op)
    }

    pub fn read_only(op: &'static str) -> Self {
        BlockError::new(BlockErrorKind::ReadOnly, "device is read-only").with_op(op)
    }

    /// Sets the path unless an inner layer already named a more specific one.
    pub fn with_path(mut self, path: &Path) -> Self {
        if self.path.is_none() {
            self.path = Some(path.to_path_buf());
        }
        self
    }

    pub fn at(mut self, offset: u64) -> Self {
        if self.offset.is_none() {
            self.offset = Some(offset);
        }
        self
    }

    pub fn with_op(mut self, op: &'static str) -> Self {
        if self.op.is_none() {
            self.op = Some(op);
        }
        self
    }

    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    pub fn kind(&self) -> BlockErrorKind {
        self.kind
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn offset(&self) -> Option<u64> {
        self.offset
    }

    pub fn operation(&self) -> Option<&'static str> {
        self.op
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    fn render(&self) -> String {
        let mut out = String::new();
        if let Some(p) = &self.path {
            out.push_str(&format!("{}: ", p.display()));
        }
        out.push_str(self.kind.describe());
        if let Some(op) = self.op {
            out.push_str(&format!(" during {op}"));
        }
        if let Some(off) = self.offset {
            out.push_str(&format!(" at offset {off}"));
        }
        if !self.message.is_empty() {
            out.push_str(&format!(": {}", self.message));
        }
        if let Some(src) = &self.source {
            out.push_str(&format!(": {src}"));
        }
        out
    }
}

impl fmt::Display for BlockErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// Checks that `len` bytes at `offset` lie within a device of `size` bytes (for a device's
/// `BlockDevice` methods and a queue's range check).
pub fn check_range(op: &'static str, offset: u64, len: u64, size: u64) -> Result<(), BlockError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(BlockError::out_of_range(op, offset, len, size).at(offset)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_one_line_with_context() {
        let e = BlockError::io("read", std::io::Error::from_raw_os_error(libc::EIO))
            .at(4096)
            .with_path(Path::new("/img/a.qcow2"));
        let s = e.to_string();
        assert!(
            s.starts_with("/img/a.qcow2: I/O error during read at offset 4096"),
            "{s}"
        );
        assert!(!s.contains('\n'));
        assert_eq!(e.kind(), BlockErrorKind::Io);
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn inner_context_wins() {
        let e = BlockError::corrupt("bad")
            .with_path(Path::new("/inner"))
            .with_path(Path::new("/outer"));
        assert_eq!(e.path(), Some(Path::new("/inner")));
    }
}
